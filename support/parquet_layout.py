"""Image files packed as Hugging Face Parquet shards, as ``datasets`` writes them and the Hub serves them:
``data/<split>-00000-of-0000N.parquet``, an ``image`` column ``struct<bytes: binary, path: string>`` (the
original file's bytes and name), an integer ``label`` column, and the features in the schema's ``huggingface``
metadata (``Image``, ``ClassLabel`` with the class names).

``quirks=True`` adds what real files hold: row groups of uneven size that do not line up with anything, an
extra column, and (``legacy_metadata=True``) the older metadata style (``decode``, ``id``, ``num_classes``).
``broken=True`` adds a row whose image has a path but no bytes and a row with a null label.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from support.wds_layout import PackedImage

__all__ = ["hf_features_metadata", "write_hf_parquet"]


def hf_features_metadata(class_names: list[str], *, legacy: bool = False, image_column: str = "image",
                         label_column: str = "label") -> bytes:
    """The ``huggingface`` schema metadata ``datasets`` writes for an Image + ClassLabel dataset."""
    if legacy:
        features = {image_column: {"decode": True, "id": None, "_type": "Image"},
                    label_column: {"num_classes": len(class_names), "names": class_names, "id": None,
                                   "_type": "ClassLabel"}}
    else:
        features = {image_column: {"_type": "Image"}, label_column: {"names": class_names, "_type": "ClassLabel"}}
    return json.dumps({"info": {"features": features}}).encode()


def write_hf_parquet(images: list[PackedImage], dest: Path, class_names: list[str], *, split: str = "train",
                     n_files: int = 2, rows_per_group: int = 7, seed: int = 0, shuffle: bool = True,
                     quirks: bool = False, broken: bool = False, legacy_metadata: bool = False) -> dict[str, Any]:
    """Write ``images`` as ``dest/data/<split>-NNNNN-of-NNNNN.parquet``; deterministic from ``seed``.

    Returns ``files`` (paths), ``rows`` (one dict per row in file order: ``file``, ``row`` (in its file),
    ``label`` (None when null), ``image`` (the PackedImage; None when the row has no bytes)), and ``broken``:
    kind -> that row's dict.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(images)) if shuffle else np.arange(len(images))
    rows: list[dict[str, Any]] = [{"image": images[i], "label": images[i].label, "kind": None,
                                   "path": images[i].name} for i in order.tolist()]
    if broken:
        donor = rows[0]["image"]
        rows.insert(min(2, len(rows)), {"image": None, "label": donor.label, "kind": "no_bytes",
                                        "path": donor.name})
        rows.insert(min(5, len(rows)), {"image": donor, "label": None, "kind": "null_label", "path": donor.name})
    folder = Path(dest) / "data"
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(rows) // n_files)
    meta = {b"huggingface": hf_features_metadata(class_names, legacy=legacy_metadata)}
    out: dict[str, Any] = {"files": [], "rows": [], "broken": {}}
    for f in range(n_files):
        part = rows[f * per_file : (f + 1) * per_file]
        path = folder / f"{split}-{f:05d}-of-{n_files:05d}.parquet"
        columns: dict[str, Any] = {
            "image": pa.array([{"bytes": r["image"].data if r["image"] is not None else None, "path": r["path"]}
                               for r in part], pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "label": pa.array([r["label"] for r in part], pa.int64()),
        }
        if quirks:
            columns["image_id"] = pa.array([Path(r["path"]).stem for r in part], pa.string())
        table = pa.table(columns).replace_schema_metadata(meta)
        with pq.ParquetWriter(path, table.schema) as writer:
            # uneven row groups: rows_per_group, then a smaller one, and so on
            pos, k = 0, 0
            while pos < len(part):
                n = rows_per_group if not quirks or k % 2 == 0 else max(1, rows_per_group // 2)
                writer.write_table(table.slice(pos, n), row_group_size=n)
                pos, k = pos + n, k + 1
        out["files"].append(path)
        for i, r in enumerate(part):
            entry = {"file": path, "row": i, "label": r["label"], "image": r["image"]}
            out["rows"].append(entry)
            if r["kind"] is not None:
                out["broken"][r["kind"]] = entry
    return out
