"""A whole run: cache -> sampler -> loader -> device -> transforms -> model; its epochs, checkpoints, metrics
and what it says and writes about itself (``config.json``, ``summary.json``, ``metrics.png``).

``fit(TrainConfig(...))`` is what ``cachebuild train`` and ``python -m loaders.train`` call; under ``torchrun``
every process calls it and joins the process group from the environment.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loaders.batch_ring import drop_dead_rings
from loaders.train.checkpoints import (
    CHECKPOINT_NAME,
    METRICS_NAME,
    RUN_FILES,
    Checkpointer,
    Position,
    check_resume,
    claim_run_folder,
    read_checkpoint,
    restore_run,
    resumed_config,
    run_layout,
    write_json,
)
from loaders.train.config import AUGMENTS, IN_MEMORY, OPTIMIZERS, TrainConfig, TrainSetupError
from loaders.train.data import TrainData, build_data, on_device, transforms_for
from loaders.train.distributed import DistInfo, all_reduce_sum, cleanup_distributed, init_distributed
from loaders.train.loop.amp import make_scaler, resolve_amp
from loaders.train.loop.optim import WarmupCosine, build_optimizer, build_scheduler
from loaders.train.loop.step import EpochConfig, EpochResult, StepInfo, evaluate, num_optimizer_steps, train_one_epoch
from loaders.train.metrics import MetricsWriter, PlotsUnavailableError, plot_metrics
from loaders.train.models import build_model

__all__ = ["AUGMENTS", "IN_MEMORY", "METRICS_NAME", "OPTIMIZERS", "RUN_FILES", "STOP_EXIT_CODE", "EpochLoop",
           "TrainConfig", "TrainSetupError", "WarmupCosine", "build_optimizer", "build_scheduler", "fit",
           "transforms_for"]

STOP_EXIT_CODE = 75  # --stop-after-steps: a hard exit (os._exit) that tests treat as a crash
Say = Callable[[str], None]

def fit(cfg: TrainConfig, echo: Callable[[str], None] | None = None,
        given: Collection[str] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the summary that rank 0 prints (also on other ranks). With ``cfg.resume``
    the options not in ``given`` are the run's (:func:`~loaders.train.checkpoints.resumed_config`: ``given``
    None is every option when ``cfg`` names its cache, else those that differ from their defaults).

    Raises :class:`TrainSetupError`, :class:`~loaders.train.checkpoints.CheckpointError`,
    :class:`~loaders.train.loop.amp.AmpUnsupportedError` or a cache error before the first step when the
    inputs do not fit together.
    """
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    info = init_distributed(cfg.device)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return _fit(cfg, info, echo or _echo, given)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)  # fit() may run inside a larger program
        cleanup_distributed()
        # The DataLoader's workers are shut down once it is collected; then unmap their batch rings,
        # which the main process would otherwise keep until another DataLoader's workers register.
        gc.collect()
        drop_dead_rings()


def _fit(cfg: TrainConfig, info: DistInfo, echo: Callable[[str], None],
         given: Collection[str] | None) -> dict[str, Any]:
    main = info.is_main
    say = echo if main else (lambda _msg: None)
    out = Path(cfg.out)
    ckpt_path = out / CHECKPOINT_NAME
    state = read_checkpoint(ckpt_path) if cfg.resume else None
    if state is not None:
        cfg = resumed_config(cfg, state, ckpt_path, given)  # the run's options, none of them changed
    amp_dtype = resolve_amp(cfg.amp, info.device)
    stale = claim_run_folder(out, cfg, main)  # --overwrite: removed just before the first write
    _set_determinism(cfg, info)

    data = build_data(cfg, info)
    data.sampler.set_epoch(0)
    num_batches = math.ceil(data.sampler.num_samples / cfg.batch_size)  # the whole epoch, not what is left
    steps_per_epoch = num_optimizer_steps(num_batches, cfg.accum)
    layout = run_layout(cfg, info, len(data.train_ds))
    cache_key = data.train_ds.manifest.build_key
    if state is not None:
        check_resume(state, ckpt_path, cfg, len(data.classes), layout, cache_key)

    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model = build_model(cfg.model, len(data.classes), image_size=data.crop).to(info.device)
    optimizer = build_optimizer(raw_model, cfg)
    scheduler = build_scheduler(optimizer, steps_per_epoch, cfg)
    scaler = make_scaler(amp_dtype, info.device)
    torch.manual_seed(cfg.seed + 1_000_003 * info.rank)  # augmentation draws differ between ranks
    start = Position()
    if state is not None:
        start = restore_run(state, ckpt_path, raw_model, optimizer, scheduler, scaler, info)

    eval_model: nn.Module = torch.compile(raw_model) if cfg.compile else raw_model  # type: ignore[assignment]
    model = eval_model
    if info.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            eval_model, device_ids=[info.device.index] if info.device.type == "cuda" else None
        )
    loss_fn = loss_function(cfg, data)
    for f in stale:
        f.unlink(missing_ok=True)
    metrics = MetricsWriter(out / METRICS_NAME, enabled=main)
    progress = cfg.progress if cfg.progress is not None else (main and sys.stderr.isatty())
    n_params = sum(p.numel() for p in raw_model.parameters())
    resolved = resolved_config(cfg, info, data, amp_dtype, num_batches, steps_per_epoch, n_params)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", resolved)
    say_start(say, cfg, info, data, resolved, start if state is not None else None)

    checkpoint = Checkpointer(ckpt_path, cfg, main, model, optimizer, scheduler, scaler, data.sampler,
                              len(data.classes), layout, cache_key)
    loop = EpochLoop(cfg, info, data, model, eval_model, optimizer, scheduler, scaler, loss_fn, amp_dtype,
                     metrics, say, progress, checkpoint, num_batches, steps_per_epoch)
    summary = summarize(cfg, info, loop.run(start))
    if main:
        write_summary(say, cfg, info, summary)
    return summary


def loss_function(cfg: TrainConfig, data: TrainData) -> nn.CrossEntropyLoss:
    """Cross-entropy with the run's label smoothing, taking soft (N, C) targets too; a mixed batch's targets
    are already smoothed by the mix (``data.mixing``), so then the loss smooths nothing."""
    return nn.CrossEntropyLoss(label_smoothing=0.0 if data.batch_tf is not None else cfg.label_smoothing)


def _set_determinism(cfg: TrainConfig, info: DistInfo) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif info.device.type == "cuda":
        torch.backends.cudnn.benchmark = True


# ---------------------------------------------------------------------------- the epochs


@dataclass
class EpochLoop:
    """Everything the epochs of a run drive; :meth:`run` returns one record per epoch trained."""

    cfg: TrainConfig
    info: DistInfo
    data: TrainData
    model: nn.Module  # what trains (DDP-wrapped under torchrun)
    eval_model: nn.Module  # the same weights, not through DDP
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    amp_dtype: torch.dtype | None
    metrics: MetricsWriter
    say: Callable[[str], None]
    progress: bool
    checkpoint: Checkpointer
    num_batches: int  # micro-batches of a whole epoch
    steps_per_epoch: int

    def run(self, start: Position) -> list[dict[str, Any]]:
        history = []
        global_step = start.global_step
        for epoch in range(start.epoch, self.cfg.epochs):
            record = self.epoch(epoch, start.batch if epoch == start.epoch else 0, global_step)
            global_step = record["global_step"]
            history.append(record)
        return history

    def epoch(self, epoch: int, skip: int, global_step: int) -> dict[str, Any]:
        """Train epoch ``epoch`` from micro-batch ``skip``; evaluate, record, checkpoint its end."""
        cfg, data, info = self.cfg, self.data, self.info
        data.sampler.set_epoch(epoch)
        if skip and hasattr(data.sampler, "load_state_dict"):
            st = dict(data.sampler.state_dict())
            st.update(epoch=epoch, position=skip * cfg.batch_size)
            data.sampler.load_state_dict(st)
        steps_before = global_step - math.ceil(skip / cfg.accum)
        settings = EpochConfig(
            accum=cfg.accum, num_batches=self.num_batches, start_batch=skip, num_samples=data.sampler.num_samples,
            amp_dtype=self.amp_dtype, device=info.device, clip_grad=cfg.clip_grad, log_every=cfg.log_every,
            progress=self.progress, desc=f"epoch {epoch + 1}/{cfg.epochs}",
        )
        res = train_one_epoch(
            self.model, on_device(data.loader, info.device), self.optimizer, settings, loss_fn=self.loss_fn,
            transform=data.train_tf, batch_transform=data.batch_tf, scheduler=self.scheduler, scaler=self.scaler,
            on_log=lambda entry: self._on_log(entry, epoch, steps_before),
            on_step=lambda s: self._on_step(s, epoch, steps_before),
        )
        record = self._record(epoch, steps_before + self.steps_per_epoch, res)
        self.checkpoint(epoch + 1, 0, record["global_step"])
        return record

    def _on_log(self, entry: dict[str, float], epoch: int, steps_before: int) -> None:
        entry = {"epoch": epoch, "global_step": steps_before + int(entry["step"]), **entry}
        self.metrics.write("train", **entry)
        self.say(f"epoch {epoch + 1}/{self.cfg.epochs} step {int(entry['step'])}/{self.steps_per_epoch}  "
                 f"loss {entry['loss']:.4f}  lr {entry['lr']:.4g}  {entry['img_per_s']:.0f} img/s  "
                 f"data wait {entry['data_wait']:.1%}")

    def _on_step(self, s: StepInfo, epoch: int, steps_before: int) -> None:
        cfg = self.cfg
        step = steps_before + s.step
        if cfg.ckpt_every and step % cfg.ckpt_every == 0 and s.batch < s.num_batches:
            self.checkpoint(epoch, s.batch, step)
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(STOP_EXIT_CODE)  # a crash, not a shutdown: nothing else gets written

    def _record(self, epoch: int, global_step: int, res: EpochResult) -> dict[str, Any]:
        """The epoch's record (data-wait share over all ranks, val metrics), written and said."""
        info, data = self.info, self.data
        share = torch.tensor([res.data_wait, res.seconds], dtype=torch.float64, device=info.device)
        all_reduce_sum(share)
        wait_share = float(share[0] / share[1]) if share[1] > 0 else 0.0
        val = {}
        if data.val_loader is not None:
            # Not through DDP: ranks hold unequal val shards, and DDP's forward may sync buffers.
            val = evaluate(self.eval_model, on_device(data.val_loader, info.device), transform=data.eval_tf,
                           amp_dtype=self.amp_dtype, device=info.device, progress=self.progress)
        record = {
            "epoch": epoch, "global_step": global_step, "train_loss": res.loss, "img_per_s": res.img_per_s,
            "data_wait": wait_share, "seconds": res.seconds, "skipped_steps": res.skipped_steps,
            **{f"val_{k}": v for k, v in val.items()},
        }
        self.metrics.write("epoch", **record)
        msg = (f"epoch {epoch + 1}/{self.cfg.epochs} done in {res.seconds:.1f}s: train loss {res.loss:.4f}, "
               f"{res.img_per_s:.0f} img/s, data wait {wait_share:.1%}")
        if val:
            msg += f"; val loss {val['loss']:.4f} top-1 {val['top1']:.1%} top-5 {val['top5']:.1%}"
        self.say(msg)
        return record


# ---------------------------------------------------------------------------- what a run says and writes


def resolved_config(cfg: TrainConfig, info: DistInfo, data: TrainData, amp_dtype: torch.dtype | None,
                    num_batches: int, steps_per_epoch: int, n_params: int) -> dict[str, Any]:
    """``config.json``: every field of ``cfg`` and, under ``resolved``, what ``auto`` and the caches made of it."""
    return {
        **dataclasses.asdict(cfg),
        "resolved": {
            "device": str(info.device), "world_size": info.world_size,
            "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else "off",
            "num_classes": len(data.classes), "image_shape": list(data.shape), "augment": data.augment,
            "crop": data.crop, "train_count": len(data.train_ds),
            "val_count": len(data.val_ds) if data.val_ds is not None else 0,
            "batches_per_epoch": num_batches, "steps_per_epoch": steps_per_epoch,
            "global_batch": cfg.batch_size * cfg.accum * info.world_size, "params": n_params,
        },
    }


def say_start(say: Say, cfg: TrainConfig, info: DistInfo, data: TrainData, resolved: dict[str, Any],
              resumed: Position | None) -> None:
    r = resolved["resolved"]
    say(f"train {cfg.train}: {r['train_count']} images {data.shape[0]}x{data.shape[1]}, "
        f"{r['num_classes']} classes; val {cfg.val or '-'} ({r['val_count']} images)")
    say(f"model {cfg.model} ({r['params'] / 1e6:.2f} M params) on {info.device} x {info.world_size} process(es), "
        f"amp {r['amp_dtype']}, batch {cfg.batch_size} x accum {cfg.accum} x {info.world_size} = "
        f"{r['global_batch']}, {r['steps_per_epoch']} steps/epoch, augment {data.augment} @ {data.crop}px, "
        f"{cfg.workers} DataLoader workers")
    for note in data.notes:
        say(note)
    if resumed is not None:
        say(f"resumed from {Path(cfg.out) / CHECKPOINT_NAME}: epoch {resumed.epoch + 1}, micro-batch "
            f"{resumed.batch}/{r['batches_per_epoch']}, step {resumed.global_step}")


def summarize(cfg: TrainConfig, info: DistInfo, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary ``fit`` returns: the last epoch's record and the means over the epochs trained."""
    return {
        "cache": cfg.train, "val": cfg.val, "out": str(Path(cfg.out)), "model": cfg.model,
        "device": str(info.device), "world_size": info.world_size, "epochs_run": len(history),
        **(history[-1] if history else {}),
        "mean_img_per_s": _mean([h["img_per_s"] for h in history]),
        "mean_data_wait": _mean([h["data_wait"] for h in history]),
    }


def write_summary(say: Say, cfg: TrainConfig, info: DistInfo, summary: dict[str, Any]) -> None:
    """Rank 0: ``metrics.png``, ``summary.json`` and the closing lines."""
    out = Path(cfg.out)
    png = None
    if (out / METRICS_NAME).is_file():
        try:
            png = plot_metrics(out / METRICS_NAME, out / "metrics.png")
        except PlotsUnavailableError as e:  # the run itself is done: say what the picture needs, go on
            say(str(e))
    write_json(out / "summary.json", summary)
    say("")
    say(f"cache       {cfg.train}" + (f"  (val {cfg.val})" if cfg.val else ""))
    if summary["epochs_run"]:
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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _echo(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)  # between progress bars, not through them
