"""MosaicML Streaming MDS datasets (``index.json`` + ``shard.00000.mds`` ...), read from their layout; streaming
is not imported.

``index.json`` (version 2) lists the shards in order, each with its ``samples``, its file (``raw_data``:
basename and bytes; ``zip_data`` when compressed) and its columns: ``column_names`` (sorted),
``column_encodings`` and ``column_sizes`` (None: variable). A shard is uint32 ``n``, ``n + 1`` uint32 record
offsets, the shard's JSON config, then the records (:mod:`~cachebuild.sources.peers.records`).

Images: a ``jpeg``, ``png`` or ``bytes`` column (image files' bytes), ``pil`` (raw pixels with their mode) or
``ndarray`` of uint8 (H, W[, C]). Labels: ``int``, ``int8``...``uint64`` or ``str_int``. ``pkl`` columns are
never unpickled. Compressed shards are read where their decompressed file is beside them (Streaming leaves one
when it downloads), else refused.

Order: shards in index order, then records in shard order. Provenance: ``shard.00000.mds#INDEX``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachebuild.errors import SourceError
from cachebuild.sources.kind import SourceKind
from cachebuild.sources.peers.common import PeerFile, PeerOptions
from cachebuild.sources.peers.indexed import (
    count_of,
    dataset_dir,
    entries,
    index_fields,
    index_plan,
    plain_name,
    read_index,
    shard_samples,
)
from cachebuild.sources.plan import Plan

__all__ = ["MdsSource", "mds_plan"]

_WHAT = "Streaming MDS dataset"
_ENCODED = ("jpeg", "png", "bytes")
_LISTS = ("jpeg_array", "jpegarray", "list[pil]", "list[jpeg]", "list[png]")
_LABELS = {"int": "<i8", "int8": "<i1", "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "<u1",
           "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "str_int": "str"}


def image_codec(encoding: str) -> str:
    """The codec of an MDS image column; ValueError saying why an encoding is not one."""
    base, _, config = encoding.partition(":")
    if encoding in _ENCODED:
        return "encoded"
    if encoding == "pil":
        return "pil"
    if base == "ndarray":
        dtype, _, shape = config.partition(":")
        if dtype and dtype != "uint8":
            raise ValueError(f"an ndarray of {dtype}: only uint8 images are read")
        if shape and not dtype:
            raise ValueError("an ndarray of fixed shape but per-sample dtype: write it as ndarray:uint8[:H,W,C]")
        if shape:
            dims = shape.split(",")
            if (len(dims) not in (2, 3) or (len(dims) == 3 and dims[2] not in ("1", "3", "4"))
                    or not all(d.isdigit() and 0 < int(d) < 2**31 for d in dims)):
                raise ValueError(f"an ndarray of shape ({shape}): not an image (H, W[, 1|3|4])")
            return "raw:" + ",".join(str(int(d)) for d in dims)
        return "mds-ndarray:uint8" if dtype else "mds-ndarray"
    if encoding in _LISTS:
        raise ValueError("several images per sample: not read (one image a sample)")
    if encoding == "pkl":
        raise ValueError("pickled objects: cachebuild never unpickles")
    raise ValueError("not an image encoding (jpeg, png, bytes, pil or ndarray:uint8)")


def _label_kind(encoding: str) -> str:
    if encoding not in _LABELS:
        raise ValueError("not an integer encoding (int, int8...uint64 or str_int)")
    return _LABELS[encoding]


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _shards(folder: Path, index: dict[str, Any], where: str) -> list[tuple[dict[str, Any], PeerFile]]:
    if index.get("version") != 2 or not isinstance(index.get("shards"), list):
        raise SourceError(f"{where}: not a Streaming index of version 2 (version {index.get('version')!r}, "
                          f"{'a' if isinstance(index.get('shards'), list) else 'no'} shard list)")
    out = []
    for shard in entries(index, "shards", where, "shard"):
        fmt = shard.get("format")
        if fmt != "mds":
            raise SourceError(f"{where}: a shard of format {fmt!r}: only MDS shards are read (Streaming's json, "
                              f"csv and tsv shards are not image datasets' formats)")
        raw = shard.get("raw_data")
        if not isinstance(raw, dict):
            raise SourceError(f"{where}: a shard whose raw_data is {type(raw).__name__}, not an object: damaged "
                              f"index; write it again")
        name = plain_name(raw.get("basename"), where, "shard")
        size = count_of(raw.get("bytes"), where, f"the size of shard {name}")
        count_of(shard.get("samples"), where, f"the sample count of shard {name}")
        path = folder / name
        if shard.get("zip_data") and not path.is_file():
            zipped = _mapping(shard["zip_data"]).get("basename")
            raise SourceError(f"{folder / str(zipped)}: compressed ({shard.get('compression')}) and its decompressed "
                              f"{name} is not beside it: decompress the shards first, or write them with "
                              f"compression=None")
        f = PeerFile.stat(path, name, "MDS shard")
        if f.size != size:
            state = "truncated" if f.size < size else "not the file the index describes"
            raise SourceError(f"{f.path}: {f.size:,} bytes where index.json says {size!r}: {state}; copy the dataset "
                              f"again or write it again")
        out.append((shard, f))
    if not out:
        raise SourceError(f"{where}: the index lists no shards")
    return out


def _columns(shards: list[tuple[dict[str, Any], PeerFile]], where: str) -> tuple[list[str], list[str], list[Any]]:
    names, encodings, sizes = (shards[0][0].get(k) for k in ("column_names", "column_encodings", "column_sizes"))
    for shard, f in shards:
        if [shard.get(k) for k in ("column_names", "column_encodings", "column_sizes")] != [names, encodings, sizes]:
            raise SourceError(f"{where}: shard {f.name} has other columns than {shards[0][1].name}: one dataset "
                              f"has one set of columns")
    if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
            and len(names) == len(encodings) == len(sizes) and len(set(map(str, names))) == len(names)
            and all(isinstance(x, str) for x in (*names, *encodings))
            and all(s is None or (isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32) for s in sizes)):
        raise SourceError(f"{where}: damaged column lists (names and encodings strings, names unique, sizes "
                          f"counts or null, all three of one length); write it again")
    return list(names), list(encodings), sizes


def mds_plan(src: str | Path, options: PeerOptions, classes: list[str] | None = None) -> Plan:
    """Plan the samples of the MDS dataset at ``src`` (its folder, or a folder of split folders)."""
    folder = dataset_dir(src, options.split, _WHAT)
    index_file, index = read_index(folder, _WHAT)
    where = index_file.path
    shards = _shards(folder, index, where)
    names, encodings, sizes = _columns(shards, where)
    found = dict(zip(names, encodings, strict=True))
    image, label = index_fields(found, options, image_codec, _label_kind, where)
    codec, i_img, i_lab = image_codec(found[image]), names.index(image), names.index(label)
    samples = shard_samples([(f, int(shard["samples"])) for shard, f in shards], sizes, i_img, i_lab,
                            _LABELS[found[label]], "MDS shard")
    return index_plan(samples, codec=codec, folder=folder, options=options, classes=classes, index_file=index_file,
                      fields=(image, label), source_format="mds")


class MdsSource(SourceKind):
    name = "mds"
    options = PeerOptions
    help = ("A MosaicML Streaming MDS dataset at SRC (the folder of index.json and shard.*.mds; or a folder of "
            "split folders, with --split), read without streaming. Images: a jpeg, png, bytes, pil or ndarray:uint8 "
            "column; labels: an integer column. Decoded and resized as any build; provenance SHARD#INDEX.")
    url_src = False
    pins_classes = True
    classes_flag = True

    def plan(self, src: str, options: PeerOptions, *, classes: list[str] | None = None, jobs: int = 1) -> list[Plan]:
        return [mds_plan(src, options, classes)]
