"""Threads of one process share a reader's shard handles: each file is opened once however many threads ask
for it at the same time, and a descriptor is never left behind (a :class:`CachedFile` holds two until it is
closed, so a second handle of a file leaked them for the life of the process)."""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from cachebuild.storage import BlockCache
from cachebuild.storage.kinds.npy import RowFiles, Segment
from cachebuild.storage.locations.url import FsspecLocation

FILES = 6
THREADS = 24


def _open_fds(under) -> int:
    """Descriptors of this process open on files under ``under`` (the test's block caches): other threads of
    the test process (servers, pools) open and close sockets meanwhile, so a plain count is not this reader's."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed between the listing and the look
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(under))
    return n


def _rows(tmp_path, folder: str) -> RowFiles:
    # Opening a mirror makes local files only: the URL is never asked for anything here.
    segments = [Segment(f"images-{k:05d}.npy", k * 8, 8, 128) for k in range(FILES)]
    location = FsspecLocation("http://127.0.0.1:9/cache")
    return RowFiles(location, segments, (4, 4, 3), block_cache=BlockCache(tmp_path / folder), cache_id="c1")


def _open_all(rows: RowFiles, threads: int) -> list[list[object]]:
    start = threading.Barrier(threads)
    got: list[list[object]] = [[] for _ in range(threads)]

    def run(t: int) -> None:
        start.wait()
        for k in (np.arange(FILES) + t) % FILES:  # each thread in another order: every file contended
            got[t].append(rows._handle(int(k)))

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return got


def test_racing_threads_open_each_shard_once_and_leak_no_descriptor(tmp_path):
    one = _rows(tmp_path, "alone")
    before = _open_fds(tmp_path)
    _open_all(one, 1)
    per_reader = _open_fds(tmp_path) - before  # what opening every file once costs
    assert per_reader >= 2 * FILES
    kept = []  # every reader stays alive: a dropped one's maps would close and hide what leaked
    for trial in range(5):
        rows = _rows(tmp_path, f"raced{trial}")
        kept.append(rows)
        before = _open_fds(tmp_path)
        got = _open_all(rows, THREADS)
        handles = {id(h) for per_thread in got for h in per_thread}
        assert len(handles) == FILES, f"trial {trial}: {len(handles)} handles for {FILES} files"
        assert _open_fds(tmp_path) - before == per_reader, f"trial {trial}: descriptors leaked"
        for k in range(FILES):  # each thread was given the handle the reader keeps
            assert all(per_thread[(k - t) % FILES] is rows._handle(k) for t, per_thread in enumerate(got))
