"""``DatasetOptions``: every setting of a :class:`~loaders.dataset.CachedImageDataset`, declared and checked once.

``CachedImageDataset(root)`` reads with the defaults; ``CachedImageDataset(root, DatasetOptions(in_memory=True))``
with others. A frozen dataclass, so one value can open several caches the same way (train and val, each rank),
be changed with ``dataclasses.replace`` and be passed on whole (``CacheDataModule(dataset_options=...)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from cachebuild.storage import BlockCache
from loaders.batch_ring import MAX_SLOTS
from loaders.worker_crop import CropSpec, flip_probability, normalize_matrix

__all__ = ["DEFAULT_RING_SLOTS", "DatasetOptions"]

# Batch slots per DataLoader worker: the DataLoader keeps prefetch_factor (default 2) batches in flight
# per worker, the loop holds the batch it works on and the one before (a `for x, y in dl` rebinds x only
# after next() returns), and device_loader one more.
DEFAULT_RING_SLOTS = 5


@dataclass(frozen=True)
class DatasetOptions:
    """How a :class:`~loaders.dataset.CachedImageDataset` opens a cache and what its samples and batches hold.

    What a sample is:
        transform: optional per-sample CPU callable applied to the uint8 HWC tensor. With it, batches
            are collated sample by sample (slower); the fast path is ``transform=None`` plus device-side
            transforms on the batch.
        return_boxes: also return the valid box ``(y0, x0, y1, x1)`` int32 (end-exclusive) of each sample.
            Caches built with ``--fit pad`` store it; for other caches every pixel is valid, so the box is
            the full image ``(0, 0, H, W)``.
        crop: crop in the loader's workers (``loaders.worker_crop``): a
            :class:`~loaders.worker_crop.RandomResizedCrop` (train) or :class:`~loaders.worker_crop.CenterCrop`
            (eval). Each sample is cropped inside its valid box and resized straight into the batch, which is
            then uint8 (B, size, size, 3): the device side only normalizes. Boxes and flips are a pure function
            of (``seed``, epoch, sample index); set the epoch with ``set_epoch`` (or an
            :class:`~loaders.worker_crop.EpochSampler`) and the output size with ``set_resolution``.
        columns: names of the cache's columns (``cachebuild columns add``) to carry with every sample and
            batch, after the image, the label and the box: ``(image, label[, box], *columns)``; each is a
            tensor of its stored dtype, (B, ...) in a batch. A name the cache lacks is an error at open.
        labels: a column to serve as the labels instead of the built-in ones (``cachebuild train --labels``):
            an integer (N,) column (relabelled classes) or float (N, C) soft labels (distillation targets).
        flip: with a ``RandomResizedCrop``, mirror each sample left-right with probability 0.5
            (``True``) or the given probability.
        seed: the seed of the crop boxes and flips.
        normalize: with a ``crop``, ``(mean, std)`` (0-1 units, as torchvision's ``Normalize``): the workers
            also normalize, and batches are float32 (B, size, size, 3) (``device_loader``: NCHW channels_last),
            what a CPU training step takes, with no pass over the batch in the main process. Leave it
            None on CUDA, where the uint8 batch is 4x fewer bytes to copy and normalizing there is free.
        decode: for compact caches (``--codec jpeg``): ``"cpu"`` decodes each batch where it is read (a small
            pool of threads per process, ``decode_threads`` of them: the one setting of how many; default, by
            ``cachebuild.storage.kinds.jpeg.decode_threads``: the CPUs divided among the DataLoader's workers, at
            most 4, and none in ``ThreadLoader``'s threads, which decode their own samples); ``"none"`` makes
            batches carry the stored JPEGs undecoded
            (:class:`~loaders.encoded.EncodedImages`) for ``device_loader(..., decode="cuda")``, which sets
            it. Raw caches have nothing to decode and ignore both.

    Where the pixels are read from:
        in_memory: ``False`` reads through memory maps (page cache); ``True`` loads the whole cache once
            into shared memory that every DataLoader worker sees (fork or spawn, no per-worker copy);
            ``"auto"`` does so when the images fit ``memory_budget`` and half of the space free in
            /dev/shm (the other half is left to batches in flight: containers often keep it small),
            both split between the ``LOCAL_WORLD_SIZE`` processes torchrun starts on a node, each of
            which loads its own copy.
        memory_budget: bytes one process may load for ``in_memory="auto"``; default half of the
            available RAM, split as above.
        ring_slots: reused batch slots per ``DataLoader`` worker (``loaders.batch_ring``); costs
            ``ring_slots`` x batch bytes of shared memory per worker (5 x 38.5 MB for 256 x 224 x 224 x 3),
            mapped by the worker and the main process. Use ``prefetch_factor + 3`` when raising the
            DataLoader's ``prefetch_factor``; 0 allocates a fresh shared batch every time (the old path).
            A batch that finds no free slot (e.g. the loop keeps every batch) gets a fresh one.

    A cache at a URL, and which cache:
        local_cache: for a URL, a local folder where fetched blocks are kept (bounded by
            ``local_cache_bytes``, shared safely by workers and jobs), so later epochs read local disk; or a
            :class:`~cachebuild.storage.BlockCache`.
        local_cache_bytes: the size bound of a ``local_cache`` folder.
        storage_options: fsspec options for a URL (credentials normally come from the store's config).
        expect_fingerprint: a prefix (8+ hex digits) of the cache's fingerprint, i.e. its build key, as
            ``cachebuild info`` / ``ls`` show it: opening a rebuilt or different cache then raises
            ``FingerprintMismatchError`` naming both, instead of training on other data.
    """

    transform: Callable[[torch.Tensor], Any] | None = None
    return_boxes: bool = False
    crop: CropSpec | None = None
    columns: tuple[str, ...] = ()
    labels: str | None = None
    flip: bool | float = False
    seed: int = 0
    normalize: tuple[Sequence[float], Sequence[float]] | None = None
    decode: Literal["cpu", "none"] = "cpu"
    decode_threads: int | None = None
    in_memory: bool | Literal["auto"] = False
    memory_budget: int | None = None
    ring_slots: int = DEFAULT_RING_SLOTS
    local_cache: str | os.PathLike[str] | BlockCache | None = None
    local_cache_bytes: int | None = None
    storage_options: Mapping[str, Any] | None = None
    expect_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if self.decode not in ("cpu", "none"):
            raise ValueError(f"decode must be 'cpu' or 'none', got {self.decode!r}")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1 or None, got {self.decode_threads}")
        if self.in_memory not in (True, False, "auto"):
            raise ValueError(f"in_memory must be True, False or 'auto', got {self.in_memory!r}")
        if not 0 <= self.ring_slots <= MAX_SLOTS:
            raise ValueError(f"ring_slots must be in 0..{MAX_SLOTS}, got {self.ring_slots}")
        flip_probability(self.crop, self.flip)
        if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
            raise TypeError(f"columns must be a list of column names, got {self.columns!r}")
        object.__setattr__(self, "columns", tuple(self.columns))  # a list is fine; kept hashable and frozen
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"columns names a column twice: {list(self.columns)}")
        normalize_matrix(self.crop, self.normalize)
