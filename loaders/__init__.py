"""loaders: feed a cachebuild cache to training — memory-mapped Dataset, shard-aware sampler, uint8
batches to the device, device-side transforms (``loaders.transforms``), the training loop (``loaders.train``).

Names are imported on first use (PEP 562), so ``cachebuild``'s CLI does not pay torch's import time
for commands that never touch it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CacheBatch", "CacheSampler", "CachedImageDataset", "DatasetOptions", "DeviceLoader", "FastLoader",
           "ThreadLoader", "collate_batch", "device_loader"]

_HOME = {
    "CacheBatch": "loaders.dataset",
    "CachedImageDataset": "loaders.dataset",
    "collate_batch": "loaders.dataset",
    "DatasetOptions": "loaders.dataset_options",
    "DeviceLoader": "loaders.device",
    "FastLoader": "loaders.device",  # ThreadLoader's name in the previous release, an alias for one release
    "ThreadLoader": "loaders.thread_loader",
    "device_loader": "loaders.device",
    "CacheSampler": "loaders.sampler",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'loaders' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
