"""The data side of a run: the caches opened and checked against each other, the sampler, the DataLoaders
and the device transforms of the augmentation preset."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from cachebuild.errors import CacheBuildError
from loaders.train.config import TrainConfig, TrainSetupError
from loaders.train.distributed import DistInfo
from loaders.train.loop.step import BatchTransform

__all__ = ["TrainData", "build_data", "crop_in_workers", "make_loader", "mixing", "on_device", "transforms_for"]


@dataclass
class TrainData:
    train_ds: Any
    classes: list[str]
    shape: tuple[int, int, int]
    sampler: Any
    loader: Any
    val_ds: Any | None
    val_loader: Any | None
    train_tf: Callable[..., torch.Tensor]
    eval_tf: Callable[..., torch.Tensor]
    augment: str
    crop: int
    notes: list[str] = dataclasses.field(default_factory=list)  # said once at the start of the run
    # A batch-level mix after train_tf ((x, labels) -> (x, soft targets): MixUp, CutMix); None: none.
    batch_tf: BatchTransform | None = None


def transforms_for(augment: str, crop: int) -> tuple[Any, Any]:
    """(train, eval) device transforms of a preset: uint8 NCHW batch -> normalised float channels_last; ``none``
    trains with the eval pipeline (deterministic: tests, debugging)."""
    from loaders.transforms import presets

    evaluation = presets.by_name("cifar-eval" if augment == "cifar" else "imagenet-eval", crop)
    return (evaluation if augment == "none" else presets.by_name(augment, crop)), evaluation


def crop_in_workers(cfg: TrainConfig, augment: str, crop: int, train_ds: Any, val_ds: Any | None,
                    normalize: bool = False) -> tuple[Any, Any]:
    """``--augment-in workers``: the preset's crops set on the datasets (loaders.worker_crop), and the device
    transforms that are left (normalize only; none with ``normalize``, a CPU run, where the workers normalize
    too and the main process only trains). Batches then hold only valid pixels: no boxes travel."""
    from loaders import transforms as T

    fused = (T.IMAGENET_MEAN, T.IMAGENET_STD) if normalize else None
    if augment == "cifar":
        raise TrainSetupError("--augment-in workers runs the imagenet (RandomResizedCrop) and none presets; "
                              "cifar's padded crop runs on the device: use --augment-in device")
    evaluation = T.Compose([T.Resize(round(crop / 0.875)), T.CenterCrop(crop)])  # imagenet_eval's crop
    train_crop = evaluation if augment == "none" else T.RandomResizedCrop(crop, flip_p=0.5)
    train_ds.set_crop(train_crop, cfg.seed, fused)
    train_ds.return_boxes = False
    if val_ds is not None:
        val_ds.set_crop(evaluation, normalize=fused)
        val_ds.return_boxes = False
    norm = torch.nn.Identity() if normalize else T.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD)
    return norm, norm


def _open_caches(cfg: TrainConfig) -> tuple[Any, Any | None]:
    """The train cache and the val cache (if any), refused when empty or when their classes differ."""
    from loaders.dataset import DatasetOptions

    in_memory: bool | Literal["auto"] = "auto" if cfg.in_memory == "auto" else cfg.in_memory == "yes"
    options = DatasetOptions(in_memory=in_memory)
    train_ds = _open_labelled(cfg.cache, dataclasses.replace(options, labels=cfg.labels))
    # A letterboxed (--fit pad) cache: batches carry each sample's valid box, so crops stay off the bars.
    train_ds.return_boxes = "boxes" in train_ds.manifest.arrays
    classes = list(train_ds.classes)
    if len(train_ds) == 0:
        raise TrainSetupError(f"{cfg.train}: the cache holds no samples")
    val_ds = None
    if cfg.val is not None:
        from cachebuild.storage.cache import read_manifest

        relabelled = cfg.labels is not None and cfg.labels in read_manifest(cfg.val).columns
        val_ds = _open_labelled(cfg.val, dataclasses.replace(options, labels=cfg.labels if relabelled else None))
        if list(val_ds.classes) != classes:
            only_t = sorted(set(classes) - set(val_ds.classes))[:3]
            only_v = sorted(set(val_ds.classes) - set(classes))[:3]
            raise TrainSetupError(
                f"val cache {cfg.val} has {len(val_ds.classes)} classes, train has {len(classes)}; "
                f"they must be the same list in the same order (only in train: {only_t}, only in val: {only_v})"
            )
    return train_ds, val_ds


def _open_labelled(cache: str, options: Any) -> Any:
    """The dataset of ``cache``; a column that cannot be labels (the dataset's ValueError) as one line naming
    ``--labels``."""
    from loaders.dataset import CachedImageDataset

    try:
        return CachedImageDataset(cache, options)
    except ValueError as e:
        if options.labels is None or isinstance(e, CacheBuildError):
            raise
        why = str(e).removeprefix(f"{cache}: ")
        raise TrainSetupError(f"--labels {options.labels}: {why} ({cache})") from None


def _resolution(cfg: TrainConfig, shape: tuple[int, int, int], val_ds: Any | None) -> tuple[str, int, list[str]]:
    """(augment preset, crop, notes): ``auto`` resolved for the cache's size, a val cache of another size
    checked (refused under cifar, whose eval does not resize)."""
    side = min(shape[0], shape[1])
    from loaders.transforms.presets import resolve

    augment = resolve(cfg.augment, shape)
    crop = cfg.crop or side
    if augment == "cifar" and (shape[:2] != (32, 32) or crop != 32):
        raise TrainSetupError(f"--augment cifar needs a 32x32 cache and crop, got {shape[0]}x{shape[1]}, crop {crop}")
    notes = []
    if val_ds is not None and tuple(int(v) for v in val_ds.shape) != shape:
        vh, vw = int(val_ds.shape[0]), int(val_ds.shape[1])
        if augment == "cifar":  # cifar_eval only normalises: the model would see another resolution
            raise TrainSetupError(
                f"val cache {cfg.val} holds {vh}x{vw} images, train {shape[0]}x{shape[1]}; --augment cifar "
                f"evaluates without resizing: build the val cache at --size {shape[0]}"
            )
        notes.append(f"val cache {cfg.val} is {vh}x{vw}, train {shape[0]}x{shape[1]}: val images are resized to "
                     f"{round(crop / 0.875)} (short side) and centre-cropped to {crop}, the training crop")
    return augment, crop, notes


def build_data(cfg: TrainConfig, info: DistInfo) -> TrainData:
    """Open the caches and make the sampler, loaders and device transforms of the run."""
    from loaders.sampler import CacheSampler
    from loaders.worker_crop import progressive

    train_ds, val_ds = _open_caches(cfg)
    h, w, c = (int(s) for s in train_ds.shape)
    shape = (h, w, c)
    augment, crop, notes = _resolution(cfg, shape, val_ds)
    if cfg.augment_in == "workers":
        # on a CPU the workers normalize too (float32 batches); on a GPU uint8 travels, 4x fewer bytes
        train_tf, eval_tf = crop_in_workers(cfg, augment, crop, train_ds, val_ds, info.device.type == "cpu")
    else:
        train_tf, eval_tf = transforms_for(augment, crop)
    ramp = cfg.progressive_schedule()
    if ramp is not None:
        train_ds.set_resolution(progressive(*ramp, step=8))  # applied at each set_epoch
        notes.append(f"progressive resizing: {ramp[0]} px until epoch {ramp[2]}, {ramp[1]} px from epoch {ramp[3]}")
    if hasattr(train_tf, "to"):
        train_tf = train_tf.to(info.device)
        eval_tf = eval_tf.to(info.device)

    # set_epoch also sets the crop epoch (and the schedule's size) of a dataset that crops in the workers
    sampler = CacheSampler(train_ds, shuffle=True, seed=cfg.seed, num_replicas=info.world_size, rank=info.rank,
                           drop_last=False, shard_window=cfg.shard_window)
    # Evaluation shards without padding (each sample counted once when the counts are summed).
    val_idx = list(range(info.rank, len(val_ds), info.world_size)) if val_ds is not None else []
    pin = info.device.type == "cuda"
    return TrainData(train_ds, list(train_ds.classes), shape, sampler, make_loader(train_ds, sampler, cfg, pin),
                     val_ds, make_loader(val_ds, val_idx, cfg, pin) if val_ds is not None else None,
                     train_tf, eval_tf, augment, crop, notes, mixing(cfg, len(train_ds.classes)))


def mixing(cfg: TrainConfig, num_classes: int) -> BatchTransform | None:
    """The run's MixUp / CutMix (None when both alphas are 0). It draws from torch's global RNG, as the device
    transforms do: the run seeds it per rank and a resume restores it. The label smoothing is applied to the
    mixed targets here, so the loss must not smooth them again (``run`` gives it 0 then)."""
    if cfg.mixup == 0 and cfg.cutmix == 0:
        return None
    from loaders.transforms import MixUpCutMix

    return MixUpCutMix(num_classes, mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix,
                       label_smoothing=cfg.label_smoothing)


def make_loader(ds: Any, order: Any, cfg: TrainConfig, pin: bool) -> Any:
    """A DataLoader of ``ds`` in ``order`` with ``cfg.workers`` worker processes (0: in this process)."""
    from loaders.collate import dataloader

    return dataloader(ds, cfg.batch_size, order, num_workers=cfg.workers, pin_memory=pin, seed=cfg.seed)


def on_device(loader: Any, device: torch.device) -> Any:
    from loaders.device import device_loader

    return device_loader(loader, device)
