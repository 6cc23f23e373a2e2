"""Samples stored as fixed-size C-order rows in a sequence of files (npy shards, uncompressed zarr chunks).

The read path every row-file backend shares. Locally each file is memory-mapped once per process and a
batch is one sorted pass copying each row once into the caller's buffer. Remotely the rows a batch needs
become byte ranges (adjacent rows coalesced into one range), fetched concurrently through the location,
optionally through a local :class:`~cachebuild.storage.remote.block_cache.BlockCache`.

Why a per-row copy loop and not one vectorised gather: the rows of a batch live in different files
(different maps), and numpy has no scatter-from-many-arrays primitive. A fancy read per file followed by
a scatter moves every byte twice and measured ~0.6x the speed of a loop that copies each row once (the
loop's Python cost is ~1 us per 150 kB row). When all rows come from one file a single ``np.take`` is used.
"""

from __future__ import annotations

import functools
import os
import threading
import tokenize
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from cachebuild.errors import CacheCorruptError
from cachebuild.settings import settings
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache, BlockCacheFullError, CachedFile
from cachebuild.storage.remote.readahead import STEP_BYTES, WHOLE_FILE_THREADS, Readahead

__all__ = ["NPY_HEADER_ERRORS", "RowFiles", "Segment", "ShardHandles", "in_parallel", "npy_header"]

T = TypeVar("T")

# Guards making a process's handle table and its lock (threads of a forked child or of an unpickled reader
# arrive together); made anew in a forked child, where another thread may have held it at the fork.
_TABLE_GUARD = threading.Lock()


def _new_table_guard() -> None:
    global _TABLE_GUARD
    _TABLE_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_new_table_guard)


@dataclass(frozen=True)
class Segment:
    """Samples ``[start, start + rows)`` in file ``name``, row 0 at byte ``offset``."""

    name: str
    start: int
    rows: int
    offset: int


# What numpy's .npy header parser raises on damaged bytes: it tokenizes and literal_evals the header, so a
# flipped byte can surface as a syntax or tokenizer error, not only ValueError (1 in 9 single-bit flips).
NPY_HEADER_ERRORS = (ValueError, EOFError, SyntaxError, tokenize.TokenError)


def npy_header(head: bytes, where: str) -> tuple[int, tuple[int, ...], np.dtype]:
    """(data offset, shape, dtype) of a ``.npy`` from its first bytes; a named error for anything else."""
    import io

    fmt = np.lib.format
    f = io.BytesIO(head)
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except NPY_HEADER_ERRORS as e:
        raise CacheCorruptError(f"{where} is not a readable .npy file: {e}") from None
    if fortran:
        raise CacheCorruptError(f"{where} is stored in Fortran order; cache shards are C-ordered")
    return f.tell(), tuple(shape), dtype


class ShardHandles:
    """A cache's shard files under ``location``, each opened once per process, lazily: fork or unpickle and
    the next use opens them again (another process's maps are not ours). A handle is what
    :meth:`_open_local` makes of a local file, a :class:`CachedFile` mirror for a URL with a block cache,
    or False for a URL without one (plain range reads through :meth:`_fetch`). Shared by every reader of
    shard files (raw rows, stored JPEGs). Threads of one process open each file once: two handles of one
    file would leak the loser's descriptors (a :class:`CachedFile` holds two until closed)."""

    def __init__(self, location: Location, count: int, block_cache: BlockCache | None, cache_id: str) -> None:
        self.location = location
        self.block_cache = None if location.is_local else block_cache
        self.cache_id = cache_id
        self._count = count
        self._handles: list[Any] | None = None
        self._pid = -1  # no handle table in any process yet
        self._lock: Any = None
        self.bytes_fetched = 0
        self.readahead = Readahead()  # sequential reads through a block cache: whole files ahead
        # Set by a shard-windowed sampler (CacheSampler(shard_window=W)): every file a batch touches is read
        # whole within the window, so it is fetched whole at once (big requests) rather than row by row.
        self.whole_files = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": None, "_pid": -1, "_lock": None, "bytes_fetched": 0}

    def _open_local(self, k: int) -> Any:
        """File ``k`` of a local cache, opened (subclasses say how)."""
        raise NotImplementedError

    def _name_and_size(self, k: int) -> tuple[str, int]:
        """File ``k``'s name and the bytes a reader may use of it (what a block cache mirrors)."""
        raise NotImplementedError

    def _table(self) -> list[Any]:
        """This process's handle table (made on first use here, with the lock that guards opening)."""
        if self._pid != os.getpid():
            with _TABLE_GUARD:
                if self._pid != os.getpid():
                    self._lock = threading.Lock()
                    self._handles = [None] * self._count
                    self._pid = os.getpid()  # last: another thread that sees our pid finds both made
        return self._handles  # type: ignore[return-value]

    def _handle(self, k: int) -> Any:
        handles = self._table()
        got = handles[k]
        if got is None:
            with self._lock:
                got = handles[k]
                if got is None:
                    got = handles[k] = self._open(k)
        return got

    def _open(self, k: int) -> Any:
        if self.location.is_local:
            return self._open_local(k)
        if self.block_cache is not None and not self.block_cache.full:
            name, size = self._name_and_size(k)
            try:
                return self.block_cache.file(BlockCache.key(self.cache_id, name), size)
            except BlockCacheFullError as e:  # no room for its table: this file is read uncached
                self.block_cache.note_full(e)
        return False

    def _fetch(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self._fetch_many([(name, ranges)])[0]

    def _fetch_many(self, wanted: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> list[list[bytes]]:
        got = self.location.read_many(wanted)
        with _TABLE_GUARD:  # the files of a batch are fetched by several threads at once
            self.bytes_fetched += sum(len(g) for file in got for g in file)
        return got

    def read_ahead(self, k: int, start: int) -> None:
        """A sequential read reached byte ``start`` of file ``k``: fetch the rest of it and the next
        ``CACHEBUILD_READAHEAD_FILES`` files whole into the block cache, in the background, once each."""
        more = settings().readahead_files
        if self.block_cache is None or self.block_cache.full or more == 0:
            return
        for j in range(k, min(self._count, k + more + 1)):
            handle = self._handle(j)
            if isinstance(handle, CachedFile):
                name, size = self._name_and_size(j)
                job = functools.partial(handle.prefetch, start if j == k else 0, size,
                                        functools.partial(self._fetch, name), STEP_BYTES)
                self.readahead.schedule(j, job, self.location.describe(name))

    def read_files_whole(self) -> None:
        """From now on every file a batch touches is fetched whole (:attr:`whole_files`), several at once."""
        self.whole_files = True
        self.readahead.threads = WHOLE_FILE_THREADS

    def read_whole(self, k: int) -> None:
        """File ``k`` will be read whole soon (:attr:`whole_files`): fetch all of it into the block cache, in the
        background, once per process; nothing without a block cache or with ``CACHEBUILD_READAHEAD_FILES=0``."""
        if self.block_cache is None or self.block_cache.full or settings().readahead_files == 0:
            return
        handle = self._handle(k)
        if isinstance(handle, CachedFile):
            name, size = self._name_and_size(k)
            job = functools.partial(handle.prefetch, 0, size, functools.partial(self._fetch, name), STEP_BYTES)
            self.readahead.schedule(k, job, self.location.describe(name))

    def read_files(self, wanted: Sequence[tuple[int, Sequence[tuple[int, int]]]]) -> list[list[Any]]:
        """The byte ranges of remote files ``(k, ranges)``, one list per file: views of block-cache mirrors
        (blocks checked; those files read together), and every other range fetched in one group of requests,
        so that a batch waits once for its slowest request, not once per file or per thread."""
        handles = [self._handle(k) for k, _ in wanted]
        cached = [i for i, h in enumerate(handles) if isinstance(h, CachedFile)]
        plain = [i for i, h in enumerate(handles) if not isinstance(h, CachedFile)]
        name = [self._name_and_size(k)[0] for k, _ in wanted]
        jobs: list[Callable[[], Any]] = [
            functools.partial(handles[i].read, wanted[i][1], functools.partial(self._fetch, name[i])) for i in cached]
        if plain:
            jobs.append(functools.partial(self._fetch_many, [(name[i], wanted[i][1]) for i in plain]))
        results = in_parallel(jobs)
        out: list[list[Any]] = [[] for _ in wanted]
        for i, got in zip(cached, results[: len(cached)], strict=True):
            out[i] = got
        for i, got in zip(plain, results[-1] if plain else [], strict=True):
            out[i] = got
        return out


class RowFiles(ShardHandles):
    """Gather rows of ``row_shape`` uint8 from ``segments`` under ``location`` (picklable; lazy per process)."""

    def __init__(self, location: Location, segments: Sequence[Segment], row_shape: tuple[int, ...], *,
                 block_cache: BlockCache | None = None, cache_id: str = "") -> None:
        super().__init__(location, len(segments), block_cache, cache_id)
        self.segments = tuple(segments)
        self.row_shape = tuple(row_shape)
        self.row_bytes = int(np.prod(row_shape))
        self.starts = np.array([s.start for s in self.segments] + [self.segments[-1].start + self.segments[-1].rows
                                                                   if self.segments else 0], dtype=np.int64)

    def _name_and_size(self, k: int) -> tuple[str, int]:
        seg = self.segments[k]
        return seg.name, seg.offset + seg.rows * self.row_bytes

    def _open_local(self, k: int) -> np.ndarray:
        """Segment ``k`` as a (rows, *row_shape) array over its memory map."""
        seg = self.segments[k]
        path = self.location.describe(seg.name)
        try:
            with self.location.open_file(seg.name) as f:  # rename-safe (pinned)
                mm = np.memmap(f, dtype=np.uint8, mode="r", offset=seg.offset, shape=(seg.rows, *self.row_shape))
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}, listed in the manifest, is missing") from None
        except ValueError as e:  # mmap length larger than the file
            raise CacheCorruptError(f"{path} is truncated: {e}") from None
        return mm.view(np.ndarray)  # plain ndarray view: np.memmap slicing is slower

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Copy samples ``idx`` (any order, in range) into ``out`` (len(idx), *row_shape), one sorted pass."""
        if not len(idx):
            return
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        seg_of = np.searchsorted(self.starts, sorted_idx, side="right") - 1
        if not self.location.is_local:
            self._gather_remote(sorted_idx, order, seg_of, out)
            return
        if seg_of[0] == seg_of[-1]:  # one file: a single C-level gather in the requested order
            k = int(seg_of[0])
            np.take(self._handle(k), idx - self.starts[k], axis=0, out=out, mode="clip")
            return
        local = (sorted_idx - self.starts[seg_of]).tolist()
        current, arr = -1, None
        for pos, k, i in zip(order.tolist(), seg_of.tolist(), local, strict=True):
            if k != current:
                current, arr = k, self._handle(k)
            out[pos] = arr[i]  # type: ignore[index]

    def local_rows(self, idx: np.ndarray) -> list[np.ndarray] | None:
        """Read-only views of rows ``idx`` over their memory maps (no copy), or None when not local (a crop in the
        loader's workers then resizes straight from the stored bytes)."""
        if not self.location.is_local:
            return None
        seg_of = np.searchsorted(self.starts, idx, side="right") - 1
        return [self._handle(k)[i - self.starts[k]] for k, i in zip(seg_of.tolist(), idx.tolist(), strict=True)]

    def _gather_remote(self, sorted_idx: np.ndarray, order: np.ndarray, seg_of: np.ndarray, out: np.ndarray) -> None:
        bounds = np.flatnonzero(np.diff(seg_of)) + 1
        flat = out.reshape(len(out), -1)
        wanted: list[tuple[int, list[tuple[int, int]]]] = []
        places = []
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(sorted_idx)], strict=True):
            k = int(seg_of[lo])
            seg = self.segments[k]
            rows = sorted_idx[lo:hi] - seg.start
            # Runs of consecutive rows become one byte range each: the bytes fetched are the bytes needed.
            cut = np.flatnonzero(np.diff(rows) != 1) + 1
            runs = list(zip(np.r_[0, cut].tolist(), np.r_[cut, len(rows)].tolist(), strict=True))
            ranges = [(seg.offset + int(rows[a]) * self.row_bytes, seg.offset + (int(rows[z - 1]) + 1) * self.row_bytes)
                      for a, z in runs]
            wanted.append((k, ranges))
            places.append((runs, order[lo:hi]))
            if self.whole_files:
                self.read_whole(k)
            elif len(runs) == 1 and hi - lo > 1:  # consecutive rows: a sequential read, whose next bytes are known
                self.read_ahead(k, ranges[0][1])
        for (runs, dest), datas in zip(places, self.read_files(wanted), strict=True):
            for (a, z), data in zip(runs, datas, strict=True):
                flat[dest[a:z]] = np.frombuffer(data, dtype=np.uint8).reshape(z - a, self.row_bytes)


# The block-cache mirrors of a remote batch's files are read at once, each by a thread of this pool whose
# requests run on the location's event loop: one file's slow request (a 503 with Retry-After, a retry) delays
# the batch once, not once per file. Made anew in each process (a forked child has none of its parent's threads).
_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_THREADS = 16


def in_parallel(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each job's result, in order, the jobs run together; the first failure (in order) is raised once all ended."""
    global _POOL
    if len(jobs) <= 1:
        return [j() for j in jobs]
    with _TABLE_GUARD:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="cachebuild-read"))
        pool = _POOL[1]
    futures = [pool.submit(j) for j in jobs]
    wait(futures)
    return [f.result() for f in futures]
