"""What MosaicML Streaming's MDS and LitData share: a dataset folder with an ``index.json`` (written last: a folder
without one was never finished) beside shards of records, read while planning.

A shard (MDS ``shard.00000.mds``, LitData ``chunk-0-0.bin``) starts with uint32 ``n`` and ``n + 1`` uint32
offsets of its records from the file's start (MDS puts its JSON config between the offsets and the first
record); record ``i`` is bytes ``[offsets[i], offsets[i + 1])``. A record is the uint32 sizes of its
variable-size fields (MDS: the columns without a fixed size; LitData: every leaf), then each field's bytes in
field order. Planning reads each record's size header and its label field: two small reads, never the image.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.peers.common import (
    PeerFile,
    PeerOptions,
    Samples,
    first_payload_check,
    peer_plan,
    pick_field,
    reason_of,
    split_of,
)
from cachebuild.sources.plan import Plan
from cachebuild.sources.shards.plan import dataset_name

__all__ = ["INDEX", "count_of", "dataset_dir", "entries", "index_fields", "index_plan", "plain_name", "read_index",
           "shard_samples"]

INDEX = "index.json"


MAX_INDEX_BYTES = 1 << 30  # an index.json listing a million shards is ~500 MB
MAX_NAME_BYTES = 255  # a file name, as filesystems allow


def dataset_dir(src: str | Path, split: str | None, what: str) -> Path:
    """The folder holding the dataset's ``index.json``: ``SRC/SPLIT`` where ``--split`` names one, else SRC.
    (Anything named index.json counts: reading it says what else it is.)"""
    root = Path(src)
    if split is not None and os.path.lexists(root / split / INDEX):
        return root / split
    if os.path.lexists(root / INDEX):
        return root
    if not root.is_dir():
        raise SourceError(f"{root}: no such folder; name the {what} folder (the one holding {INDEX})")
    splits = sorted(p.name for p in root.iterdir() if (p / INDEX).is_file())
    if splits:
        raise SourceError(f"{root} holds one {what} per split ({', '.join(splits)})"
                          + (f" but none named {split!r}" if split is not None else "") + ": pass --split")
    raise SourceError(f"{root} holds no {INDEX}: not a {what} folder (the writer writes {INDEX} last, so a write "
                      f"that was interrupted leaves none; write it again)")


def read_index(folder: Path, what: str) -> tuple[PeerFile, dict[str, Any]]:
    f = PeerFile.stat(folder / INDEX, INDEX, f"{what} index")
    if f.size > MAX_INDEX_BYTES:
        raise SourceError(f"{f.path}: {f.size:,} bytes, over the {MAX_INDEX_BYTES:,} an index may hold: not a {what} "
                          f"index, or damaged; write it again")
    try:
        obj = json.loads(f.read(0, f.size))
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"{f.path}: not JSON ({e}): not a {what} index, or damaged; write it again") from None
    except RecursionError:
        raise SourceError(f"{f.path}: JSON nested deeper than any {what} index: damaged; write it again") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{f.path}: a JSON {type(obj).__name__}, not the object a {what} index is")
    return f, obj


def entries(index: dict[str, Any], key: str, where: str, what: str) -> list[dict[str, Any]]:
    """The index's list ``key`` (its shards, its chunks): a list of objects, else a SourceError."""
    got = index.get(key)
    if not isinstance(got, list) or not all(isinstance(e, dict) for e in got):
        raise SourceError(f"{where}: its {key!r} is not a list of {what} entries (objects): damaged index; write "
                          f"it again")
    return got


def plain_name(value: Any, where: str, what: str) -> str:
    """A file name from an index: a string naming a file beside it (no folder, no NUL, not hidden), else a
    SourceError: a converter opens nothing outside the dataset's folder."""
    if (not isinstance(value, str) or not value or "/" in value or "\0" in value or value.startswith(".")
            or len(value.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES):
        raise SourceError(f"{where}: a {what} without a plain file name ({value!r}): damaged index; write it again")
    return value


def count_of(value: Any, where: str, what: str) -> int:
    """A non-negative integer of an index (a count, a size); ``True`` is not one."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SourceError(f"{where}: {what} is {value!r}, not a count: damaged index; write it again")
    return value


def index_fields(found: dict[str, str], options: PeerOptions, image_codec: Callable[[str], Any],
                 label_kind: Callable[[str], Any], where: str) -> tuple[str, str]:
    """The image and label fields of an indexed dataset: ``found`` maps each field to its type in the peer's
    words; ``image_codec`` / ``label_kind`` raise ValueError for a type that cannot serve."""
    image = pick_field("image", options.image_field, found, lambda n: reason_of(image_codec, found[n]), where,
                       "--image-field")
    label = pick_field("label", options.label_field, found, lambda n: reason_of(label_kind, found[n]), where,
                       "--label-field")
    return image, label


def index_plan(samples: Samples, *, codec: str, folder: Path, options: PeerOptions, classes: list[str] | None,
               index_file: PeerFile, fields: tuple[str, str], source_format: str) -> Plan:
    """The plan of an indexed dataset's samples, once its first payload decodes as ``codec``."""
    first_payload_check(samples, codec, index_file.path, "--image-field")
    image, label = fields
    return peer_plan(samples, codec=codec, dataset=options.dataset or dataset_name(str(folder.resolve())),
                     split=split_of(folder.name, options.split), root=folder, classes=classes,
                     index_files=[index_file], digest_extra={"image": image, "label": label},
                     source_format=source_format)


def decode_labels(raw: list[bytes], kind: str, where: str) -> tuple[np.ndarray, dict[int, str]]:
    """int64 labels (-1 where there is none) from each record's label bytes: ``kind`` a little-endian numpy
    integer type (``<i8``) or ``str`` (decimal text); a record with no bytes was found damaged already."""
    out = np.full(len(raw), -1, np.int64)
    problems: dict[int, str] = {}
    if kind == "str":
        for i, b in enumerate(raw):
            try:
                out[i] = int(b.decode("ascii")) if b else -1
            except (ValueError, UnicodeDecodeError):
                problems[i] = f"label {b[:20]!r} of {where} is not a decimal integer"
            except OverflowError:
                problems[i] = f"label {b[:20]!r} of {where} is beyond any class index"
        return out, problems
    width = np.dtype(kind).itemsize
    ok = np.fromiter((len(b) == width for b in raw), bool, len(raw))
    if ok.any():
        values = np.frombuffer(b"".join(b for b, good in zip(raw, ok, strict=True) if good), kind)
        if values.dtype == np.uint64:  # above int64: no class index (and not -1, "no label")
            values = np.where(values > np.iinfo(np.int64).max, np.iinfo(np.int64).max, values)
        out[ok] = values.astype(np.int64)
    for i in np.flatnonzero(~ok).tolist():
        if raw[i]:
            problems[i] = f"label of {len(raw[i])} bytes in {where}, where its encoding has {width}: damaged"
    return out, problems


@dataclass
class ShardRecords:
    """One shard's records: where the image field lies, the label field's bytes, and damaged records."""

    image_offset: np.ndarray  # int64, absolute in the file
    image_size: np.ndarray  # int64
    label_bytes: list[bytes]
    problems: dict[int, str]  # record position -> reason


def _offsets(f: PeerFile, n_expected: int, what: str) -> np.ndarray:
    head = f.read(0, 4)
    n = int(np.frombuffer(head, "<u4")[0])
    if n == n_expected and 4 * (n + 2) > f.size:
        raise SourceError(f"{f.path}: its header counts {n:,} samples, whose offsets alone need more than its "
                          f"{f.size:,} bytes: truncated or damaged; copy or write it again")
    if n != n_expected:
        raise SourceError(f"{f.path}: its header counts {n:,} samples where the index says {n_expected:,}: the "
                          f"{what} and its index disagree (a shard of another write, or damaged); write it again")
    offsets = np.frombuffer(f.read(4, 4 * (n + 1)), "<u4").astype(np.int64)
    if offsets[-1] != f.size or np.any(np.diff(offsets) < 0) or offsets[0] < 4 * (n + 2):
        end = int(offsets[-1])
        why = (f"its records end at byte {end:,} but the file has {f.size:,}" if end != f.size
               else "its record offsets are out of order")
        raise SourceError(f"{f.path}: {why}: {'truncated' if end > f.size else 'damaged'}; copy or write it again")
    return offsets


def index_records(f: PeerFile, n: int, sizes: list[int | None], image: int, label: int, what: str) -> ShardRecords:
    """Index the ``n`` records of shard ``f``. ``sizes``: per field, its fixed size or None (in the header);
    ``image``, ``label``: their field positions."""
    offsets = _offsets(f, n, what)
    variable = [i for i, s in enumerate(sizes) if s is None]
    head = 4 * len(variable)
    table = np.zeros((n, len(sizes)), np.int64)
    for i, s in enumerate(sizes):
        if s is not None:
            table[:, i] = s
    problems: dict[int, str] = {}
    with f.opened() as fd:
        if variable:
            raw = bytearray()
            for begin in offsets[:-1].tolist():
                raw += os.pread(fd, head, begin).ljust(head, b"\0")
            table[:, variable] = np.frombuffer(bytes(raw), "<u4").reshape(n, len(variable))
        starts = offsets[:-1, None] + head + np.concatenate([np.zeros((n, 1), np.int64),
                                                             np.cumsum(table, axis=1)[:, :-1]], axis=1)
        ends = offsets[:-1] + head + table.sum(axis=1)
        for i in np.flatnonzero(ends != offsets[1:]).tolist():
            problems[i] = (f"record {i} of {f.name}: its field sizes add up to {int(ends[i] - offsets[i]):,} bytes, "
                           f"its slot in the shard is {int(offsets[i + 1] - offsets[i]):,}: damaged")
        labels = []
        for i, (at, size) in enumerate(zip(starts[:, label].tolist(), table[:, label].tolist(), strict=True)):
            if i in problems:
                labels.append(b"")
                continue
            labels.append(os.pread(fd, size, at))  # inside the record's slot: checked above
    return ShardRecords(starts[:, image].copy(), table[:, image].copy(), labels, problems)


def shard_samples(shards: list[tuple[PeerFile, int]], sizes: list[int | None], image: int, label: int,
                  label_kind: str, what: str) -> Samples:
    """Every record of ``shards`` ((file, record count), in order) as planned samples: ``FILE#INDEX`` keys,
    labels decoded as ``label_kind`` (see :func:`~cachebuild.sources.peers.labels.decode_labels`)."""
    keys: list[str] = []
    parts: dict[str, list[np.ndarray]] = {"file": [], "offset": [], "size": [], "label": []}
    problems: dict[int, str] = {}
    for i, (f, n) in enumerate(shards):
        rec = index_records(f, n, sizes, image, label, what)
        labels, bad = decode_labels(rec.label_bytes, label_kind, f.name)
        problems.update({len(keys) + j: r for j, r in {**bad, **rec.problems}.items()})
        keys += [f"{f.name}#{j}" for j in range(n)]
        for k, v in (("file", np.full(n, i, np.int32)), ("offset", rec.image_offset), ("size", rec.image_size),
                     ("label", labels)):
            parts[k].append(v)
    columns = {k: np.concatenate(v) for k, v in parts.items() if k != "label"}
    return Samples([f for f, _ in shards], keys, np.concatenate(parts["label"]), columns, problems)
