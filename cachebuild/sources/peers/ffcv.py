"""FFCV ``.beton`` files (format version 2, as ffcv 1.0 writes them), read from their layout; ffcv is not imported.

The layout (little-endian throughout; ``ffcv/types.py``, ``reader.py``, ``writer.py``, ``fields/``):

- header (24 bytes, aligned): uint16 version, uint16 field count, uint32 page size, uint64 sample count,
  uint64 offset of the allocation table;
- one descriptor per field (1,041 bytes, aligned): uint8 type id, 16-byte NUL-padded ASCII name, 1,024 bytes
  of field arguments (an NDArrayField's shape and dtype);
- the metadata table: one aligned record per sample of every field's metadata (IntField int64, FloatField
  float64, RGBImageField packed {uint8 mode, uint16 width, uint16 height, uint64 data pointer}, BytesField and
  JSONField {uint64 pointer, uint64 size}, NDArrayField and TorchTensorField a uint64 pointer);
- data pages; then the allocation table to the end of the file: (uint64 sample id, pointer, size) for every
  payload, which gives an image's size from its pointer.

Images: an RGBImageField (each sample JPEG, mode 0, or raw RGB of its recorded width and height, mode 1: 'smart'
writes mix them), a BytesField of image file bytes, or a uint8 NDArrayField of shape (H, W[, C]). Labels: an
IntField. A field of a type this reader does not know (a custom field, type id 255) makes the metadata's
layout unknowable, so such a file is refused, as are a cut file and a file that is not a .beton.

Order: sample order of the file. Provenance: ``NAME.beton#INDEX``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.kind import SourceKind
from cachebuild.sources.peers.common import (
    PeerFile,
    PeerOptions,
    Samples,
    first_payload_check,
    peer_plan,
    pick_field,
    split_of,
)
from cachebuild.sources.plan import Plan
from cachebuild.sources.shards.plan import dataset_name

__all__ = ["FFCV_VERSION", "FfcvSource", "ffcv_plan"]

FFCV_VERSION = 2
_HEADER = np.dtype([("version", "<u2"), ("num_fields", "<u2"), ("page_size", "<u4"), ("num_samples", "<u8"),
                    ("alloc_table_ptr", "<u8")], align=True)
_FIELD = np.dtype([("type_id", "<u1"), ("name", ("<u1", 16)), ("arguments", ("<u1", (1024,)))], align=True)
_ALLOC = np.dtype([("sample_id", "<u8"), ("ptr", "<u8"), ("size", "<u8")])
_PTR_SIZE = np.dtype([("ptr", "<u8"), ("size", "<u8")])
_ND_ARGS = np.dtype([("shape", "<u8", 32), ("type_length", "<u8")])
_MAX_ARRAY_BYTES = 1 << 32  # one sample's array: larger is a damaged shape, not an image
_ALLOCATING = (2, 3, 4, 5, 6)  # field types whose payloads the allocation table lists, one row per sample
# type id -> (the type's name, its metadata record)
_TYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("FloatField", np.dtype("<f8")),
    1: ("IntField", np.dtype("<i8")),
    2: ("RGBImageField", np.dtype([("mode", "<u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")])),
    3: ("BytesField", _PTR_SIZE),
    4: ("NDArrayField", np.dtype("<u8")),
    5: ("JSONField", _PTR_SIZE),
    6: ("TorchTensorField", np.dtype("<u8")),
}


@dataclass(frozen=True)
class _Field:
    name: str
    type_id: int
    arguments: bytes

    @property
    def kind(self) -> str:
        return _TYPES[self.type_id][0]

    def ndarray(self) -> tuple[np.dtype, tuple[int, ...]]:
        """An NDArrayField's (dtype, shape), from its arguments; ValueError saying why they are not one."""
        head = np.frombuffer(self.arguments[:_ND_ARGS.itemsize], _ND_ARGS)[0]
        n = int(head["type_length"])
        if n > len(self.arguments) - _ND_ARGS.itemsize:
            raise ValueError(f"a dtype description of {n:,} bytes, past the field's arguments")
        try:
            descr = json.loads(self.arguments[_ND_ARGS.itemsize:_ND_ARGS.itemsize + n].decode("ascii"))
            dtype = np.dtype([tuple(d) for d in descr])["f0"]
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"its dtype description cannot be read ({type(e).__name__}: {e})") from None
        shape = [int(d) for d in head["shape"]]
        while shape and shape[-1] == 0:
            shape.pop()
        if 0 in shape or math.prod(shape) * max(dtype.itemsize, 1) > _MAX_ARRAY_BYTES:
            raise ValueError(f"an array of shape {tuple(shape)} of {dtype}: empty, or larger than any sample")
        return dtype, tuple(shape)

    def described(self) -> str:
        if self.type_id in (4, 6):
            dtype, shape = self.ndarray()
            return f"{self.kind} {dtype} {shape}"
        return self.kind


def _read_layout(f: PeerFile) -> tuple[Any, list[_Field]]:
    if f.size < _HEADER.itemsize:
        raise SourceError(f"{f.path}: {f.size} bytes, shorter than an FFCV header: not a .beton, or truncated")
    header = np.frombuffer(f.read(0, _HEADER.itemsize), _HEADER)[0]
    if int(header["version"]) != FFCV_VERSION:
        raise SourceError(f"{f.path}: header version {int(header['version'])}, not {FFCV_VERSION} (FFCV 1.0's): "
                          f"not an FFCV .beton, or one of a format this cachebuild cannot read")
    n_fields, table = int(header["num_fields"]), int(header["alloc_table_ptr"])
    fields_end = _HEADER.itemsize + n_fields * _FIELD.itemsize
    if not 0 < n_fields <= 255 or fields_end > f.size:
        raise SourceError(f"{f.path}: header says {n_fields} fields: not an FFCV .beton, or truncated")
    if table > f.size:
        raise SourceError(f"{f.path} is truncated ({f.size:,} bytes; its header puts the allocation table at byte "
                          f"{table:,}, past its end): copy it again or write it again")
    raw = np.frombuffer(f.read(_HEADER.itemsize, n_fields * _FIELD.itemsize), _FIELD)
    fields = [_Field(bytes(d["name"]).split(b"\0")[0].decode("ascii", "replace"), int(d["type_id"]),
                     bytes(d["arguments"])) for d in raw]
    for fd in fields:
        if fd.type_id not in _TYPES:
            raise SourceError(f"{f.path}: field {fd.name!r} has FFCV type id {fd.type_id} (a custom field), whose "
                              f"metadata size only its own code knows, so no sample of this file can be located; "
                              f"write the file again without it (or with it as a BytesField)")
        if fd.type_id in (4, 6):
            try:
                fd.ndarray()
            except ValueError as e:
                raise SourceError(f"{f.path}: field {fd.name!r} ({fd.kind}): its arguments are not an array's "
                                  f"shape and dtype ({e}): damaged; write the file again") from None
    names = [fd.name for fd in fields]
    if len(set(names)) != len(names):
        raise SourceError(f"{f.path}: two fields of one name ({', '.join(names)}): damaged; write the file again")
    return header, fields


def _check_allocations(f: PeerFile, fields: list[_Field], n: int, meta_end: int, table: int) -> None:
    """The allocation table runs from ``table`` to the end of the file, one row per payload: ffcv's writer
    allocates one for each sample in each field that stores data outside the metadata. Fewer rows means the file
    was cut short, by whole rows (its length says nothing then): refused, as a file cut elsewhere is."""
    if table < meta_end:
        raise SourceError(f"{f.path}: its header puts the allocation table at byte {table:,}, inside its header and "
                          f"metadata (which end at byte {meta_end:,}): not an FFCV .beton, or damaged; write it again")
    if (f.size - table) % _ALLOC.itemsize:
        raise SourceError(f"{f.path} is truncated ({f.size:,} bytes; its header puts the allocation table at byte "
                          f"{table:,}, which runs to the end of the file in {_ALLOC.itemsize}-byte rows): copy it "
                          f"again or write it again")
    rows = (f.size - table) // _ALLOC.itemsize
    payloads = sum(fd.type_id in _ALLOCATING for fd in fields)
    if rows < n * payloads:
        raise SourceError(f"{f.path} is truncated: its allocation table (from byte {table:,} to its end) holds "
                          f"{rows:,} rows where its {n:,} samples' {payloads} payload field(s) need {n * payloads:,} "
                          f"(the file was cut short by whole {_ALLOC.itemsize}-byte rows, or its header is "
                          f"damaged); copy it again or write it again")


def _image_use(fd: _Field) -> str | None:
    if fd.type_id in (2, 3):
        return None
    if fd.type_id in (4, 6):
        dtype, shape = fd.ndarray()
        if dtype == np.uint8 and (len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3, 4))):
            return None
        return "not a uint8 array of shape (H, W[, 1|3|4])"
    return "not an image field (an RGBImageField, a BytesField of image files or a uint8 NDArrayField)"


def _label_use(fd: _Field) -> str | None:
    return None if fd.kind == "IntField" else "not an IntField (class indices)"


def _image_locations(f: PeerFile, field: _Field, meta: np.ndarray, table: int,
                     n: int) -> tuple[dict[str, np.ndarray], str, dict[int, str]]:
    """(offset, size [, mode, width, height]) of every sample's image, the codec, samples without one."""
    problems: dict[int, str] = {}
    if field.type_id == 3:
        return {"offset": meta["ptr"].astype(np.int64), "size": meta["size"].astype(np.int64)}, "encoded", problems
    if field.type_id in (4, 6):
        dtype, shape = field.ndarray()
        size = np.full(n, math.prod(shape) * dtype.itemsize, np.int64)  # bounded by ndarray()
        return {"offset": meta.astype(np.int64), "size": size}, "raw:" + ",".join(map(str, shape)), problems
    alloc = np.frombuffer(f.read(table, f.size - table), _ALLOC)
    order = np.argsort(alloc["ptr"], kind="stable")
    ptrs, sizes = alloc["ptr"][order], alloc["size"][order].astype(np.int64)
    want = meta["data_ptr"]
    at = np.minimum(np.searchsorted(ptrs, want), max(len(ptrs) - 1, 0))
    found = (ptrs[at] == want) if len(ptrs) else np.zeros(n, bool)
    for i in np.flatnonzero(~found).tolist():
        problems[i] = f"its image pointer {int(want[i])} is not in the file's allocation table: damaged"
    columns = {"offset": want.astype(np.int64), "size": np.where(found, sizes[at], 0),
               "mode": meta["mode"].astype(np.uint8), "width": meta["width"].astype(np.int32),
               "height": meta["height"].astype(np.int32)}
    return columns, "ffcv-rgb", problems


def ffcv_plan(src: str | Path, options: PeerOptions, classes: list[str] | None = None) -> Plan:
    """Plan the samples of the .beton at ``src``."""
    path = Path(src)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.beton"))
        raise SourceError(f"{path} is a folder: name the .beton file"
                          + (f" ({', '.join(found[:5])})" if found else " (it holds none)"))
    f = PeerFile.stat(path, path.name, "FFCV file")
    header, fields = _read_layout(f)
    n, table = int(header["num_samples"]), int(header["alloc_table_ptr"])
    record = np.dtype([(f"f{i}", _TYPES[fd.type_id][1]) for i, fd in enumerate(fields)], align=True)
    start = _HEADER.itemsize + len(fields) * _FIELD.itemsize
    if start + n * record.itemsize > f.size:
        raise SourceError(f"{f.path}: its {n:,} metadata records run past its end at byte {f.size:,}: truncated or "
                          f"damaged; copy it again or write it again")
    _check_allocations(f, fields, n, start + n * record.itemsize, table)
    meta = np.frombuffer(f.read(start, n * record.itemsize), record)
    by_name = {fd.name: fd for fd in fields}
    names = {fd.name: fd.described() for fd in fields}
    image = pick_field("image", options.image_field, names, lambda n: _image_use(by_name[n]), f.path, "--image-field")
    label = pick_field("label", options.label_field, names, lambda n: _label_use(by_name[n]), f.path, "--label-field")
    i_img, i_lab = ([fd.name for fd in fields].index(x) for x in (image, label))
    columns, codec, problems = _image_locations(f, fields[i_img], meta[f"f{i_img}"], table, n)
    ends = columns["offset"] + columns["size"]
    for i in np.flatnonzero(ends > table).tolist():
        problems.setdefault(i, f"its image runs past byte {table:,} where the file's data ends: damaged")
    samples = Samples([f], [f"{path.name}#{i}" for i in range(n)], meta[f"f{i_lab}"].astype(np.int64),
                      {"file": np.zeros(n, np.int32), **columns}, problems)
    first_payload_check(samples, codec, f.path, "--image-field")
    # the root is the file itself (provenance FILE.beton#INDEX): an output beside the file is not inside the source
    return peer_plan(samples, codec=codec, dataset=options.dataset or dataset_name(str(path.resolve())),
                     split=split_of(path.name, options.split), root=path, classes=classes,
                     index_files=[], digest_extra={"image": image, "label": label}, source_format="ffcv")


class FfcvSource(SourceKind):
    name = "ffcv"
    options = PeerOptions
    help = ("An FFCV .beton file at SRC (format version 2, ffcv 1.0), read without ffcv. Images: an RGBImageField "
            "(JPEG or raw samples), a BytesField of image files or a uint8 NDArrayField; labels: an IntField. "
            "Decoded and resized as any build; provenance FILE.beton#INDEX.")
    url_src = False
    pins_classes = True
    classes_flag = True

    def plan(self, src: str, options: PeerOptions, *, classes: list[str] | None = None, jobs: int = 1) -> list[Plan]:
        return [ffcv_plan(src, options, classes)]
