"""In-RAM mode: the whole cache loaded once into one shared-memory tensor that every worker maps.

A torch tensor in shared memory crosses process boundaries by handle (fork inherits the mapping; spawn and
forkserver receive it through torch's reductions), so N workers hold one copy. Not
``multiprocessing.shared_memory``: its resource tracker unlinks segments when an attaching worker exits
(Python < 3.13). On Linux the memory is a file in /dev/shm, a tmpfs containers often keep small (Docker's
64 MB); a full one is an error at allocation, which :func:`shared_uint8` words: what was free, what to change.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["SHM_DIR", "Gatherable", "auto_budget", "load_shared", "shared_uint8", "shm_free_bytes"]

_COPY_BYTES = 64 << 20  # copy in ~64 MB blocks: no transient full-size buffer besides the target
SHM_DIR = "/dev/shm"  # where shm_open (torch's shared memory on Linux) keeps its files


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm now, or None where there is no such tmpfs (macOS, Windows)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


_BATCH_FIX = "use fewer DataLoader workers, a smaller batch or a smaller prefetch_factor"


def shared_uint8(shape: tuple[int, ...], *, what: str = "batch", instead: str = _BATCH_FIX) -> torch.Tensor:
    """An uninitialised uint8 tensor allocated directly in shared memory (no copy via ``share_memory_``).

    When it does not fit: MemoryError naming ``what``, the space /dev/shm had free, and the fixes
    (a larger /dev/shm, or ``instead``).
    """
    nbytes = int(np.prod(shape))
    try:
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    except RuntimeError as e:  # torch: "unable to allocate shared memory(shm) ...: No space left on device"
        free = shm_free_bytes()
        where = "" if free is None else f"{SHM_DIR} has {_mb(free)} free; "
        raise MemoryError(
            f"cannot allocate {_mb(nbytes)} of shared memory for a {what} of shape {tuple(shape)} ({e}): "
            f"{where}enlarge {SHM_DIR} (docker run --shm-size=8g; on Kubernetes an emptyDir with "
            f"medium: Memory mounted there), or {instead}"
        ) from None
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape)  # type: ignore[call-overload]


class Gatherable(Protocol):
    """What :func:`load_shared` reads from (a :class:`~loaders.dataset.CachedImageDataset`)."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def __len__(self) -> int: ...

    def gather(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray: ...


def load_shared(ds: Gatherable) -> torch.Tensor:
    """Copy every image of ``ds`` into one shared-memory uint8 (N, H, W, 3) tensor, block by block."""
    n = len(ds)
    out = shared_uint8((n, *ds.shape), what="whole cache (in_memory=True)",
                       instead="use in_memory=False (memory-mapped reads) or in_memory='auto'")
    dst = out.numpy()
    rows = max(1, _COPY_BYTES // max(1, int(np.prod(ds.shape))))  # the bytes of one sample
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        ds.gather(np.arange(lo, hi), out=dst[lo:hi])
    return out


def auto_budget(memory_budget: int | None) -> int:
    """Bytes this process may load for ``in_memory="auto"``.

    Each process loads its own copy, and torchrun starts LOCAL_WORLD_SIZE of them on a node at once,
    each seeing the same free memory: the node-wide figures (half of MemAvailable unless the caller set
    a budget, half of /dev/shm's free space) are split between them.
    """
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    budget = _default_budget() // local if memory_budget is None else int(memory_budget)
    shm_free = shm_free_bytes()
    if shm_free is not None:
        budget = min(budget, shm_free // 2 // local)
    return budget


def _default_budget() -> int:
    """Half of MemAvailable (Linux); 0 (never automatic) where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 0
