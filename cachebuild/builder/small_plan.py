"""Small local builds run in the calling process: starting worker processes costs more than their work.

Each loky worker starts a Python, imports numpy, joblib and OpenCV (~0.5 s of CPU; until issue 36 torch too,
1.5-4 s on a 2-core machine) and then decodes its share. A plan of a few hundred images decodes in about a
second on one core, so for such a plan (``make demo``'s 410 photos) the workers' start-up is most of the build.
With ``--jobs`` left at its default, a local plan of at most :data:`IN_PROCESS_MAX` files and, where the plan
knows its files' sizes, at most :data:`IN_PROCESS_MAX_BYTES` of them (a few hundred large photos still deserve
every core) is built by the calling process instead, with one OpenCV thread while the blocks run, as in a worker.
Blocks, bytes and records are those of any other build (block boundaries follow from the plan alone).

An update (``--update``) that has at most as much to decode, and at most :data:`IN_PROCESS_COPY_BYTES` of stored
samples to copy, runs in the calling process too, even with ``--jobs N``: copying and hashing its reused samples
at ~1 GB/s takes less than two workers' start-up (measured: an update of 10 of 100,000 files at 32 px took
12.7 s with two workers, 5.2 s in the calling process).

An explicit ``--jobs N`` (but for such updates), another joblib backend (``--dask-scheduler``) and URL sources
(whose planning has already started the storage layer's I/O threads in this process) keep the worker processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachebuild.sources.plan import Plan

__all__ = ["IN_PROCESS_COPY_BYTES", "IN_PROCESS_MAX", "IN_PROCESS_MAX_BYTES", "default_backend", "in_process",
           "runs_in_process", "update_runs_in_process"]

IN_PROCESS_MAX = 1000  # planned files
IN_PROCESS_MAX_BYTES = 32 << 20  # of source files: on one core about as long to decode as workers take to start
IN_PROCESS_COPY_BYTES = 8 << 30  # of samples an update copies: hashed on one core in seconds


def default_backend() -> bool:
    """True when joblib would use its default process backend (no ``parallel_config`` in force)."""
    from joblib.parallel import get_active_backend

    backend, _ = get_active_backend()
    return type(backend).__name__ == "LokyBackend"


def runs_in_process(jobs: int, plan: Plan) -> bool:
    """True for a small local plan at the default ``jobs`` (-1) under joblib's default backend."""
    from cachebuild.storage import is_url

    if jobs != -1 or len(plan) > IN_PROCESS_MAX or is_url(str(plan.root)) or not default_backend():
        return False
    return plan.file_stats is None or int(plan.file_stats[:, 0].clip(min=0).sum()) <= IN_PROCESS_MAX_BYTES


def update_runs_in_process(plan: Plan, decode: Any, copy_bytes: int) -> bool:
    """True for an update with little to decode (``decode``: a bool mask over the plan) and at most
    :data:`IN_PROCESS_COPY_BYTES` to copy, of a local source under joblib's default backend."""
    from cachebuild.storage import is_url

    todo = int(decode.sum())
    if todo > IN_PROCESS_MAX or copy_bytes > IN_PROCESS_COPY_BYTES or is_url(str(plan.root)) or \
            not default_backend():
        return False
    return plan.file_stats is None or int(plan.file_stats[decode, 0].clip(min=0).sum()) <= IN_PROCESS_MAX_BYTES


@contextlib.contextmanager
def in_process(enabled: bool) -> Iterator[None]:
    """When ``enabled``: one OpenCV thread while the blocks run, as in a worker; the caller's own setting
    comes back after. Otherwise nothing. (The CPU build imports no torch: see ``block._init_worker``.)"""
    if not enabled:
        yield
        return
    import cv2

    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(threads)
