"""Variable-length samples in shard files: the layout of a ``jpeg`` shard and the reader of its payloads.

A shard ``images-NNNNN.jpegs`` is three ``.npy`` records back to back (``np.load`` on an open file reads
them in turn)::

    offsets  int64  (n + 1,)   sample j is payload[offsets[j]:offsets[j + 1]]; offsets[0] = 0
    crc32    uint32 (n,)       zlib.crc32 of each sample's bytes, checked before every decode
    payload  uint8  (bytes,)   the samples' JPEG files, back to back

The index (offsets and crc32: 12 bytes a sample, 15 MB for ImageNet) is read once when a cache is opened;
a batch then reads only its samples' bytes. The reader is the variable-length twin of
:class:`~cachebuild.storage.kinds.rows.RowFiles`: locally every shard is memory-mapped once per process and a
sample is a zero-copy view; remotely the samples a batch needs become byte ranges (consecutive samples
coalesced), fetched concurrently through the location, optionally through a local
:class:`~cachebuild.storage.remote.block_cache.BlockCache`.
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from cachebuild.errors import CacheCorruptError
from cachebuild.format.manifest import Digest
from cachebuild.storage.kinds.rows import NPY_HEADER_ERRORS, ShardHandles
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache

__all__ = ["INDEX_HEAD_BYTES", "PayloadFiles", "ShardIndex", "index_bytes", "parse_index", "write_shard"]

_OFFSETS = np.dtype("<i8")
_CRC = np.dtype("<u4")
_PAYLOAD = np.dtype("|u1")
INDEX_HEAD_BYTES = 3 * 128  # the three .npy headers cachebuild writes are 128 bytes each
_SLACK = 4096  # headers written by other tools may be longer (numpy pads to 64 bytes)


def _header(dtype: np.dtype, n: int) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (n,)})
    return buf.getvalue()


def write_shard(f: IO[bytes], payloads: Sequence[bytes], crcs: Sequence[int], algorithm: Digest) -> tuple[str, int]:
    """Write one shard (see the module doc) to ``f``; returns (``algorithm``'s digest of every byte written, size)."""
    offsets = np.zeros(len(payloads) + 1, dtype=_OFFSETS)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    h = algorithm.new()
    size = 0
    parts: list[bytes | memoryview] = [
        _header(_OFFSETS, len(offsets)), offsets.tobytes(),
        _header(_CRC, len(crcs)), np.asarray(crcs, dtype=_CRC).tobytes(),
        _header(_PAYLOAD, int(offsets[-1])), *payloads,
    ]
    for part in parts:
        f.write(part)
        h.update(part)
        size += len(part)
    return h.hexdigest(), size


def index_bytes(count: int) -> int:
    """Bytes to read from the start of a shard of ``count`` samples to hold its whole index."""
    return INDEX_HEAD_BYTES + _OFFSETS.itemsize * (count + 1) + _CRC.itemsize * count + _SLACK


@dataclass(frozen=True)
class ShardIndex:
    """One shard: samples ``[start, start + count)`` of file ``name``; sample ``start + j`` is the bytes
    ``[payload_start + offsets[j], payload_start + offsets[j + 1])`` of the file."""

    name: str
    start: int
    count: int
    payload_start: int
    offsets: np.ndarray  # int64 (count + 1,)
    crc: np.ndarray  # uint32 (count,)

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self.payload_start + int(self.offsets[-1])


def _read_header(f: io.BytesIO, dtype: np.dtype, where: str, what: str) -> int:
    """The length of the 1-D ``dtype`` .npy record starting at ``f``'s position (left after its header)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, got = read(f)
    except NPY_HEADER_ERRORS as e:
        raise CacheCorruptError(f"{where}: the {what} record is not a readable .npy header: {e}") from None
    if got != dtype or fortran or len(shape) != 1:
        raise CacheCorruptError(f"{where}: the {what} record holds {got}{list(shape)}, expected a 1-D {dtype} array")
    return int(shape[0])


def _read_npy(f: io.BytesIO, dtype: np.dtype, where: str, what: str) -> np.ndarray:
    n = _read_header(f, dtype, where, what)
    data = f.read(n * dtype.itemsize)
    if len(data) != n * dtype.itemsize:
        raise CacheCorruptError(f"{where} is truncated inside its {what} record")
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="))


def parse_index(head: bytes, name: str, start: int, count: int, where: str) -> ShardIndex:
    """The index of a shard from its first :func:`index_bytes` bytes, checked against the manifest's count."""
    f = io.BytesIO(head)
    offsets = _read_npy(f, _OFFSETS, where, "offsets")
    crc = _read_npy(f, _CRC, where, "crc32")
    payload = _read_header(f, _PAYLOAD, where, "payload")
    if len(offsets) != count + 1 or len(crc) != count:
        raise CacheCorruptError(f"{where} indexes {len(crc)} samples, the manifest says {count}")
    if offsets[0] != 0 or np.any(np.diff(offsets) <= 0) or offsets[-1] != payload:
        raise CacheCorruptError(f"{where}: its offsets do not tile its payload of {payload} bytes "
                                f"(each sample must be a non-empty, in-order byte range)")
    return ShardIndex(name, start, count, f.tell(), offsets, crc)


class PayloadFiles(ShardHandles):
    """Read samples' stored bytes from shards under ``location`` (picklable; files opened lazily per process)."""

    def __init__(self, location: Location, shards: Sequence[ShardIndex], *, block_cache: BlockCache | None = None,
                 cache_id: str = "") -> None:
        super().__init__(location, len(shards), block_cache, cache_id)
        self.shards = tuple(shards)
        self.starts = np.array([s.start for s in self.shards] + [self.shards[-1].start + self.shards[-1].count
                                                                 if self.shards else 0], dtype=np.int64)
        # Per sample, in file coordinates: one searchsorted away from any batch's byte ranges.
        self.begin = np.concatenate([s.payload_start + s.offsets[:-1] for s in self.shards] or [np.empty(0, np.int64)])
        self.end = np.concatenate([s.payload_start + s.offsets[1:] for s in self.shards] or [np.empty(0, np.int64)])
        self.crc = np.concatenate([s.crc for s in self.shards] or [np.empty(0, np.uint32)])

    def shard_of(self, i: int) -> ShardIndex:
        return self.shards[int(np.searchsorted(self.starts, i, side="right")) - 1]

    def _name_and_size(self, k: int) -> tuple[str, int]:
        return self.shards[k].name, self.shards[k].size

    def _open_local(self, k: int) -> np.ndarray:
        """Shard ``k`` as a uint8 array over its memory map."""
        s = self.shards[k]
        path = self.location.describe(s.name)
        try:
            with self.location.open_file(s.name) as f:  # rename-safe (pinned)
                size = os.fstat(f.fileno()).st_size
                if size < s.size:
                    raise CacheCorruptError(f"{path} is truncated: {size} bytes, its index needs {s.size}")
                mm = mmap.mmap(f.fileno(), s.size, prot=mmap.PROT_READ) if s.size else b""
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}, listed in the manifest, is missing") from None
        return np.frombuffer(mm, dtype=np.uint8)

    def read(self, idx: np.ndarray) -> list[Any]:
        """The stored bytes of samples ``idx`` (any order, in range), as buffers in that order. Local
        samples are zero-copy views of the memory maps; remote ones are fetched in one concurrent pass
        over every shard (:meth:`read_files`), consecutive samples as one range."""
        out: list[Any] = [None] * len(idx)
        if not len(idx):
            return out
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        seg_of = np.searchsorted(self.starts, sorted_idx, side="right") - 1
        begin, end = self.begin[sorted_idx].tolist(), self.end[sorted_idx].tolist()
        bounds = np.flatnonzero(np.diff(seg_of)) + 1
        wanted: list[tuple[int, list[tuple[int, int]]]] = []
        places: list[list[tuple[int, int]]] = []
        for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(sorted_idx)].tolist(), strict=True):
            k = int(seg_of[lo])
            if self.location.is_local:
                f = self._handle(k)
                for j in range(lo, hi):
                    out[order[j]] = f[begin[j] : end[j]]
                continue
            # Runs of samples stored back to back become one range: the bytes fetched are the bytes needed.
            runs, a = [], lo
            for j in range(lo + 1, hi + 1):
                if j == hi or begin[j] != end[j - 1]:
                    runs.append((a, j))
                    a = j
            wanted.append((k, [(begin[a], end[z - 1]) for a, z in runs]))
            if self.whole_files:
                self.read_whole(k)
            places.append(runs)
        for runs, datas in zip(places, self.read_files(wanted), strict=True):
            for (a, z), data in zip(runs, datas, strict=True):
                view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data
                base = begin[a]
                for j in range(a, z):
                    out[order[j]] = view[begin[j] - base : end[j] - base]
        return out
