"""In-RAM mode: the whole cache loaded once into one shared-memory tensor that every worker maps.

A torch tensor whose storage was allocated in shared memory crosses process boundaries by handle:
DataLoader workers started by fork inherit the mapping, and workers started by spawn or forkserver
receive it through torch's multiprocessing reductions (a file descriptor or a named segment, per
``torch.multiprocessing.get_sharing_strategy()``), so N workers hold one copy, not N. Chosen over
``multiprocessing.shared_memory`` because that module's resource tracker unlinks segments when an
attaching worker exits (Python < 3.13) and warns at shutdown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from loaders.dataset import CachedImageDataset

__all__ = ["load_shared", "shared_uint8"]

_COPY_BYTES = 64 << 20  # copy in ~64 MB blocks: no transient full-size buffer besides the target


def shared_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised uint8 tensor allocated directly in shared memory (no copy via ``share_memory_``)."""
    nbytes = int(np.prod(shape))
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape)  # type: ignore[call-overload]


def load_shared(ds: CachedImageDataset) -> torch.Tensor:
    """Copy every image of ``ds`` into one shared-memory uint8 (N, H, W, 3) tensor, block by block."""
    n = len(ds)
    shape = (n, *ds.shape)
    try:
        out = shared_uint8(shape)
    except RuntimeError as e:  # /dev/shm too small, typically in containers
        raise MemoryError(
            f"cannot allocate {ds.nbytes / 1e9:.2f} GB of shared memory for in_memory=True ({e}); "
            "enlarge /dev/shm (docker --shm-size) or use in_memory=False"
        ) from None
    dst = out.numpy()
    rows = max(1, _COPY_BYTES // max(1, ds.manifest.sample_nbytes))
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        ds.gather(np.arange(lo, hi), out=dst[lo:hi])
    return out
