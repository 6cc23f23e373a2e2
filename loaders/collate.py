"""A gathered batch (:class:`CacheBatch`) and how it becomes what the training loop receives.

``collate_fn=collate_batch`` passes a whole gathered batch through. Frameworks that build their own
``DataLoader`` (Lightning, timm, HF Trainer) pass no ``collate_fn``, and ``default_collate`` would stack it
again sample by sample; so a batch's samples are :class:`CacheSample` tuples, a type registered in torch's
documented collate extension map (``default_collate_fn_map``): ``default_collate`` handed a ``CacheBatch``
takes it as it is, and a list of ``CacheSample`` from elsewhere field by field, as torch does tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data._utils.collate import collate, default_collate_fn_map

__all__ = ["CacheBatch", "CacheSample", "collate_batch", "collate_cache_samples", "dataloader"]


class CacheSample(tuple):
    """One sample of a :class:`CacheBatch`, ``(image uint8 HWC view, int label[, box], *columns)``: a plain tuple
    but for its type, which tells ``default_collate`` where it came from."""

    __slots__ = ()


class CacheBatch(Sequence):
    """A whole batch already gathered: ``images`` uint8 (B, H, W, 3), ``labels`` int64 (B,) (or float (B, C) soft
    labels), ``boxes``, and the ``columns`` asked for. Also a sequence of :class:`CacheSample` views, so
    ``default_collate`` receives it whole and returns ``[images, labels[, boxes], *columns]`` without copying."""

    __slots__ = ("boxes", "columns", "images", "labels")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor | None = None,
                 columns: tuple[torch.Tensor, ...] = ()) -> None:
        self.images = images
        self.labels = labels
        self.boxes = boxes
        self.columns = columns

    def __len__(self) -> int:
        # labels, not images: an EncodedImages' ``shape`` is one sample's (H, W, 3), not the batch's
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> CacheSample:  # type: ignore[override]
        if isinstance(i, slice):
            raise TypeError("CacheBatch does not slice; use .images / .labels")
        label = int(self.labels[i]) if self.labels.ndim == 1 else self.labels[i]  # soft labels: a row
        head = (self.images[i], label) if self.boxes is None else (self.images[i], label, self.boxes[i])
        return CacheSample(head + tuple(c[i] for c in self.columns))

    def __iter__(self) -> Iterator[CacheSample]:
        return (self[i] for i in range(len(self)))

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        head = (self.images, self.labels) if self.boxes is None else (self.images, self.labels, self.boxes)
        return head + self.columns


def collate_batch(batch: Any) -> Any:
    """``collate_fn`` for ``DataLoader``: a :class:`CacheBatch` through as ``(images, labels[, boxes], *columns)``;
    anything else (per-sample tuples of a dataset with a ``transform``) to ``default_collate``."""
    if isinstance(batch, CacheBatch):
        return batch.as_tuple()
    return default_collate(batch)


def collate_cache_samples(batch: Sequence[Any], *,
                          collate_fn_map: dict[type | tuple[type, ...], Callable] | None = None) -> list[Any]:
    """The ``default_collate_fn_map`` entry for :class:`CacheSample`: a whole :class:`CacheBatch` as the list of
    its tensors (the type ``default_collate`` gives tuples), any other sequence field by field, as tuples."""
    if isinstance(batch, CacheBatch):
        return list(batch.as_tuple())
    size = len(batch[0])
    if any(len(s) != size for s in batch):
        raise RuntimeError("each element in list of batch should be of equal size")
    return [collate(list(field), collate_fn_map=collate_fn_map) for field in zip(*batch, strict=True)]


default_collate_fn_map[CacheSample] = collate_cache_samples


def dataloader(dataset: Any, batch_size: int, sampler: Any, *, num_workers: int, pin_memory: bool,
               prefetch_factor: int = 4, seed: int = 0, cls: type = DataLoader) -> Any:
    """A ``cls`` (DataLoader) of a cache's ``dataset`` as ``cachebuild train`` and ``CacheDataModule`` make it:
    batches passed through by ``collate_batch``, persistent workers, the dataset's batch ring sized to the
    batches in flight, and a generator of its own (no draw from the global RNG, which a resume restores)."""
    kw: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory, "collate_fn": collate_batch}
    if num_workers > 0:
        kw.update(persistent_workers=True, prefetch_factor=prefetch_factor)
        dataset.ring_slots = prefetch_factor + 3  # loaders.dataset_options.DEFAULT_RING_SLOTS's rule
    return cls(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed), **kw)
