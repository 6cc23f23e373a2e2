"""A whole run: cache -> sampler -> DataLoader -> device -> transforms -> model, epochs, checkpoints, metrics.

``fit(TrainConfig(...))`` is what ``cachebuild train`` and ``python -m loaders.train`` call; under
``torchrun`` every process calls it and joins the process group from the environment.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cachebuild.atomic import is_temporary_name, temporary_writer, write_bytes_atomic
from cachebuild.errors import CacheBuildError, OptionError
from cachebuild.options import (
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_optional_bool,
    parse_path,
)
from loaders.batch_ring import drop_dead_rings
from loaders.train.amp import AMP_CHOICES, make_scaler, resolve_amp
from loaders.train.checkpoint import (
    CheckpointError,
    capture_rng,
    load_checkpoint,
    restore_model,
    restore_rng,
    save_checkpoint,
)
from loaders.train.distributed import (
    DistInfo,
    all_gather_objects,
    all_reduce_sum,
    cleanup_distributed,
    init_distributed,
)
from loaders.train.loop import StepInfo, evaluate, num_optimizer_steps, train_one_epoch
from loaders.train.metrics import MetricsWriter, drop_records_after, plot_metrics
from loaders.train.models import build_model

__all__ = [
    "AUGMENTS",
    "IN_MEMORY",
    "LOADERS",
    "OPTIMIZERS",
    "RUN_FILES",
    "STOP_EXIT_CODE",
    "TrainConfig",
    "TrainSetupError",
    "WarmupCosine",
    "build_optimizer",
    "build_scheduler",
    "fit",
    "transforms_for",
]

AUGMENTS: tuple[str, ...] = ("auto", "imagenet", "cifar", "none")
IN_MEMORY: tuple[str, ...] = ("auto", "yes", "no")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
LOADERS: tuple[str, ...] = ("auto", "dataloader", "threads")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
STOP_EXIT_CODE = 75  # --stop-after-steps: a hard exit (os._exit) that tests treat as a crash
CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"
# Every file a run writes into --out; --overwrite removes these (and their temporaries), nothing else.
RUN_FILES: tuple[str, ...] = (CHECKPOINT_NAME, METRICS_NAME, "metrics.png", "config.json", "summary.json")
# Settings a resume must keep: the optimizer and LR schedule are restored from the checkpoint, so a
# changed value would be ignored silently (more --epochs would train at the old schedule's final LR, 0).
SCHEDULE_KEYS: tuple[str, ...] = ("epochs", "warmup_epochs", "lr", "optimizer", "momentum", "weight_decay")


class TrainSetupError(CacheBuildError, ValueError):
    """A run that cannot start: mismatched caches, impossible sizes, a missing checkpoint to resume."""


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run; written to ``OUT/config.json`` (with the resolved values) at the start.

    Frozen and checked when made: a value that cannot work raises :class:`~cachebuild.errors.OptionError`
    naming the field, before any cache is opened.
    """

    train: str
    out: str
    val: str | None = None
    model: str = "small_cnn"
    epochs: int = 1
    batch_size: int = 64  # per process, per micro-batch
    accum: int = 1
    amp: str = "auto"
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-5
    warmup_epochs: float = 0.0
    label_smoothing: float = 0.0
    clip_grad: float | None = None
    augment: str = "auto"
    crop: int | None = None  # training/eval resolution; default: the cache's image size
    workers: int = 2  # DataLoader worker processes, or FastLoader threads
    loader: str = "auto"  # dataloader | threads | auto (threads on CPU, DataLoader workers on CUDA)
    in_memory: str = "auto"
    device: str = "auto"
    seed: int = 0
    compile: bool = False
    deterministic: bool = False
    log_every: int = 20  # optimizer steps
    ckpt_every: int = 0  # optimizer steps; 0: at the end of each epoch only
    resume: bool = False
    overwrite: bool = False  # a fresh run into an --out holding a run: remove that run's files first
    progress: bool | None = None  # None: when stderr is a terminal
    stop_after_steps: int | None = None  # testing: hard exit after this many optimizer steps

    def __post_init__(self) -> None:
        from loaders.train.models import is_known_model

        parse_path("train", self.train)
        parse_path("out", self.out)
        parse_path("val", self.val, optional=True)
        if not isinstance(self.model, str) or not is_known_model(self.model):
            raise OptionError(f"model {self.model!r} is not known: small_cnn, tiny_cnn, linear or a torchvision "
                              f"classifier name")
        parse_int("epochs", self.epochs, 1)
        parse_int("batch_size", self.batch_size, 1)
        parse_int("accum", self.accum, 1)
        parse_choice("amp", self.amp, AMP_CHOICES)
        parse_float("lr", self.lr, 0, min_open=True)
        parse_choice("optimizer", self.optimizer, OPTIMIZERS)
        parse_float("momentum", self.momentum, 0, 1)
        parse_float("weight_decay", self.weight_decay, 0)
        parse_float("warmup_epochs", self.warmup_epochs, 0)
        parse_float("label_smoothing", self.label_smoothing, 0, 1, max_open=True)
        parse_float("clip_grad", self.clip_grad, 0, min_open=True, optional=True)
        parse_choice("augment", self.augment, AUGMENTS)
        parse_int("crop", self.crop, 8, optional=True)
        parse_int("workers", self.workers, 0)
        parse_choice("loader", self.loader, LOADERS)
        parse_choice("in_memory", self.in_memory, IN_MEMORY)
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise OptionError(f"device must be cpu, cuda, cuda:N or auto; got {self.device!r}")
        parse_int("seed", self.seed)
        for name in ("compile", "deterministic", "resume", "overwrite"):
            parse_bool(name, getattr(self, name))
        if self.resume and self.overwrite:
            raise OptionError("resume and overwrite exclude each other: --resume continues the run in --out, "
                              "--overwrite starts it over")
        parse_int("log_every", self.log_every, 0)
        parse_int("ckpt_every", self.ckpt_every, 0)
        parse_optional_bool("progress", self.progress)
        parse_int("stop_after_steps", self.stop_after_steps, 1, optional=True)

    def check(self) -> None:
        """Kept for callers of earlier releases: every value is checked when the config is made."""


@dataclass
class _Data:
    train_ds: Any
    classes: list[str]
    shape: tuple[int, int, int]
    sampler: Any
    loader: Any
    val_ds: Any | None
    val_loader: Any | None
    train_tf: Callable[[torch.Tensor], torch.Tensor]
    eval_tf: Callable[[torch.Tensor], torch.Tensor]
    augment: str
    crop: int
    loader_kind: str
    notes: list[str] = dataclasses.field(default_factory=list)  # said once at the start of the run


class WarmupCosine:
    """Linear warm-up from ~0 to 1 over ``warmup`` steps, then a cosine to 0 at ``total`` steps.

    A class rather than a lambda so that ``LambdaLR.state_dict()`` stores its fields (plain ints) and a
    checkpoint stays loadable with ``weights_only=True``.
    """

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup = int(warmup)
        self.total = max(int(total), 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = (step - self.warmup) / max(self.total - self.warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (momentum) or AdamW; no weight decay on biases and norm scales (1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def build_scheduler(optimizer: torch.optim.Optimizer, steps_per_epoch: int, cfg: TrainConfig) -> Any:
    """Per-optimizer-step schedule: ``warmup_epochs`` of linear warm-up, then cosine decay to 0."""
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, cfg.epochs * steps_per_epoch))


# --------------------------------------------------------------------------------------------------
# Data


def transforms_for(augment: str, crop: int) -> tuple[Any, Any]:
    """(train, eval) device transforms of a preset: uint8 NCHW batch -> normalised float channels_last."""
    from loaders import transforms as T

    if augment == "cifar":
        return T.cifar_train(), T.cifar_eval()
    ev = T.imagenet_eval(crop)
    if augment == "none":  # deterministic: the eval pipeline for training too (tests, debugging)
        return ev, ev
    return T.imagenet_train(crop), ev


def _build_data(cfg: TrainConfig, info: DistInfo) -> _Data:
    from torch.utils.data import DataLoader

    from loaders.dataset import CachedImageDataset, collate_batch
    from loaders.device import FastLoader
    from loaders.sampler import CacheSampler

    in_memory: bool | str = {"yes": True, "no": False}.get(cfg.in_memory, cfg.in_memory)
    train_ds = CachedImageDataset(cfg.train, in_memory=in_memory)
    # A letterboxed (--fit pad) cache: batches carry each sample's valid box, so crops stay off the bars.
    train_ds.return_boxes = "boxes" in train_ds.manifest.arrays
    classes = list(train_ds.classes)
    h, w, c = (int(s) for s in train_ds.shape)
    shape = (h, w, c)
    if len(train_ds) == 0:
        raise TrainSetupError(f"{cfg.train}: the cache holds no samples")
    val_ds = None
    if cfg.val is not None:
        val_ds = CachedImageDataset(cfg.val, in_memory=in_memory)
        if list(val_ds.classes) != classes:
            only_t = sorted(set(classes) - set(val_ds.classes))[:3]
            only_v = sorted(set(val_ds.classes) - set(classes))[:3]
            raise TrainSetupError(
                f"val cache {cfg.val} has {len(val_ds.classes)} classes, train has {len(classes)}; "
                f"they must be the same list in the same order (only in train: {only_t}, only in val: {only_v})"
            )
    side = min(shape[0], shape[1])
    augment = cfg.augment if cfg.augment != "auto" else ("cifar" if shape[:2] == (32, 32) else "imagenet")
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
    train_tf, eval_tf = transforms_for(augment, crop)
    if hasattr(train_tf, "to"):
        train_tf = train_tf.to(info.device)
        eval_tf = eval_tf.to(info.device)

    pin = info.device.type == "cuda"
    kind = cfg.loader if cfg.loader != "auto" else ("threads" if info.device.type == "cpu" else "dataloader")
    sampler = CacheSampler(train_ds, shuffle=True, seed=cfg.seed, num_replicas=info.world_size,
                           rank=info.rank, drop_last=False)
    # Evaluation shards without padding (each sample counted once when the counts are summed).
    val_idx = list(range(info.rank, len(val_ds), info.world_size)) if val_ds is not None else []

    def make(ds: Any, order: Any) -> Any:
        if kind == "threads":
            # On CPU, worker processes compete with the model for the same cores; gather threads
            # release the GIL in their copies and leave the cores to the step.
            return FastLoader(ds, cfg.batch_size, sampler=order, num_threads=max(1, cfg.workers),
                              pin_memory=pin)
        kw: dict[str, Any] = {"num_workers": cfg.workers, "pin_memory": pin, "collate_fn": collate_batch}
        if cfg.workers > 0:
            prefetch = 4
            kw.update(persistent_workers=True, prefetch_factor=prefetch)
            ds.ring_slots = prefetch + 3  # batch-ring slots per worker to match (CachedImageDataset)
        # Its own generator: the DataLoader then never draws from the global RNG, which a resume restores.
        return DataLoader(ds, batch_size=cfg.batch_size, sampler=order,
                          generator=torch.Generator().manual_seed(cfg.seed), **kw)

    return _Data(train_ds, classes, shape, sampler, make(train_ds, sampler), val_ds,
                 make(val_ds, val_idx) if val_ds is not None else None, train_tf, eval_tf, augment, crop, kind,
                 notes)


def _on_device(loader: Any, device: torch.device) -> Any:
    from loaders.device import device_loader

    return device_loader(loader, device)


# --------------------------------------------------------------------------------------------------
# The run


def fit(cfg: TrainConfig, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the summary that rank 0 prints (also on other ranks).

    Raises :class:`TrainSetupError`, :class:`~loaders.train.checkpoint.CheckpointError`,
    :class:`~loaders.train.amp.AmpUnsupportedError` or a cache error before the first step when the
    inputs do not fit together.
    """
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    info = init_distributed(cfg.device)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return _fit(cfg, info, echo or _default_echo)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)  # fit() may run inside a larger program
        cleanup_distributed()
        # The DataLoader's workers are shut down once it is collected; then unmap their batch rings,
        # which the main process would otherwise keep until another DataLoader's workers register.
        gc.collect()
        drop_dead_rings()


def _default_echo(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)


def _fit(cfg: TrainConfig, info: DistInfo, echo: Callable[[str], None]) -> dict[str, Any]:
    main = info.is_main
    say = echo if main else (lambda _msg: None)
    amp_dtype = resolve_amp(cfg.amp, info.device)
    out = Path(cfg.out)
    stale: list[Path] = []  # --overwrite: the previous run's files, removed just before the first write
    if not cfg.resume:
        # Rank 0's view decides for every rank, so that all ranks refuse together (none waits in a collective).
        names: list[str] = all_gather_objects([f.name for f in _run_files(out)] if main else None)[0]
        held = [n for n in names if n in RUN_FILES]
        if held and not cfg.overwrite:
            raise TrainSetupError(
                f"{out} already holds a run ({', '.join(held)}): pass --resume to continue it, another --out "
                f"for a new run, or --overwrite to start over (removes only those files)"
            )
        stale = [out / n for n in names] if main and cfg.overwrite else []
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif info.device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    data = _build_data(cfg, info)
    ckpt_path = out / CHECKPOINT_NAME
    data.sampler.set_epoch(0)
    num_batches = math.ceil(data.sampler.num_samples / cfg.batch_size)  # the whole epoch, not what is left
    steps_per_epoch = num_optimizer_steps(num_batches, cfg.accum)
    layout = {"batch_size": cfg.batch_size, "accum": cfg.accum, "world_size": info.world_size,
              "train_count": len(data.train_ds)}
    schedule = {k: getattr(cfg, k) for k in SCHEDULE_KEYS}

    state = None
    if cfg.resume:
        if not ckpt_path.is_file():
            raise TrainSetupError(f"--resume: no checkpoint at {ckpt_path}")
        state = load_checkpoint(ckpt_path, model_name=cfg.model, num_classes=len(data.classes), layout=layout)
        saved = state.get("layout", {})
        diff = [f"{k}: checkpoint {saved[k]!r} vs now {v!r}" for k, v in schedule.items()
                if k in saved and saved[k] != v]  # checkpoints of earlier releases do not hold them
        if diff:
            raise CheckpointError(
                f"{ckpt_path}: cannot resume with another optimizer or LR schedule ({', '.join(diff)}); the "
                f"checkpoint's would be used: pass its values, or start over (another --out, or --overwrite)"
            )

    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model = build_model(cfg.model, len(data.classes), image_size=data.crop).to(info.device)
    optimizer = build_optimizer(raw_model, cfg)
    scheduler = build_scheduler(optimizer, steps_per_epoch, cfg)
    scaler = make_scaler(amp_dtype, info.device)
    torch.manual_seed(cfg.seed + 1_000_003 * info.rank)  # augmentation draws differ between ranks

    start_epoch, start_batch, global_step = 0, 0, 0
    if state is not None:
        restore_model(raw_model, state, ckpt_path)
        try:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None and state["scaler"] is not None:
                scaler.load_state_dict(state["scaler"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{ckpt_path}: optimizer/scheduler state does not fit this run: {e}") from e
        start_epoch, start_batch, global_step = state["epoch"], state["batch"], state["global_step"]
        if info.device.type == "cuda":
            torch.cuda.init()
        restore_rng(state["rng"][info.rank])  # the layout check made sure the world size is the same
        if main:  # what was logged after the checkpoint is trained (and logged) again: drop it
            drop_records_after(out / METRICS_NAME, global_step)
            _remove_dead_temporaries(out)

    eval_model: nn.Module = torch.compile(raw_model) if cfg.compile else raw_model  # type: ignore[assignment]
    model = eval_model
    if info.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            eval_model, device_ids=[info.device.index] if info.device.type == "cuda" else None
        )
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    for f in stale:
        f.unlink(missing_ok=True)
    metrics = MetricsWriter(out / METRICS_NAME, enabled=main)
    progress = cfg.progress if cfg.progress is not None else (main and sys.stderr.isatty())
    n_params = sum(p.numel() for p in raw_model.parameters())
    resolved = {
        **dataclasses.asdict(cfg),
        "resolved": {
            "device": str(info.device), "world_size": info.world_size,
            "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else "off",
            "num_classes": len(data.classes), "image_shape": list(data.shape), "augment": data.augment,
            "crop": data.crop, "loader": data.loader_kind, "train_count": len(data.train_ds),
            "val_count": len(data.val_ds) if data.val_ds is not None else 0,
            "batches_per_epoch": num_batches, "steps_per_epoch": steps_per_epoch,
            "global_batch": cfg.batch_size * cfg.accum * info.world_size, "params": n_params,
        },
    }
    if main:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.json", resolved)
    r = resolved["resolved"]
    say(f"train {cfg.train}: {r['train_count']} images {data.shape[0]}x{data.shape[1]}, "
        f"{r['num_classes']} classes; val {cfg.val or '-'} ({r['val_count']} images)")
    say(f"model {cfg.model} ({n_params / 1e6:.2f} M params) on {info.device} x {info.world_size} process(es), "
        f"amp {r['amp_dtype']}, batch {cfg.batch_size} x accum {cfg.accum} x {info.world_size} = "
        f"{r['global_batch']}, {steps_per_epoch} steps/epoch, augment {data.augment} @ {data.crop}px, "
        f"loader {data.loader_kind} x {cfg.workers}")
    for note in data.notes:
        say(note)
    if state is not None:
        say(f"resumed from {ckpt_path}: epoch {start_epoch + 1}, micro-batch {start_batch}/{num_batches}, "
            f"step {global_step}")

    def checkpoint(epoch: int, batch: int, step: int) -> None:
        rng = all_gather_objects(capture_rng())  # a collective: every rank calls this at the same step
        if not main:
            return
        sampler_state = dict(data.sampler.state_dict()) if hasattr(data.sampler, "state_dict") else {}
        sampler_state.update(epoch=epoch, position=batch * cfg.batch_size)
        save_checkpoint(ckpt_path, model=model, optimizer=optimizer, model_name=cfg.model,
                        num_classes=len(data.classes), epoch=epoch, batch=batch, global_step=step,
                        scaler=scaler, scheduler=scheduler, sampler=_plain(sampler_state),
                        layout={**layout, **schedule}, rng=rng)

    last: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    for epoch in range(start_epoch, cfg.epochs):
        first = epoch == start_epoch
        skip = start_batch if first else 0
        data.sampler.set_epoch(epoch)
        if skip and hasattr(data.sampler, "load_state_dict"):
            st = dict(data.sampler.state_dict())
            st.update(epoch=epoch, position=skip * cfg.batch_size)
            data.sampler.load_state_dict(st)
        steps_before = global_step - math.ceil(skip / cfg.accum)

        def on_log(entry: dict[str, float], epoch: int = epoch, steps_before: int = steps_before) -> None:
            entry = {"epoch": epoch, "global_step": steps_before + int(entry["step"]), **entry}
            metrics.write("train", **entry)
            say(f"epoch {epoch + 1}/{cfg.epochs} step {int(entry['step'])}/{steps_per_epoch}  "
                f"loss {entry['loss']:.4f}  lr {entry['lr']:.4g}  {entry['img_per_s']:.0f} img/s  "
                f"data wait {entry['data_wait']:.1%}")

        def on_step(s: StepInfo, epoch: int = epoch, steps_before: int = steps_before) -> None:
            step = steps_before + s.step
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and s.batch < s.num_batches:
                checkpoint(epoch, s.batch, step)
            if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(STOP_EXIT_CODE)  # a crash, not a shutdown: nothing else gets written

        res = train_one_epoch(
            model, _on_device(data.loader, info.device), optimizer,
            loss_fn=loss_fn, transform=data.train_tf, accum=cfg.accum, num_batches=num_batches,
            start_batch=skip, num_samples=data.sampler.num_samples, scheduler=scheduler, scaler=scaler,
            amp_dtype=amp_dtype, device=info.device, clip_grad=cfg.clip_grad, log_every=cfg.log_every, on_log=on_log,
            on_step=on_step, progress=progress, desc=f"epoch {epoch + 1}/{cfg.epochs}",
        )
        global_step = steps_before + steps_per_epoch
        share = torch.tensor([res.data_wait, res.seconds], dtype=torch.float64, device=info.device)
        all_reduce_sum(share)
        wait_share = float(share[0] / share[1]) if share[1] > 0 else 0.0
        val = {}
        if data.val_loader is not None:
            # Not through DDP: ranks hold unequal val shards, and DDP's forward may sync buffers.
            val = evaluate(eval_model, _on_device(data.val_loader, info.device), transform=data.eval_tf,
                           amp_dtype=amp_dtype, device=info.device, progress=progress)
        last = {
            "epoch": epoch, "global_step": global_step, "train_loss": res.loss, "img_per_s": res.img_per_s,
            "data_wait": wait_share, "seconds": res.seconds, "skipped_steps": res.skipped_steps,
            **{f"val_{k}": v for k, v in val.items()},
        }
        history.append(last)
        metrics.write("epoch", **last)
        msg = (f"epoch {epoch + 1}/{cfg.epochs} done in {res.seconds:.1f}s: train loss {res.loss:.4f}, "
               f"{res.img_per_s:.0f} img/s, data wait {wait_share:.1%}")
        if val:
            msg += f"; val loss {val['loss']:.4f} top-1 {val['top1']:.1%} top-5 {val['top5']:.1%}"
        say(msg)
        checkpoint(epoch + 1, 0, global_step)
        start_batch = 0

    summary = {
        "cache": cfg.train, "val": cfg.val, "out": str(out), "model": cfg.model, "device": str(info.device),
        "world_size": info.world_size, "epochs_run": len(history), **last,
        "mean_img_per_s": _mean([h["img_per_s"] for h in history]),
        "mean_data_wait": _mean([h["data_wait"] for h in history]),
    }
    if main:
        png = None
        if (out / METRICS_NAME).is_file():
            png = plot_metrics(out / METRICS_NAME, out / "metrics.png")
        _write_json(out / "summary.json", summary)
        say("")
        say(f"cache       {cfg.train}" + (f"  (val {cfg.val})" if cfg.val else ""))
        if history:
            say(f"throughput  {summary['img_per_s']:.0f} img/s last epoch "
                f"({summary['mean_img_per_s']:.0f} mean), {info.world_size} process(es) on {info.device}")
            say(f"data wait   {summary['data_wait']:.1%} of step time last epoch "
                f"({summary['mean_data_wait']:.1%} mean)")
            if "val_top1" in summary:
                say(f"accuracy    val top-1 {summary['val_top1']:.1%}  top-5 {summary['val_top5']:.1%}  "
                    f"(loss {summary['val_loss']:.4f}, epoch {summary['epoch'] + 1})")
            else:
                say(f"loss        train {summary['train_loss']:.4f} (no --val cache given)")
        else:
            say("nothing to do: the checkpoint is already past the last epoch")
        say(f"run         {out}: {CHECKPOINT_NAME}, metrics.jsonl, {png.name if png else '-'}, config.json")
    return summary


def _run_files(out: Path) -> list[Path]:
    """The files of a run in ``out``: :data:`RUN_FILES` and temporaries that a killed write of one left."""
    if not out.is_dir():
        return []
    return [f for f in sorted(out.iterdir()) if f.is_file() and (
        f.name in RUN_FILES
        or (is_temporary_name(f.name) and any(f.name.startswith(f".{name}.") for name in RUN_FILES)))]


def _remove_dead_temporaries(out: Path) -> None:
    """Temporaries of the run's files whose writer died (a kill during a checkpoint write leaves a
    checkpoint-sized one each time): removed on resume, so repeated kills do not fill the disk. The name
    carries the writer's pid (``cachebuild.atomic``); a live writer's file is left alone."""
    from cachebuild.processes import pid_alive

    for f in _run_files(out):
        writer = temporary_writer(f.name)
        if writer is not None and not pid_alive(writer):
            f.unlink(missing_ok=True)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """Sampler state as plain Python numbers (``weights_only`` loading refuses numpy scalars)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "item") and not isinstance(v, torch.Tensor):
            v = v.item()
        out[k] = v
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, default=str) + "\n").encode("utf-8"), durable=False)
