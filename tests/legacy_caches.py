"""Caches of the formats before version 4 (sha256 checksums), for the tests that read, verify, pull and update them.

Two sources: the caches under ``tests/cachebuild/format/legacy/`` that the previous release really wrote
(``make_legacy_caches.py`` there), and :func:`as_sha256_cache`, which rewrites a cache this release built as
that release would have written it, by hand (hashlib and json only, none of cachebuild's checksum code), for
tests that need an older cache of something else (an image tree to ``--update``). The tests check the second
against the first (``test_digests.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

LEGACY = Path(__file__).resolve().parent / "cachebuild" / "format" / "legacy"
_BLANK = "0" * 64


def legacy_copy(name: str, dst: Path) -> Path:
    """A writable copy of the legacy cache ``name`` (``v2-npy``, ``v2-jpeg``, ``v2-zarr``, ``v3-npy-columns``)."""
    shutil.copytree(LEGACY / name, dst)
    return dst


def legacy_images() -> np.ndarray:
    """The pixels every legacy cache holds (``make_legacy_caches.images``)."""
    i = np.arange(10, dtype=np.int64)
    img = ((i[:, None, None, None] * 7 + np.arange(8)[:, None, None] * 3 + np.arange(6)[:, None] * 5
            + np.arange(3)) % 251).astype(np.uint8)
    return np.broadcast_to(img, (10, 8, 6, 3)).copy()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def seal(d: dict[str, Any]) -> bytes:
    """``manifest.json``'s bytes for the fields ``d``, sealed as every release does (FORMAT.md, ``checksum``)."""
    data = (json.dumps({**d, "checksum": _BLANK}, indent=1, ensure_ascii=False) + "\n").encode()
    at = data.rindex(_BLANK.encode())
    return data[:at] + _sha(data).encode() + data[at + len(_BLANK):]


def _zarr_rows(folder: Path, start: int, count: int) -> bytes:
    import zarr

    return np.ascontiguousarray(zarr.open_array(folder / "images.zarr", mode="r")[start : start + count]).tobytes()


def as_sha256_cache(folder: Path, version: int = 2) -> None:
    """Rewrite the version 4 cache in ``folder`` as a release of format ``version`` (1, 2 or 3) wrote it: every
    checksum sha256 under the key ``sha256``, no ``digest_algorithm``, ``files.json`` without its ``digest``
    and in that release's bytes, ``source_files.json`` without the digests of the source files' bytes, the
    build's ``format_version`` 2 with the key that release gave it, sealed. Version 1: an npy shard's checksum is
    of its pixel rows alone."""
    path = folder / "manifest.json"
    d = json.loads(path.read_text())
    assert d.pop("checksum") and d["format_version"] == 4 and d.pop("digest_algorithm") == "xxh3-128"
    for s in d["shards"]:
        del s["digest"]
        if d["storage"] == "zarr":
            s["sha256"] = _sha(_zarr_rows(folder, s["start"], s["count"]))
        elif version == 1:
            s["sha256"] = _sha(np.ascontiguousarray(np.load(folder / s["file"])).tobytes())
        else:
            s["sha256"] = _sha((folder / s["file"]).read_bytes())
    for a in d["arrays"].values():
        del a["digest"]
        raw = (folder / a["file"]).read_bytes()  # paths.json: the file; the others: their raw C-order values
        a["sha256"] = _sha(raw if a["dtype"] == "str" else np.ascontiguousarray(np.load(folder / a["file"])).tobytes())
    for c in d.get("columns", {}).values():
        del c["digest"]
        c["sha256"] = _sha((folder / c["file"]).read_bytes())
    inputs = d["source"].get("inputs")
    if inputs:
        del inputs["digest"]
        table = json.loads((folder / inputs["file"]).read_text())
        if table.pop("digests", None) is not None:  # those releases recorded no digest of the source files' bytes
            del table["digest"]
            (folder / inputs["file"]).write_text(json.dumps(table, ensure_ascii=True))
        inputs["sha256"] = _sha((folder / inputs["file"]).read_bytes())
    if d.get("files"):
        table = json.loads((folder / "files.json").read_text())
        rows = [[name, (folder / name).stat().st_size, _sha((folder / name).read_bytes())]
                for name, _, _ in table["files"]]
        body = ",\n".join(json.dumps(r, ensure_ascii=True) for r in rows)
        data = f'{{"format": "cachebuild-files", "files": [\n{body}\n]}}\n'.encode()
        (folder / "files.json").write_bytes(data)
        d["files"] = {"table": d["files"]["table"], "sha256": _sha(data), "count": d["files"]["count"],
                      "bytes": sum(size for _, size, _ in rows)}
    d["format_version"] = version
    if "format_version" in d["build"]:  # a build's (write_cache's key is of the pixels: the same in every version)
        d["build"]["format_version"] = 2
        if d["build"].get("exif_orientation") == "ignore":
            d["build"]["exif_orientation"] = "ignored"  # how those releases wrote the one choice they had
        params = {k: v for k, v in d["build"].items() if k not in ("key", "on_error", "exif_orientation")}
        blob = json.dumps({"source": d["source"]["fingerprint"], "params": params}, sort_keys=True).encode()
        d["build"]["key"] = _sha(blob)  # builder.options.build_key, as that release computed it
    path.write_bytes(seal(d))
