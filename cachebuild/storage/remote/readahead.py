"""Whole-file readahead for a sequential cold read of a URL cache through a block cache.

A sequential epoch (``shuffle=False``, or one worker's run of consecutive batches) asks for each shard in
order, one batch-sized range at a time; each batch then waits for its own bytes. Once a batch's rows of a
file are one run of consecutive rows, this process fetches the rest of that file and the next
``CACHEBUILD_READAHEAD_FILES`` files whole, in a background thread, into the block cache (as MosaicML
Streaming downloads its shards ahead), so later batches find their blocks local.

Exactness is the block cache's and the location's, unchanged: readahead writes blocks through the same
:meth:`CachedFile.prefetch` path (each block checksummed before its table entry), its requests go through the
same pinned reads (``If-Match``), and a failure here is only logged: the reader that needs those bytes fetches
them itself and meets the same error (a file changed since the job opened it is a ``CacheChangedError``
there, never another version's bytes). Shuffled reads (many runs a file) never trigger it.

A shard-windowed epoch (``CacheSampler(shard_window=W)``) fetches whole files in any order: its readahead
runs ``WHOLE_FILE_THREADS`` fetches at once (each one file's steps in order), so that a batch entering a
new group of files finds them fetching together, and one slow file holds up no other.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["STEP_BYTES", "WHOLE_FILE_THREADS", "Readahead"]

STEP_BYTES = 8 << 20  # one request per 8 MiB: a reader needing a block waits for one step, not the file

WHOLE_FILE_THREADS = 4  # files fetched at once by a shard-windowed epoch's readahead (one a sequential read's)

log = logging.getLogger("cachebuild")


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
