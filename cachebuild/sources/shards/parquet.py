"""Parquet shards in the Hugging Face layout (``data/train-00000-of-00004.parquet``: an ``image`` column
``struct<bytes, path>`` or plain binary, an integer ``label`` column, class names in the schema's
``huggingface`` metadata as a ``ClassLabel``).

Planning reads each file's footer and its label column only. Workers read the image bytes of one row group
at a time (only that column: ``image.bytes``), keep it while the block's samples in it are decoded, and
move on: a row group is read once per block that touches it, never per sample.

Order: files by name, then rows in file order. Provenance: ``file.parquet#ROW`` (the row within its file).
A null label, a negative one (unlabelled, as Hugging Face test splits are) or one outside the classes, and a
row whose image has no bytes, are failures with their reason.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachebuild.errors import DecodeError, SourceError
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan
from cachebuild.sources.sample_table import SampleTable
from cachebuild.sources.shards.files import Shard, forget_handle, is_url, open_shard, retrying, thread_handle
from cachebuild.sources.shards.plan import ShardPart, plan_shards, split_option
from cachebuild.storage.locations.url_files import url_files

__all__ = ["ParquetColumns", "ParquetOptions", "ParquetRowReader", "ParquetSource", "hf_features", "parquet_plan"]

_ROW_GROUP_READ = 8 << 20  # URL readahead while reading a row group's image column


@dataclass(frozen=True)
class ParquetColumns:
    image: str | None = None  # None: "image", else the one column the metadata calls an Image
    label: str | None = None  # None: "label", else the one column the metadata calls a ClassLabel


def hf_features(schema: Any) -> dict[str, Any]:
    """The ``datasets`` features recorded in a Parquet schema's ``huggingface`` metadata ({} when absent)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        features = json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return {}
    return features if isinstance(features, dict) else {}


def _pick(kind: str, wanted: str | None, default: str, names: list[str], features: dict[str, Any],
          url: str) -> str:
    if wanted is not None:
        if wanted not in names:
            raise SourceError(f"{url} has no column {wanted!r} (its columns: {', '.join(names)}); "
                              f"pass --{kind}-column with one of them")
        return wanted
    if default in names:
        return default
    hf_type = "Image" if kind == "image" else "ClassLabel"
    typed = [n for n in names if isinstance(features.get(n), dict) and features[n].get("_type") == hf_type]
    if len(typed) == 1:
        return typed[0]
    raise SourceError(f"{url} has no {kind} column: no column {default!r}"
                      + (f" nor one {hf_type} feature in its metadata" if len(typed) != 1 else "")
                      + f" (its columns: {', '.join(names)}); pass --{kind}-column NAME")


def _image_field(schema: Any, column: str, url: str) -> str:
    """The leaf to read: ``column.bytes`` for the Hugging Face struct, ``column`` for plain binary."""
    import pyarrow as pa

    t = schema.field(column).type
    if pa.types.is_struct(t):
        if t.get_field_index("bytes") >= 0 and (pa.types.is_binary(t.field("bytes").type)
                                                or pa.types.is_large_binary(t.field("bytes").type)):
            return f"{column}.bytes"
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return column
    raise SourceError(f"{url}: column {column!r} is {t}, not image bytes (binary, or a struct with a binary "
                      f"'bytes' field as Hugging Face writes images)")


@dataclass(frozen=True)
class _FileInfo:
    image_field: str  # "image.bytes" or a binary column
    class_names: list[str] | None  # the ClassLabel's names in the file's metadata


def _index_file(shard: Shard, columns: ParquetColumns) -> ShardPart:
    """A file's rows for :func:`~cachebuild.sources.shards.plan.plan_shards`: row group and row within it, labels
    (a null one is a problem), from its footer and label column only."""
    import pyarrow.parquet as pq

    with open_shard(shard, block_size=1 << 20) as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a damaged or non-Parquet file
            raise SourceError(f"{shard.url} is not a readable Parquet file ({e})") from None
        schema = pf.schema_arrow
        names = list(schema.names)
        features = hf_features(schema)
        image = _pick("image", columns.image, "image", names, features, shard.url)
        label = _pick("label", columns.label, "label", names, features, shard.url)
        import pyarrow as pa

        if not pa.types.is_integer(schema.field(label).type):
            raise SourceError(f"{shard.url}: label column {label!r} is {schema.field(label).type}, not integers "
                              f"(class indices)")
        image_field = _image_field(schema, image, shard.url)
        meta = pf.metadata
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        col = pf.read(columns=[label]).column(label)
    names_ = features.get(label, {}).get("names") if isinstance(features.get(label), dict) else None
    nulls = np.asarray(col.is_null().to_numpy(zero_copy_only=False), bool)
    n = int(sum(groups))
    rows = np.concatenate([np.arange(g, dtype=np.int32) for g in groups]) if n else np.zeros(0, np.int32)
    return ShardPart([str(r) for r in range(n)], np.asarray(col.fill_null(-1).to_numpy(zero_copy_only=False), np.int64),
                     {"group": np.repeat(np.arange(len(groups), dtype=np.int32), groups), "row": rows},
                     {int(r): "no label (null)" for r in np.flatnonzero(nulls)},
                     _FileInfo(image_field, [str(c) for c in names_] if isinstance(names_, list) else None))


class _Group(threading.local):
    """The row group this thread read last: ((url, size, version, group), its image column)."""

    def __init__(self) -> None:
        self.last: tuple[tuple[str, int, str, int], Any] | None = None


_group = _Group()


def _open_parquet(shard: Shard) -> Any:
    import pyarrow.parquet as pq

    if is_url(shard.url):
        return pq.ParquetFile(url_files(shard.url).open(shard.url, shard.size, _ROW_GROUP_READ))
    size = os.stat(shard.url).st_size
    if size != shard.size:
        raise SourceError(f"{shard.url} changed since it was planned ({shard.size} -> {size} bytes); "
                          f"run the command again to plan it afresh")
    return pq.ParquetFile(shard.url, memory_map=False)


def _parquet_file(shard: Shard) -> Any:
    return thread_handle(("parquet", shard.url, shard.size, shard.version), lambda: _open_parquet(shard),
                         lambda pf: pf.close())


def _forget(shard: Shard) -> None:
    forget_handle(("parquet", shard.url, shard.size, shard.version))
    _group.last = None


@dataclass(frozen=True)
class ParquetRowReader:
    """Reads a planned sample's image bytes from its row group (picklable; runs in the build's workers)."""

    files: tuple[Shard, ...]
    image_fields: tuple[str, ...]  # per file: "image.bytes" or a binary column
    table: SampleTable  # columns: file (int32), group (int32), row (int32, within the row group)

    def for_block(self, start: int, stop: int) -> ParquetRowReader:
        table = self.table.slice(start, stop)
        fields, _ = table.only_used("file", self.image_fields)
        files, table = table.only_used("file", self.files)
        return ParquetRowReader(files, fields, table)

    def _group(self, f: int, group: int) -> Any:
        shard = self.files[f]
        key = (shard.url, shard.size, shard.version, group)
        if _group.last is not None and _group.last[0] == key:
            return _group.last[1]
        _group.last = None  # let the previous row group go before reading the next
        field = self.image_fields[f]

        def read() -> Any:
            t = _parquet_file(shard).read_row_group(group, columns=[field])
            col = t.column(0)
            if col.type.num_fields:  # struct<bytes>: its one child, null where the struct is
                col = col.combine_chunks().flatten()[0]
            return col

        column = retrying(shard, read, lambda: _forget(shard))
        _group.last = (key, column)
        return column

    def __call__(self, index: int, key: str) -> bytes:
        row = self.table.row(index, key)
        c = self.table.columns
        f = int(c["file"][row])
        data = self._group(f, int(c["group"][row]))[int(c["row"][row])].as_py()
        if data is None:
            raise DecodeError(key, "the row has no image bytes (null: an image stored only by path?)")
        return data


@dataclass(frozen=True)
class _ParquetFiles:
    """Parquet files for :func:`~cachebuild.sources.shards.plan.plan_shards`."""

    columns: ParquetColumns
    suffix = ".parquet"
    what = "Parquet files"
    source_format = "parquet"
    shard_column = "file"
    threads = True  # a footer and a label column per file: I/O, and pyarrow releases the GIL
    nothing = "Parquet file(s) hold no rows"

    def index(self, shard: Shard) -> ShardPart:
        return _index_file(shard, self.columns)

    def found_classes(self, parts: list[ShardPart], src: str) -> list[str] | None:
        named = [p.info.class_names for p in parts if p.info.class_names is not None]
        if named and any(n != named[0] for n in named):
            raise SourceError(f"{src}: its files name different classes in their metadata; pass --classes FILE")
        return named[0] if named else None

    def digest_extra(self, parts: list[ShardPart], classes: list[str]) -> dict[str, Any]:
        return {"columns": self.columns.__dict__, "fields": [p.info.image_field for p in parts], "classes": classes}

    def reader(self, shards: tuple[Shard, ...], parts: list[ShardPart], table: SampleTable) -> ParquetRowReader:
        return ParquetRowReader(shards, tuple(p.info.image_field for p in parts), table)


def parquet_plan(src: str | os.PathLike[str], *, split: str | None = None, classes: list[str] | None = None,
                 columns: ParquetColumns = ParquetColumns(), dataset: str | None = None, jobs: int = 1) -> Plan:
    """Plan the Parquet files at ``src`` (a folder, prefix, glob, brace pattern or file; local or URL)."""
    return plan_shards(_ParquetFiles(columns), src, split=split, classes=classes, dataset=dataset, jobs=jobs)


@dataclass(frozen=True)
class ParquetOptions(SourceOptions):
    split: str | None = split_option()
    image_column: str | None = option(None, "Column of image bytes (binary, or Hugging Face's struct<bytes, "
                                            "path>). Default: image, else the column the metadata calls an Image.",
                                      metavar="NAME")
    label_column: str | None = option(None, "Column of class indices. Default: label, else the column the "
                                            "metadata calls a ClassLabel.", metavar="NAME")
    dataset: str | None = option(None, "Dataset name (default: from SRC).", flag="--name")

    def to_dict(self) -> dict[str, Any]:  # the recipe nests the columns
        return {"split": self.split, "dataset": self.dataset,
                "columns": {"image": self.image_column, "label": self.label_column}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParquetOptions:
        columns = dict(data.get("columns") or {})
        return cls(split=data.get("split"), dataset=data.get("dataset"), image_column=columns.get("image"),
                   label_column=columns.get("label"))


class ParquetSource(SourceKind):
    name = "parquet"
    options = ParquetOptions
    help = ("Parquet files at SRC in the Hugging Face layout (data/train-00000-of-00004.parquet): a folder or "
            "prefix, a glob, a brace pattern or one file; local or a URL. Class names come from the ClassLabel in "
            "the files' metadata unless --classes is given. Needs pyarrow (cachebuild[parquet]).")
    pins_classes = True
    classes_flag = True

    def check(self) -> None:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise SourceError("reading Parquet needs pyarrow: pip install 'cachebuild[parquet]'") from None

    def plan(self, src: str, options: ParquetOptions, *, classes: list[str] | None = None,
             jobs: int = 1) -> list[Plan]:
        columns = ParquetColumns(image=options.image_column, label=options.label_column)
        return [parquet_plan(src, split=options.split, classes=classes, columns=columns, dataset=options.dataset,
                             jobs=jobs)]
