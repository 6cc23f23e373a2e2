"""The fuzz test's decode process: takes byte strings over a pipe, decodes each as a build would, answers.

It runs apart from the test so that a crash (a segfault in a decoder) or a hang is observed, not
suffered: the test waits a bounded time for each answer and starts a new process after a death.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

__all__ = ["serve"]

MAX_PIXELS = 4_000_000  # what a fuzzed header may declare before it is refused (bounds each decode's memory)


def _check(placement: Any, size: int) -> str | None:
    y0, x0, y1, x1 = placement.box
    if not (placement.height > 0 and placement.width > 0 and 0 <= y0 < y1 <= size and 0 <= x0 < x1 <= size):
        return f"bad placement {placement}"
    return None


def serve(conn: Connection) -> None:
    import os

    os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")  # a warning per damaged file is noise here
    import cv2

    from cachebuild.builder.sample import ResizeSpec, decode_into
    from cachebuild.errors import DecodeError

    cv2.setNumThreads(1)
    out = np.empty((32, 32, 3), dtype=np.uint8)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        data, fit, interpolation = msg
        spec = ResizeSpec(size=32, fit=fit, interpolation=interpolation, max_pixels=MAX_PIXELS)
        t0 = time.perf_counter()
        try:
            placed = decode_into(data, spec, out, path="fuzz")
            verdict, detail = ("ok", _check(placed, 32))
        except DecodeError as e:
            verdict, detail = ("skip", None if e.reason.strip() and e.path == "fuzz" else f"empty reason: {e!r}")
        except BaseException as e:  # anything else is the finding
            verdict, detail = ("crash", f"{type(e).__name__}: {e}")
        seconds = time.perf_counter() - t0
        conn.send((verdict, detail, seconds, _peak_rss_mb(reset=True)))


def _peak_rss_mb(reset: bool) -> float:
    """This process's peak resident memory (VmHWM) in MB, reset after reading (Linux: clear_refs 5) so
    that each decode is measured on its own; ru_maxrss where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        return hwm / 1024
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
