"""loaders: feed a cachebuild cache to training — memory-mapped Dataset, shard-aware sampler, uint8
batches to the device, device-side transforms (``loaders.transforms``), the training loop (``loaders.train``).

Names are imported on first use (PEP 562), so ``cachebuild``'s CLI does not pay torch's import time
for commands that never touch it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CacheBatch", "CacheSampler", "CachedImageDataset", "DatasetOptions", "DeviceLoader", "collate_batch",
           "device_loader"]

_HOME = {
    "CacheBatch": "loaders.dataset",
    "CachedImageDataset": "loaders.dataset",
    "collate_batch": "loaders.dataset",
    "DatasetOptions": "loaders.dataset_options",
    "DeviceLoader": "loaders.device",
    "device_loader": "loaders.device",
    "CacheSampler": "loaders.sampler",
}


# Loaders of earlier releases: batches gathered by threads of the training process. One way loads batches now.
_REMOVED = ("ThreadLoader", "FastLoader")
THREADS_REMOVED = (
    "{name} was removed: load a cache's batches with torch's DataLoader and collate_batch, "
    "torch.utils.data.DataLoader(ds, batch_size, sampler=CacheSampler(ds, shuffle=True), num_workers=N, "
    "collate_fn=collate_batch), CacheSampler and collate_batch from loaders; num_workers=0 loads in the main process"
)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    if name in _REMOVED:  # ImportError, not AttributeError: `from loaders import ThreadLoader` keeps the message
        raise ImportError(THREADS_REMOVED.format(name=name), name=name)
    raise AttributeError(f"module 'loaders' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
