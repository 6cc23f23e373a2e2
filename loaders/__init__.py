"""loaders: feed a cachebuild cache to training — memory-mapped Dataset, shard-aware sampler, uint8
batches to the device, device-side transforms (``loaders.transforms``), the training loop (``loaders.train``)."""

from loaders.dataset import CacheBatch, CachedImageDataset, collate_batch
from loaders.device import DeviceLoader, FastLoader, device_loader
from loaders.sampler import CacheSampler

__all__ = [
    "CacheBatch",
    "CacheSampler",
    "CachedImageDataset",
    "DeviceLoader",
    "FastLoader",
    "collate_batch",
    "device_loader",
]
