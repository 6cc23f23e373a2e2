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

from cachebuild.storage import BlockCache
from loaders.batch_ring import MAX_SLOTS
from loaders.sample_transform import TransformInput, check_transform

__all__ = ["DEFAULT_RING_SLOTS", "DatasetOptions"]

# Batch slots per worker: prefetch_factor (2) in flight, the loop's batch and the one before it (a `for x, y
# in dl` rebinds x only after next() returns), and device_loader's one ahead.
DEFAULT_RING_SLOTS = 5


@dataclass(frozen=True)
class DatasetOptions:
    """How a :class:`~loaders.dataset.CachedImageDataset` opens a cache and what its samples and batches hold.

    What a sample is:
        transform: a per-sample CPU callable; batches are then collated sample by sample (slower than ``None``
            plus device transforms on the batch).
        transform_input: what ``transform`` is given (``loaders.sample_transform``): ``'pil'`` an RGB PIL image
            (an ImageFolder pipeline unchanged), ``'chw'`` a uint8 (3, H, W) tensor (torchvision v2), ``'hwc'``
            the uint8 (H, W, 3) sample; None: ``'hwc'``, and a torchvision transform is refused (it would
            misread the sample's axes) with a message naming this option and docs/porting.md.
        return_boxes: also return each sample's valid box ``(y0, x0, y1, x1)`` int32, end-exclusive (stored by
            ``--fit pad`` caches; the whole image otherwise).
        crop: crop in the loader's workers (``loaders.worker_crop``) with the device transforms' classes:
            ``RandomResizedCrop(size, scale, ratio, flip_p)`` (train), ``CenterCrop(size)`` after an optional
            ``Resize(short_side)`` in a ``Compose`` (eval). Each sample is cropped inside its valid box straight
            into a uint8 (B, size, size, 3) batch; boxes and flips are a pure function of (``seed``, epoch,
            index). ``CacheSampler.set_epoch`` (or ``ds.set_epoch``) sets the epoch, ``set_resolution`` the size.
        columns: the cache's columns (``cachebuild columns add``) to carry after the image, label and box:
            ``(image, label[, box], *columns)``, each of its stored dtype; a name the cache lacks is an error.
        labels: a column to serve as the labels (``cachebuild train --labels``): integer (N,) class indices
            (relabelled) or float (N, C) soft labels (distillation targets).
        flip: the previous release's spelling of ``RandomResizedCrop(flip_p=)`` (``True``: 0.5), for one release.
        seed: the seed of the crop boxes and flips.
        normalize: with a ``crop``, ``(mean, std)`` (0-1 units, as torchvision's ``Normalize``): the workers
            normalize too and batches are float32, what a CPU training step takes. Leave it None on CUDA,
            where the uint8 batch is 4x fewer bytes to copy and normalizing is free.
        decode: for compact caches (``--codec jpeg``): ``"cpu"`` decodes each batch where it is read (a small
            pool of threads per process, ``decode_threads`` of them: the one setting of how many; default, by
            ``cachebuild.storage.kinds.jpeg.decode_threads``: the CPUs divided among the DataLoader's workers, at
            most 4); ``"none"`` makes batches carry the stored JPEGs undecoded
            (:class:`~loaders.encoded.EncodedImages`) for ``device_loader(..., decode="cuda")``, which sets
            it. Raw caches have nothing to decode and ignore both.

    Where the pixels are read from:
        in_memory: ``False`` reads through memory maps; ``True`` loads the cache once into shared memory that
            every DataLoader worker sees (fork or spawn, one copy); ``"auto"`` does so when it fits
            ``memory_budget`` and half the free space of /dev/shm, both split between the
            ``LOCAL_WORLD_SIZE`` processes torchrun starts on a node (each loads its own copy).
        memory_budget: bytes one process may load for ``"auto"``; default half the available RAM, split so.
        ring_slots: reused batch slots per DataLoader worker (``loaders.batch_ring``), each a batch of shared
            memory mapped by the worker and the main process; ``prefetch_factor + 3`` with a larger
            ``prefetch_factor``; 0: a fresh shared batch each time (as a batch that finds no free slot gets).

    A cache at a URL, and which cache:
        local_cache: a local folder (or a :class:`~cachebuild.storage.BlockCache`) keeping fetched blocks, shared
            safely by workers and jobs, so later epochs read local disk; bounded by ``local_cache_bytes``.
        storage_options: fsspec options for a URL (credentials normally come from the store's config).
        expect_fingerprint: a prefix (8+ hex digits) of the cache's fingerprint (its build key, as ``cachebuild
            info`` shows it): a rebuilt or other cache raises ``FingerprintMismatchError`` naming both.
    """

    transform: Callable[[Any], Any] | None = None
    transform_input: TransformInput | None = None
    return_boxes: bool = False
    crop: Any = None
    columns: tuple[str, ...] = ()
    labels: str | None = None
    flip: bool | float | None = None
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
        check_transform(self.transform, self.transform_input)
        if self.transform_input == "pil" and self.normalize is not None:
            raise ValueError("transform_input='pil' needs uint8 samples: drop normalize (the workers would hand "
                             "the transform float32 samples, which are no PIL image)")
        if self.decode not in ("cpu", "none"):
            raise ValueError(f"decode must be 'cpu' or 'none', got {self.decode!r}")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1 or None, got {self.decode_threads}")
        if self.in_memory not in (True, False, "auto"):
            raise ValueError(f"in_memory must be True, False or 'auto', got {self.in_memory!r}")
        if not 0 <= self.ring_slots <= MAX_SLOTS:
            raise ValueError(f"ring_slots must be in 0..{MAX_SLOTS}, got {self.ring_slots}")
        if isinstance(self.columns, str) or not all(isinstance(c, str) for c in self.columns):
            raise TypeError(f"columns must be a list of column names, got {self.columns!r}")
        object.__setattr__(self, "columns", tuple(self.columns))  # a list is fine; kept hashable and frozen
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"columns names a column twice: {list(self.columns)}")
        if self.crop is not None or self.flip is not None or self.normalize is not None:
            from loaders.worker_crop import check_crop, flip_probability, normalize_matrix

            if self.crop is not None:
                check_crop(self.crop, self.flip)
            elif self.flip is not None and flip_probability(self.flip):
                raise ValueError("flip needs crop=RandomResizedCrop(..., flip_p=): eval crops do not flip")
            normalize_matrix(self.crop, self.normalize)
