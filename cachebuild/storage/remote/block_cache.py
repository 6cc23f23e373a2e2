"""A bounded local cache of remote cache files, so that epoch 2 of a job reading a URL reads local disk, and the
readahead that fills it in the background for sequential and shard-windowed reads.

Why not a library: fsspec's ``blockcache``/``filecache`` keep one metadata file that every process rewrites
(unsafe with several DataLoader workers and jobs), have no size bound and no checksums; ``diskcache`` stores one
value per key, so a shuffled batch would read a whole block file per sample. Here each remote file is mirrored by
a sparse local file of the same size (``<key>.data``: only fetched blocks take disk space) and a table of
per-block checksums (``<key>.crc``: one uint64 per block, 0 = not fetched, else ``1 << 32 | crc32(block)``).
A block is written before its table entry, so a partly written block is never trusted; each process checks a
block's checksum the first time it uses it (a damaged one is fetched again), then reads it through a memory map.
Whole remote objects (compressed zarr chunks) are ``<key>.obj`` files with a checksum trailer, written
atomically. A disk with no room is a :class:`BlockCacheFullError` naming the folder; the reader then warns once
and reads on uncached.

Keys name immutable content (the cache's content id and the file name, and a block size other than the
default), so a rebuilt cache never meets another cache's blocks. Past ``max_bytes`` one process at a time
(``flock``) deletes the least recently opened files; one deleted while another process maps it stays valid there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from cachebuild.atomic import AtomicFile, is_temporary_name
from cachebuild.errors import CacheBuildError, OptionError

__all__ = ["DEFAULT_BLOCK_BYTES", "DEFAULT_MAX_BYTES", "STEP_BYTES", "WHOLE_FILE_THREADS", "BlockCache",
           "BlockCacheFullError", "CachedFile", "Readahead"]

DEFAULT_BLOCK_BYTES = 1 << 20  # 1 MiB: ~7 rows at 224; a shuffled cold epoch fetches each block once
DEFAULT_MAX_BYTES = 64 << 30
_PRESENT = np.uint64(1 << 32)
_EVICT_EVERY = 1 / 16  # check the bound after fetching this fraction of it
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died

log = logging.getLogger("cachebuild")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a disk (or a quota) too full for the block cache: BlockCacheFullError
Fetch = Callable[[Sequence[tuple[int, int]]], list[bytes]]


# Guards a BlockCache's per-process counters and flag (a batch's files are read by threads at once); made anew in
# a forked child (another thread may have held it at the fork).
_STATE_GUARD = threading.Lock()


def _new_state_guard() -> None:
    global _STATE_GUARD
    _STATE_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_new_state_guard)


def _lock_range(fd: int, length: int, start: int) -> None:
    """``lockf`` a range, waiting. POSIX locks belong to a process, so while two threads of one process hold
    locks on two files that threads of another process wait for (and the reverse), the kernel sees a cycle
    that is not one (each thread locks one file, in ascending order) and answers EDEADLK: ask again."""
    for pause in itertools.chain((0.001, 0.002, 0.005), itertools.repeat(0.01)):
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, length, start)
            return
        except OSError as e:
            if e.errno != errno.EDEADLK:
                raise
            time.sleep(pause)


class BlockCacheFullError(CacheBuildError, OSError):
    """The disk holding a block cache has no room for a block: the local copy, not the cache read, is at fault."""


def _crc(data: bytes | memoryview | np.ndarray) -> int:
    return zlib.crc32(data)  # any buffer, no copy


class CachedFile:
    """One remote file of known size, mirrored block by block (see the module doc)."""

    def __init__(self, cache: BlockCache, key: str, size: int) -> None:
        self.cache = cache
        self.size = size
        self.block = cache.block_bytes
        self.nblocks = max(1, -(-size // self.block))
        base = cache.folder / key[:2] / key
        self.data_path = base.with_suffix(".data")
        self.crc_path = base.with_suffix(".crc")
        opened: list[int] = []
        path = self.data_path
        try:  # a full disk may have no room for a new folder, a new file or the table's pages
            base.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o664)
            opened.append(self._fd)
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, size)  # sparse: no disk used until blocks are written
            path = self.crc_path
            self._crc_fd = os.open(self.crc_path, os.O_RDWR | os.O_CREAT, 0o664)
            opened.append(self._crc_fd)
            if os.fstat(self._crc_fd).st_size != self.nblocks * 8:
                os.ftruncate(self._crc_fd, self.nblocks * 8)
            # The table is written through a memory map: a store into a page the disk has no room for is a
            # SIGBUS that kills the process, so its pages are allocated now, where a full disk is an error.
            try:
                os.posix_fallocate(self._crc_fd, 0, self.nblocks * 8)
            except OSError as e:  # EOPNOTSUPP, EINVAL: a filesystem that cannot preallocate; tables are small
                if e.errno in _NO_SPACE:
                    raise
        except OSError as e:
            for fd in opened:
                os.close(fd)
            if e.errno in _NO_SPACE:
                raise cache.full_error(path) from None
            raise
        self._crc_map = mmap.mmap(self._crc_fd, self.nblocks * 8)
        self.table = np.frombuffer(self._crc_map, dtype=np.uint64)
        self._data_map = mmap.mmap(self._fd, size, prot=mmap.PROT_READ) if size else None
        self.data = np.empty(0, np.uint8) if self._data_map is None else np.frombuffer(self._data_map, np.uint8)
        self.checked = np.zeros(self.nblocks, dtype=bool)  # verified by this process
        # lockf locks are a process's: threads of one process (a batch's reads, readahead) wait here instead
        self._fetching = threading.Lock()
        os.utime(self.crc_path)  # "recently used", for eviction

    def read(self, ranges: Sequence[tuple[int, int]], fetch: Fetch) -> list[np.ndarray] | list[bytes]:
        """The bytes of each ``[start, end)`` range as read-only arrays over the local copy; fetched bytes
        instead when the disk is too full to hold their blocks (warned once: :meth:`BlockCache.note_full`)."""
        if self.cache.full:
            return self._uncached(ranges, fetch)
        try:
            return self._read_local(ranges, fetch)
        except BlockCacheFullError as e:
            self.cache.note_full(e)
            return self._uncached(ranges, fetch)

    def _uncached(self, ranges: Sequence[tuple[int, int]], fetch: Fetch) -> list[np.ndarray] | list[bytes]:
        """Blocks already held and intact from here, everything else fetched (and not kept)."""
        if ranges and all(self._held(start, end) for start, end in ranges):
            return [self.data[start:end] for start, end in ranges]
        return fetch(ranges)

    def _held(self, start: int, end: int) -> bool:
        if end <= start:
            return True
        blocks = range(start // self.block, (end - 1) // self.block + 1)
        return all(self.checked[b] or (self.table[b] != 0 and self._check(b)) for b in blocks)

    def _read_local(self, ranges: Sequence[tuple[int, int]], fetch: Fetch) -> list[np.ndarray]:
        need = np.zeros(self.nblocks, dtype=bool)
        for start, end in ranges:
            if start < 0 or end > self.size or start > end:
                raise ValueError(f"range [{start}, {end}) is outside a file of {self.size} bytes")
            if end > start:
                need[start // self.block : (end - 1) // self.block + 1] = True
        for _ in range(2):  # a block that fails its check is fetched once more
            self._fetch(np.flatnonzero(need & (self.table == 0)), fetch)
            bad = [b for b in np.flatnonzero(need & ~self.checked) if not self._check(int(b))]
            if not bad:
                break
            self.table[bad] = 0
        else:
            raise OSError(f"block cache {self.data_path}: blocks {bad[:5]} fail their checksum after a re-fetch")
        return [self.data[start:end] for start, end in ranges]

    def prefetch(self, start: int, end: int, fetch: Fetch, step: int) -> int:
        """Fetch the blocks of bytes ``[start, end)`` not held yet, ``step`` bytes a request (readahead: a
        reader wanting one of them waits for one step, not for the whole file). Returns the bytes fetched."""
        if self.cache.full:
            return 0
        first, last = max(0, start) // self.block, -(-min(end, self.size) // self.block)
        per, done = max(1, step // self.block), 0
        for lo in range(first, last, per):
            blocks = np.arange(lo, min(last, lo + per))
            blocks = blocks[self.table[blocks] == 0]
            try:
                done += self._fetch(blocks, fetch)
            except BlockCacheFullError as e:
                self.cache.note_full(e)
                break
        return done

    def _check(self, b: int) -> bool:
        lo, hi = b * self.block, min(self.size, (b + 1) * self.block)
        ok = int(self.table[b]) == int(_PRESENT) | _crc(self.data[lo:hi])
        self.checked[b] = ok
        return ok

    def _fetch(self, blocks: np.ndarray, fetch: Fetch) -> int:
        if not len(blocks):
            return 0
        with self._fetching:
            return self._fetch_locked(blocks, fetch)

    def _fetch_locked(self, blocks: np.ndarray, fetch: Fetch) -> int:
        runs = np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1)  # consecutive blocks: one request
        # Lock the runs' table entries (POSIX byte-range locks, always in ascending order: no deadlock), so
        # that DataLoader workers wanting the same blocks wait for one fetch instead of each fetching them.
        locked = [(int(r[0]) * 8, len(r) * 8) for r in runs]
        for start, length in locked:
            _lock_range(self._crc_fd, length, start)
        try:
            todo = blocks[self.table[blocks] == 0]  # what no other process fetched while we waited
            if not len(todo):
                return 0
            runs = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1)
            spans = [(int(r[0]) * self.block, min(self.size, (int(r[-1]) + 1) * self.block)) for r in runs]
            for (lo, hi), data in zip(spans, fetch(spans), strict=True):
                view = memoryview(data)
                self._write(view, lo)
                for b in range(lo // self.block, -(-hi // self.block)):
                    a, z = b * self.block - lo, min(hi, (b + 1) * self.block) - lo
                    self.table[b] = _PRESENT | np.uint64(_crc(view[a:z]))  # after the data: never trusted early
                    self.checked[b] = True
            self.cache.fetched(sum(hi - lo for lo, hi in spans))
            return sum(hi - lo for lo, hi in spans)
        finally:
            for start, length in locked:
                fcntl.lockf(self._crc_fd, fcntl.LOCK_UN, length, start)

    def _write(self, view: memoryview, lo: int) -> None:
        """Write all of ``view`` at ``lo``. A nearly full disk makes ``pwrite`` write less than asked without an
        error; the rest stays a hole that reads as zeros, which this process would then serve as pixels."""
        done = 0
        try:
            while done < len(view):
                n = os.pwrite(self._fd, view[done:], lo + done)
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise self.cache.full_error(self.data_path) from None
            raise

    def close(self) -> None:
        self.table = self.data = None  # type: ignore[assignment]
        for m in (self._crc_map, self._data_map):
            if m is not None:
                with contextlib.suppress(BufferError):  # a caller still holds a view: the map goes with it
                    m.close()
        os.close(self._fd)
        os.close(self._crc_fd)


class BlockCache:
    """A bounded folder of :class:`CachedFile` mirrors and whole objects, shared by processes and jobs."""

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
        if max_bytes < block_bytes or block_bytes < 4096:
            raise OptionError(f"block cache needs max_bytes >= block_bytes >= 4096, got {max_bytes}, {block_bytes}")
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self.block_bytes = int(block_bytes)
        self._since_check = 0
        self.full = False  # this process found no room: it reads uncached from then on
        self.folder.mkdir(parents=True, exist_ok=True)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_since_check": 0, "full": False}

    def note_full(self, error: BlockCacheFullError) -> None:
        """Go on without caching in this process; say so once (a full disk stops no training)."""
        with _STATE_GUARD:  # the files of a batch are read by several threads (rows.in_parallel)
            first, self.full = not self.full, True
        if first:
            log.warning("%s; reading on without it (uncached: every block is fetched from the store again)",
                        error.strerror or error)

    @staticmethod
    def key(*parts: str) -> str:
        return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:40]

    def file(self, key: str, size: int) -> CachedFile:
        # A block table only means something at one block size: readers of another size (a BlockCache made
        # with block_bytes=..., another cachebuild version) get their own files, or each would resize the
        # other's mapped table (a SIGBUS) and overwrite its entries.
        if self.block_bytes != DEFAULT_BLOCK_BYTES:
            key = self.key(key, f"block_bytes={self.block_bytes}")
        return CachedFile(self, key, size)

    def full_error(self, path: Path) -> BlockCacheFullError:
        """The error for a disk that has no room for the block cache (named, with what to do about it)."""
        try:
            free = f"{shutil.disk_usage(self.folder).free >> 20} MiB free"
        except OSError:
            free = "free space unknown"
        return BlockCacheFullError(errno.ENOSPC, f"block cache {self.folder} is out of disk space ({free}) writing "
                                   f"{path.name}; free space there, or pass local_cache_bytes below what it has "
                                   f"free (now {self.max_bytes >> 20} MiB)")

    def _object_path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.obj"

    def lookup_object(self, key: str) -> bytes | None:
        """A whole object kept by :meth:`store_object`, when it is there and passes its checksum."""
        path = self._object_path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        # > 4: no object kept is empty, and 4 zero bytes (a crash's zero-filled file) pass crc32(b"") == 0.
        if len(blob) > 4 and _crc(memoryview(blob)[:-4]) == int.from_bytes(blob[-4:], "little"):
            os.utime(path)
            return blob[:-4]
        path.unlink(missing_ok=True)  # damaged: fetch again
        return None

    def store_object(self, key: str, data: bytes) -> None:
        """Keep ``data`` under ``key`` (a disk too full for it: not kept, warned once)."""
        if self.full:
            return
        path = self._object_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with AtomicFile(path) as f:
                f.file.write(data)
                f.file.write(_crc(data).to_bytes(4, "little"))
        except OSError as e:
            if e.errno in _NO_SPACE:
                self.note_full(self.full_error(path))
                return
            raise
        self.fetched(len(data))

    def fetched(self, nbytes: int) -> None:
        with _STATE_GUARD:
            self._since_check += nbytes
            due = self._since_check >= self.max_bytes * _EVICT_EVERY
            if due:
                self._since_check = 0
        if due:
            self.evict()

    def usage(self) -> int:
        """Bytes of disk the cache takes (allocated blocks, not the sparse files' apparent sizes)."""
        return sum(p.stat().st_blocks * 512 for p in self.folder.glob("*/*") if p.is_file())

    def evict(self, target: float = 0.9) -> int:
        """Delete least recently opened entries until under ``target * max_bytes``; one process at a time."""
        with open(self.folder / ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # another process is evicting
            entries: dict[Path, list[float]] = {}
            for p in self.folder.glob("*/*"):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                if is_temporary_name(p.name):  # a write killed before its rename: nobody will finish it
                    if time.time() - st.st_mtime > STALE_TMP_S:
                        p.unlink(missing_ok=True)
                    continue
                stem = p.with_suffix("")
                e = entries.setdefault(stem, [0.0, time.time()])
                e[0] += st.st_blocks * 512
                if p.suffix in (".crc", ".obj"):
                    e[1] = st.st_mtime
            total = sum(e[0] for e in entries.values())
            removed = 0
            for stem, (nbytes, _) in sorted(entries.items(), key=lambda kv: kv[1][1]):
                if total <= self.max_bytes * target:
                    break
                for suffix in (".crc", ".data", ".obj"):  # table first: a reader never sees data without it
                    stem.with_suffix(suffix).unlink(missing_ok=True)
                total -= nbytes
                removed += int(nbytes)
            return removed


# ---------------------------------------------------------------- readahead
#
# A sequential epoch (shuffle=False, or one worker's run of consecutive batches) asks for each shard in order, one
# batch-sized range at a time, and each batch would wait for its own bytes. Once a batch's rows of a file are one
# run of consecutive rows, the reader fetches the rest of that file and the next CACHEBUILD_READAHEAD_FILES files
# whole, in the background, into the block cache (as MosaicML Streaming downloads its shards ahead). A
# shard-windowed epoch (CacheSampler(shard_window=W)) fetches whole files in any order, WHOLE_FILE_THREADS at once.
# Exactness is the block cache's and the location's: readahead writes blocks through CachedFile.prefetch (each
# block checksummed before its table entry), its requests are pinned like every read, and a failure here is only
# logged: the reader that needs those bytes fetches them itself and meets the same error there.

STEP_BYTES = 8 << 20  # one request per 8 MiB: a reader needing a block waits for one step, not the file

WHOLE_FILE_THREADS = 4  # files fetched at once by a shard-windowed epoch's readahead (one a sequential read's)

class Readahead:
    """The files one reader has read ahead in this process, and its pool of ``threads`` background threads
    (made anew in each process: a forked child has none of its parent's threads; pickled without either).
    ``threads`` may change until the first :meth:`schedule` of a process makes its pool."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, int(threads))
        self._pid = -1
        self._state_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._scheduled: set[int] = set()
        self._futures: list[Future[None]] = []

    def __getstate__(self) -> dict[str, object]:
        return {"threads": self.threads}  # not empty: pickle skips __setstate__ for a falsy state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(int(state.get("threads", 1)))  # type: ignore[misc, call-overload]

    def schedule(self, key: int, job: Callable[[], int], what: str) -> bool:
        """Run ``job`` (a prefetch; it returns the bytes fetched) in the background once per ``key`` in this
        process; False when it was scheduled before."""
        if self._pid != os.getpid():
            self._state_lock = threading.Lock()
            self._pool, self._scheduled, self._futures, self._pid = None, set(), [], os.getpid()
        with self._state_lock:
            if key in self._scheduled:
                return False
            self._scheduled.add(key)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="cachebuild-readahead")
            self._futures.append(self._pool.submit(_quietly, job, what))
        return True

    def wait(self) -> None:
        """Until every readahead scheduled in this process has ended (tests, benchmarks)."""
        with self._state_lock:
            futures = list(self._futures) if self._pid == os.getpid() else []
        for f in futures:
            f.result()


def _quietly(job: Callable[[], int], what: str) -> None:
    try:
        job()
    except Exception as e:  # the reader that needs these bytes fetches them itself and raises there
        log.debug("readahead of %s stopped: %s", what, e)
