"""Lightning: ``CacheDataModule``, a ``LightningDataModule`` over caches (``pip install cachebuild[lightning]``).

* **Our sampler under DDP.** Lightning replaces (or wraps, sharding twice) a sampler that is not a
  ``DistributedSampler``; :class:`DistributedCacheSampler` is a ``CacheSampler`` that is also one, so the
  Trainer's defaults keep it: nothing to set on the Trainer. Rank and world size come from the Trainer, the
  epoch from Lightning's own ``sampler.set_epoch``.
* **Device transforms in ``on_after_batch_transfer``**: the uint8 NHWC batch viewed as NCHW channels_last (no
  copy), the train or val transform, then ``mix`` (e.g. ``MixUpCutMix``) on training batches. A
  LightningModule that overrides the hook too replaces this one.
* **Resume mid-epoch.** The training DataLoader is stateful (``state_dict``/``load_state_dict``, what
  Lightning's loops look for): a checkpoint holds the sampler's state, counted in samples the loop consumed,
  and ``Trainer.fit(..., ckpt_path=...)`` continues with exactly the rest of that epoch.

Validation uses the same sampler unshuffled (each rank every R-th sample, the tail repeated to equal counts,
as Lightning's own). This module is the only one that imports ``lightning``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from loaders.collate import dataloader
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.sampler import CacheSampler, removed_options

__all__ = ["CacheDataModule", "DistributedCacheSampler", "ResumableDataLoader"]

Transform = Callable[..., torch.Tensor]
Mix = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DistributedCacheSampler(CacheSampler, DistributedSampler):
    """A ``CacheSampler`` that Lightning recognises as a ``DistributedSampler`` (whose ``__init__`` is not run:
    ``CacheSampler`` sets every attribute it would, with the same meaning). ``len()`` is the whole epoch's
    ``num_samples``, as Lightning expects, also after a resume, when ``iter()`` yields only the rest."""

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose ``state_dict()`` is its sampler's (Lightning saves and restores it)."""

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)  # type: ignore[attr-defined]


def _open(source: Any, options: DatasetOptions) -> CachedImageDataset:
    if isinstance(source, CachedImageDataset):
        return source
    if isinstance(source, (str, os.PathLike)):
        return CachedImageDataset(source, options)
    raise TypeError(f"expected a cache folder, a cache URL or a CachedImageDataset, got {type(source).__name__}")


class CacheDataModule(pl.LightningDataModule):
    """Train (and optionally val) caches for ``lightning.Trainer``; see the module docstring.

    Args:
        train, val: a cache folder or URL (opened in each process's ``setup``), or a ``CachedImageDataset``.
        batch_size: per process (per GPU); ``val_batch_size`` defaults to it.
        num_workers: DataLoader worker processes per rank (0: load in the main process).
        train_transform, val_transform: device transforms called as ``t(images)`` on the uint8 NCHW
            batch (``t(images, boxes)`` when ``return_boxes``), e.g. ``loaders.transforms.imagenet_train()``
            (optionally ``torch.compile``-d); moved to the batch's device on first use.
        mix: a batch transform ``(images, labels) -> (images, soft targets)`` run on training batches after
            ``train_transform``, e.g. ``MixUpCutMix(num_classes)``; the targets then are float (N, C): use
            ``F.cross_entropy(logits, targets)``.
        seed: the sampler's base seed; default ``PL_GLOBAL_SEED`` (set by ``seed_everything``) or 0.
        shuffle, drop_last, shard_window: the training sampler's (``CacheSampler``) options.
        pin_memory: default True when the Trainer runs on CUDA.
        prefetch_factor: batches in flight per worker (the dataset's batch ring is sized to match).
        return_boxes: hand the valid boxes of a ``--fit pad`` cache to the transforms.
        dataset_options: the :class:`~loaders.dataset_options.DatasetOptions` the caches given by path or URL are
            opened with (``in_memory``, ``local_cache``...); its ``return_boxes`` is this module's.

    A training batch reaches ``training_step`` as ``(images, targets)`` (``images`` transformed, ``targets``
    int64 labels, or soft targets with ``mix``); ``(images, labels, boxes)`` when ``return_boxes`` and no
    transform consumed them; the columns of ``dataset_options.columns`` follow, in their order.
    """

    def __init__(self, train: str | os.PathLike[str] | CachedImageDataset,
                 val: str | os.PathLike[str] | CachedImageDataset | None = None, *, batch_size: int = 256,
                 val_batch_size: int | None = None, num_workers: int = 4, train_transform: Transform | None = None,
                 val_transform: Transform | None = None, mix: Mix | None = None, seed: int | None = None,
                 shuffle: bool = True, drop_last: bool = False, shard_window: int | None = None,
                 pin_memory: bool | None = None, prefetch_factor: int = 4, return_boxes: bool = False,
                 dataset_options: DatasetOptions | None = None, **removed: Any) -> None:
        removed_options(removed, "CacheDataModule")
        super().__init__()
        if batch_size < 1 or (val_batch_size is not None and val_batch_size < 1):
            raise ValueError(f"batch_size and val_batch_size must be >= 1, got {batch_size} and {val_batch_size}")
        if num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"num_workers must be >= 0 and prefetch_factor >= 1, got {num_workers}, {prefetch_factor}")
        self.train_source, self.val_source = train, val
        self.batch_size = int(batch_size)
        self.val_batch_size = int(val_batch_size or batch_size)
        self.num_workers = int(num_workers)
        self.train_transform, self.val_transform, self.mix = train_transform, val_transform, mix
        self.seed = seed
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.shard_window = shard_window
        self.pin_memory = pin_memory
        self.prefetch_factor = int(prefetch_factor)
        self.dataset_options = dataclasses.replace(dataset_options or DatasetOptions(), return_boxes=bool(return_boxes))
        self.train_ds: CachedImageDataset | None = None
        self.val_ds: CachedImageDataset | None = None
        self.train_sampler: DistributedCacheSampler | None = None
        self._moved: dict[int, str] = {}  # id(transform) -> device it was last moved to
        self._no_val()

    def _no_val(self) -> None:
        if self.val_source is None:
            # No val cache: Lightning runs a val loop only when val_dataloader is overridden, so un-override it.
            self.val_dataloader = super().val_dataloader  # type: ignore[method-assign]

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the module: the bound method stays behind
        state = dict(self.__dict__)
        state.pop("val_dataloader", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._no_val()

    # ------------------------------------------------------------------ datasets and loaders
    def setup(self, stage: str | None = None) -> None:
        if self.train_ds is None:
            self.train_ds = _open(self.train_source, self.dataset_options)
        if self.val_ds is None and self.val_source is not None:
            self.val_ds = _open(self.val_source, self.dataset_options)

    @property
    def num_classes(self) -> int:
        self.setup()
        assert self.train_ds is not None
        return len(self.train_ds.classes)

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return int(trainer.world_size), int(trainer.global_rank)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def _loader(self, ds: CachedImageDataset, sampler: CacheSampler, batch_size: int, cls: type) -> DataLoader:
        trainer = self.trainer
        on_cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        return dataloader(ds, batch_size, sampler, num_workers=self.num_workers, seed=sampler.seed, cls=cls,
                          pin_memory=on_cuda if self.pin_memory is None else self.pin_memory,
                          prefetch_factor=self.prefetch_factor)

    def train_dataloader(self) -> ResumableDataLoader:
        self.setup("fit")
        assert self.train_ds is not None
        world, rank = self._ranks()
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = DistributedCacheSampler(self.train_ds, shuffle=self.shuffle, seed=seed, drop_last=self.drop_last,
                                          num_replicas=world, rank=rank, shard_window=self.shard_window)
        if self.trainer is not None:
            sampler.set_epoch(self.trainer.current_epoch)
        self.train_sampler = sampler
        return self._loader(self.train_ds, sampler, self.batch_size, ResumableDataLoader)  # type: ignore[return-value]

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        assert self.val_ds is not None  # val=None un-overrides this method (__init__)
        world, rank = self._ranks()
        sampler = DistributedCacheSampler(self.val_ds, shuffle=False, num_replicas=world, rank=rank)
        return self._loader(self.val_ds, sampler, self.val_batch_size, DataLoader)

    # ------------------------------------------------------------------ batches on the device
    def _on(self, t: Any, device: torch.device) -> Any:
        if hasattr(t, "to") and self._moved.get(id(t)) != str(device):
            t.to(device)
            self._moved[id(t)] = str(device)
        return t

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels, *rest = batch
        if images.ndim == 4 and images.shape[-1] == 3:
            images = images.permute(0, 3, 1, 2)  # NHWC storage seen as NCHW: channels_last, no copy
        trainer = self.trainer
        training = trainer is not None and trainer.training
        if training and self.train_sampler is not None:
            # Counted when the batch reaches the step: a checkpoint saved after it resumes after it.
            self.train_sampler.advance(len(labels))
        transform = self.train_transform if training else self.val_transform
        if transform is not None:
            transform = self._on(transform, images.device)
            boxed = self.dataset_options.return_boxes  # then rest[0] is the boxes; columns follow
            images = transform(images, rest[0]) if boxed else transform(images)
            rest = rest[1:] if boxed else rest  # the boxes are used up; columns stay
        if training and self.mix is not None:
            images, labels = self._on(self.mix, images.device)(images, labels)
        return (images, labels, *rest)
