"""The shard layout MosaicML Streaming's MDS and LitData share, read while planning.

A shard (MDS ``shard.00000.mds``, LitData ``chunk-0-0.bin``) starts with uint32 ``n`` and ``n + 1`` uint32
offsets of its records from the file's start (MDS puts its JSON config between the offsets and the first
record); record ``i`` is bytes ``[offsets[i], offsets[i + 1])``. A record is the uint32 sizes of its
variable-size fields (MDS: the columns without a fixed size; LitData: every leaf), then each field's bytes in
field order. Planning reads each record's size header and its label field: two small reads, never the image.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.peers.common import PeerFile, Samples
from cachebuild.sources.peers.labels import decode_labels

__all__ = ["ShardRecords", "index_records", "shard_samples"]


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
    with open(f.path, "rb") as fh:
        if variable:
            raw = bytearray()
            for begin in offsets[:-1].tolist():
                fh.seek(begin)
                raw += fh.read(head).ljust(head, b"\0")
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
            fh.seek(at)
            labels.append(fh.read(size))
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
