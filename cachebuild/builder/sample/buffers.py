"""Each thread's reused work arrays for one sample's decode and resize.

A fresh multi-MB array per image is page-faulted in again each time (a decode's output, the antialias
passes' float32 copies: issue 36); a thread keeps one array per name and hands out views of it. Arrays past
:data:`REUSE_BYTES` are made for the call, so a rare giant image keeps no memory behind.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["REUSE_BYTES", "thread_buffer"]

REUSE_BYTES = 32 << 20
_MIN_BYTES = 1 << 20  # a first array large enough for the usual photo: no regrowth over the first few
_BUFFERS = threading.local()


def thread_buffer(name: str, n: int, dtype: type[np.generic]) -> np.ndarray:
    """``n`` items of ``dtype``, 1-D, contents undefined: a view of this thread's array ``name`` (grown when
    too small), or a new array when ``n`` items pass :data:`REUSE_BYTES`. A name's previous view is
    overwritten by the next call with that name."""
    itemsize = np.dtype(dtype).itemsize
    if n * itemsize > REUSE_BYTES:
        return np.empty(n, dtype)
    buf = getattr(_BUFFERS, name, None)
    if buf is None or buf.dtype != dtype or buf.size < n:
        buf = np.empty(max(n, _MIN_BYTES // itemsize), dtype)
        setattr(_BUFFERS, name, buf)
    return buf[:n]
