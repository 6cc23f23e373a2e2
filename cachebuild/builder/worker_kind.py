"""Threads or processes for a local CPU build's ``--jobs`` blocks.

Worker processes each start a Python and import numpy, joblib, OpenCV and the block modules (~0.35 s on the
2-core VM before their first block), and every block and record is pickled between them and the parent.
Threads of the building process start at once and share its imports; what a sample costs runs outside the
GIL (libjpeg-turbo through simplejpeg and OpenCV, OpenCV's resizes, scipy's sparse kernel, xxhash, file
reads and writes), so two threads kept 1.87 cores busy on the bench's photos. What holds the GIL is the
per-file Python between those calls (~40-60 us): against a photo's ~0.8 ms that is little, against a tiny
file's ~0.1 ms it is half. Measured (issue 36, the 2-core VM, load 0.6-0.8): 5,000 bench photos (43 KB
mean) to 224 px, whole build, 3 rounds: processes 2.98-3.43 s, threads 2.67-2.96 s; 10,000 of the scale
tree's 40-80 px crops (1.5 KB mean) to 32 px: processes 1.56-1.59 s, threads 1.86-2.14 s. Once started,
processes are a little faster (the GIL is never contended): the same 5,000 photos built again by a warm
pool, 3 rounds, load 0.7: processes 2.18-2.91 s (median 2.33), threads 2.29-2.53 s (median 2.45), ~5%, while
the first build, start-up included, took 2.98-4.13 s in processes and 2.40-2.75 s in threads. So ``auto``
takes threads where the plan's files average at least :data:`THREADS_FROM_BYTES` and the plan has at most
:data:`THREADS_MAX_FILES` of them (past that, 5% of the build outweighs the ~0.6 s of start-up).

Processes stay for what threads cannot do as well: another joblib backend (``--dask-scheduler``), a GPU
build (one CUDA context per worker), URL sources (their readers' I/O threads started in the parent),
updates (their copies run in the blocks), storage kinds whose sinks threads must not share (zarr: its
settings are process-wide), and builds large enough that workers import torch for its
faster antialias kernel (``geometry.TORCH_RESIZE_FROM``): importing torch into the caller's process would
change its thread settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachebuild.sources.plan import Plan

__all__ = ["THREADS_FROM_BYTES", "THREADS_MAX_FILES", "use_threads"]

THREADS_FROM_BYTES = 16 << 10  # mean source file: photo-sized JPEGs decode for long enough to free the GIL
THREADS_MAX_FILES = 20_000  # ~12 s of build on 2 cores: where 5% of it is the start-up threads save


def use_threads(workers: str, plan: Plan, *, pool: bool, torch_resize: bool, update: bool,
                threaded_sinks: bool = True) -> bool:
    """True when the blocks should run in threads of this process. ``pool``: the build runs blocks in
    parallel under joblib's default backend on the CPU (not in-process, not Dask, not a GPU build);
    ``threaded_sinks``: the storage kind's sinks may be written by threads at once (``Backend``)."""
    from cachebuild.storage import is_url

    if workers == "processes" or not pool or not threaded_sinks:
        return False
    if workers == "threads":
        return True
    if torch_resize or update or is_url(str(plan.root)) or plan.file_stats is None or not 0 < len(plan) <= \
            THREADS_MAX_FILES:
        return False
    sizes = plan.file_stats[:, 0].clip(min=0)
    return int(sizes.sum()) >= THREADS_FROM_BYTES * len(plan)
