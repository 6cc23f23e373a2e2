"""The reference loop: ``train_one_epoch`` (AMP, GradScaler, accumulation, DDP ``no_sync``) and ``evaluate``.

Both take any iterable of ``(x, y)`` batches and a ``transform`` applied to ``x`` on the device, so they work
with or without the rest of ``loaders``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loaders.train.distributed import all_reduce_sum, is_distributed
from loaders.train.loop.amp import autocast
from loaders.train.loop.evaluation import Transform, evaluate, model_device, progress_bar, unwrap_logits

__all__ = ["BatchTransform", "EpochConfig", "EpochResult", "StepInfo", "evaluate", "num_optimizer_steps",
           "train_one_epoch", "window_size"]

# (x, labels) -> (x, targets): a batch-level mix (MixUp, CutMix) after ``transform``; targets may be soft.
BatchTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class EpochResult:
    """What one call of :func:`train_one_epoch` did (this process; ``img_per_s`` summed over ranks)."""

    loss: float  # mean micro-batch loss, averaged over ranks
    samples: int  # samples this process trained on
    batches: int  # micro-batches this call consumed
    steps: int  # optimizer steps (update windows) this call closed
    skipped_steps: int  # of which GradScaler skipped for inf/NaN gradients
    seconds: float
    data_wait: float  # seconds blocked on the next batch
    img_per_s: float

    @property
    def data_wait_share(self) -> float:
        return self.data_wait / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StepInfo:
    """Passed to ``on_step`` after every optimizer step; ``batch`` = micro-batches of the epoch done."""

    batch: int
    step: int  # optimizer steps of this epoch done (counting from batch 0, also after a resume)
    num_batches: int


def num_optimizer_steps(num_batches: int, accum: int) -> int:
    """Optimizer steps in an epoch of ``num_batches`` micro-batches: one per ``accum``, and one for the rest."""
    return math.ceil(num_batches / accum)


def window_size(batch: int, num_batches: int, accum: int) -> int:
    """Micro-batches in the update window holding micro-batch ``batch`` (the last window may be shorter)."""
    start = (batch // accum) * accum
    return min(accum, num_batches - start)


def _scheduler_step(scheduler: Any, quiet: bool) -> None:
    if not quiet:
        scheduler.step()
        return
    # A GradScaler skip means optimizer.step() was not called; torch then warns that the scheduler
    # stepped first. Stepping anyway keeps the schedule on the planned step count, as timm does.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()


@dataclass(frozen=True)
class EpochConfig:
    """The plain settings of one :func:`train_one_epoch` call (the objects it drives are its arguments).

    ``num_batches``: the *whole* epoch's micro-batches (default ``start_batch + len(batches)``); ``start_batch``
    > 0 resumes mid-epoch on a window boundary, ``batches`` yielding from there. ``num_samples`` (this
    process's samples in the whole epoch) weighs each micro-batch by its share of its window's samples, not
    1/window, so a short last micro-batch counts per sample like the others; all but the epoch's last must
    then be full, or ValueError.
    """

    accum: int = 1  # micro-batches per optimizer step
    num_batches: int | None = None  # the whole epoch's micro-batches; default: start_batch + len(batches)
    start_batch: int = 0  # > 0 resumes mid-epoch, on a window boundary
    num_samples: int | None = None  # this process's samples in the whole epoch: weigh micro-batches per sample
    amp_dtype: torch.dtype | None = None
    device: torch.device | str | None = None  # default: the model's
    clip_grad: float | None = None
    log_every: int = 0  # optimizer steps between ``on_log`` calls; 0: none
    progress: bool = False
    desc: str = "train"


@dataclass
class _Window:
    """Totals since the last log line (summed over ranks when it is written)."""

    loss: torch.Tensor
    batches: int = 0
    samples: int = 0
    wait: float = 0.0


@dataclass
class _EpochState:
    """Where one :func:`train_one_epoch` call is: counters of the epoch and of the current update window."""

    batch: int  # micro-batches of the epoch done (counting from 0, also after a resume)
    loss_sum: torch.Tensor
    log: _Window
    steps: int = 0
    skipped: int = 0
    samples: int = 0
    wait: float = 0.0
    expected: int = 0  # samples of the current update window, expected from num_samples
    seen: int = 0  # and seen so far
    step_lr: float = 0.0  # the LR the last optimizer step applied (the scheduler moves it on right after)
    log_started: float = 0.0


def train_one_epoch(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    optimizer: torch.optim.Optimizer, config: EpochConfig | None = None, *,
                    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                    transform: Transform | None = None, batch_transform: BatchTransform | None = None,
                    scheduler: Any | None = None, scaler: torch.amp.GradScaler | None = None,
                    on_log: Callable[[dict[str, float]], None] | None = None,
                    on_step: Callable[[StepInfo], None] | None = None) -> EpochResult:
    """Train ``model`` on one epoch of ``batches`` (settings: ``config``, an :class:`EpochConfig`); returns timings
    and the mean loss.

    Accumulation: the optimizer steps on every ``accum``-th micro-batch and on the last; each micro-batch's
    loss is divided by the length of *its own* window, so a shorter last window weighs like a full one; the
    scheduler steps once per optimizer step; under DDP the micro-batches that do not update run in
    ``no_sync()``. ``transform`` maps the device batch ``x`` (and its valid boxes, when the loader yields
    them); ``batch_transform`` then ``(x, y)`` to ``(x, targets)``, a mix whose targets may be soft (N, C),
    which ``loss_fn`` must take (``nn.CrossEntropyLoss``, the default, does). AMP: forward and loss under
    ``torch.autocast(device, amp_dtype)``; with a ``scaler`` (fp16) the loss is scaled, gradients unscaled
    before clipping, and an inf/NaN gradient makes the scaler skip the step.
    """
    cfg, num_batches = _resolve(config, batches)
    device = torch.device(cfg.device) if cfg.device is not None else model_device(model)
    step = _Step(model, optimizer, loss_fn if loss_fn is not None else nn.CrossEntropyLoss(), transform,
                 batch_transform, scheduler, scaler, cfg, num_batches, device)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    bar = progress_bar(cfg.progress, num_batches, cfg.start_batch, cfg.desc)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    st = _EpochState(batch=cfg.start_batch, loss_sum=zero.clone(), log=_Window(zero.clone()))
    t_start = st.log_started = t_prev = time.perf_counter()
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited = time.perf_counter() - t0
        if st.batch >= num_batches:
            raise ValueError(f"batches yielded more than num_batches={num_batches} micro-batches")
        st.wait += waited
        st.log.wait += waited
        update = step.micro_batch(st, batch)
        if update:
            step.optimizer_step(st)
            if on_step is not None:
                on_step(StepInfo(batch=st.batch, step=math.ceil(st.batch / cfg.accum), num_batches=num_batches))
        now = time.perf_counter()
        if bar is not None:
            bar.update(1)
        if cfg.log_every and update and (math.ceil(st.batch / cfg.accum) % cfg.log_every == 0
                                         or st.batch == num_batches):
            _log_window(st, cfg, now, device, bar, on_log)
        t_prev = now
    if bar is not None:
        bar.close()
    return _epoch_result(st, cfg, t_prev - t_start, device)


def _resolve(config: EpochConfig | None, batches: Iterable[Any]) -> tuple[EpochConfig, int]:
    """``config`` with ``num_batches`` filled in, checked."""
    cfg = config if config is not None else EpochConfig()
    if not isinstance(cfg, EpochConfig):
        raise TypeError(f"config must be an EpochConfig, got {type(cfg).__name__}")
    if cfg.accum < 1:
        raise ValueError(f"accum must be >= 1, got {cfg.accum}")
    num_batches = cfg.num_batches
    if num_batches is None:
        if not hasattr(batches, "__len__"):
            raise ValueError("num_batches is required when batches has no len()")
        num_batches = cfg.start_batch + len(batches)  # type: ignore[arg-type]
        cfg = dataclasses.replace(cfg, num_batches=num_batches)
    if cfg.start_batch % cfg.accum:
        raise ValueError(f"start_batch {cfg.start_batch} is not on an update boundary (accum={cfg.accum})")
    if cfg.start_batch > num_batches:
        raise ValueError(f"start_batch {cfg.start_batch} is past the end of the epoch ({num_batches} batches)")
    return cfg, num_batches


@dataclass
class _Step:
    """What one micro-batch and one optimizer step drive."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    transform: Transform | None
    batch_transform: BatchTransform | None
    scheduler: Any | None
    scaler: torch.amp.GradScaler | None
    cfg: EpochConfig
    num_batches: int
    device: torch.device

    def micro_batch(self, st: _EpochState, batch: Any) -> bool:
        """Forward and backward of one micro-batch (its loss weighed in its window); True when the window
        closes with it, i.e. the optimizer steps next."""
        cfg, b, num_batches = self.cfg, st.batch, self.num_batches
        x, y = batch[0], batch[1]  # device_loader may add valid-image boxes (``--fit pad`` caches)
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        window = window_size(b, num_batches, cfg.accum)
        update = (b + 1) % cfg.accum == 0 or b + 1 == num_batches
        if cfg.num_samples is not None and b % cfg.accum == 0:
            # Only the epoch's last micro-batch may be short, so a window's first one gives its sample count.
            st.expected = len(y) if window == 1 else min(window * len(y), cfg.num_samples - b * len(y))
            st.seen = 0
        can_skip_sync = hasattr(self.model, "no_sync")  # DistributedDataParallel
        sync = contextlib.nullcontext() if update or not can_skip_sync else self.model.no_sync()  # type: ignore[operator]
        if self.transform is not None:  # outside autocast: the transforms choose their own output dtype
            x = self.transform(x, batch[2]) if len(batch) > 2 else self.transform(x)
        if self.batch_transform is not None:  # a batch-level mix: targets may become soft (N, C)
            x, y = self.batch_transform(x, y)
        with sync:
            with autocast(self.device, cfg.amp_dtype):
                loss = self.loss_fn(unwrap_logits(self.model(x)), y)
            scaled = loss / window if cfg.num_samples is None else loss * (len(y) / st.expected)
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()

        loss_d = loss.detach().to(torch.float64)
        st.loss_sum += loss_d
        st.log.loss += loss_d
        st.log.batches += 1
        st.log.samples += len(y)
        st.samples += len(y)
        st.batch += 1
        if cfg.num_samples is not None:
            st.seen += len(y)
            if update and st.seen != st.expected:  # checked before the step: the weights stay as they were
                raise ValueError(f"micro-batches {st.batch - window}-{st.batch - 1} held {st.seen} samples, "
                                 f"{st.expected} expected from num_samples={cfg.num_samples}: all but the "
                                 f"epoch's last must be full")
        return update

    def optimizer_step(self, st: _EpochState) -> None:
        """Unscale and clip (fp16), step (GradScaler may skip it on inf/NaN), schedule, zero the gradients."""
        optimizer, scaler, clip_grad = self.optimizer, self.scaler, self.cfg.clip_grad
        did_skip = False
        st.step_lr = float(optimizer.param_groups[0]["lr"])
        if scaler is not None:
            if clip_grad is not None:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                nn.utils.clip_grad_norm_(self.model.parameters(), clip_grad)
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            did_skip = scaler.get_scale() < scale_before  # the scale backs off only on inf/NaN
        else:
            if clip_grad is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), clip_grad)
            optimizer.step()
        if self.scheduler is not None:
            _scheduler_step(self.scheduler, quiet=did_skip)
        optimizer.zero_grad(set_to_none=True)
        st.steps += 1
        st.skipped += int(did_skip)


def _world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def _log_window(st: _EpochState, cfg: EpochConfig, now: float, device: torch.device, bar: Any,
                on_log: Callable[[dict[str, float]], None] | None) -> None:
    """Sum the window since the last log line over ranks, hand it to ``on_log``, start the next one."""
    win = st.log
    # Collective under DDP: every rank reaches the same step counts, so this never deadlocks.
    stats = torch.tensor([float(win.loss.item()), win.batches, win.samples, win.wait, now - st.log_started],
                         dtype=torch.float64, device=device)
    all_reduce_sum(stats)
    elapsed = float(stats[4]) / _world_size()
    entry = {
        "batch": st.batch,
        "step": math.ceil(st.batch / cfg.accum),
        "loss": float(stats[0]) / max(float(stats[1]), 1.0),
        "lr": st.step_lr,
        "img_per_s": float(stats[2]) / elapsed if elapsed > 0 else 0.0,
        "data_wait": float(stats[3] / stats[4]) if stats[4] > 0 else 0.0,
    }
    if bar is not None:
        bar.set_postfix(loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.3g}",
                        ips=f"{entry['img_per_s']:.0f}", wait=f"{entry['data_wait']:.0%}")
    if on_log is not None:
        on_log(entry)
    st.log = _Window(torch.zeros_like(win.loss))
    st.log_started = time.perf_counter()


def _epoch_result(st: _EpochState, cfg: EpochConfig, seconds: float, device: torch.device) -> EpochResult:
    done = st.batch - cfg.start_batch
    if st.batch != cfg.num_batches and st.batch % cfg.accum:
        # A short iterable ending inside a window would silently drop its accumulated gradients.
        warnings.warn(f"epoch ended after {cfg.start_batch + done} of {cfg.num_batches} micro-batches; "
                      "the last window's gradients were not applied", RuntimeWarning, stacklevel=3)
    totals = torch.tensor([float(st.loss_sum.item()), done, st.samples, seconds], dtype=torch.float64,
                          device=device)
    all_reduce_sum(totals)
    mean_seconds = float(totals[3]) / _world_size()
    return EpochResult(
        loss=float(totals[0] / totals[1]) if totals[1] > 0 else math.nan,
        samples=st.samples,
        batches=done,
        steps=st.steps,
        skipped_steps=st.skipped,
        seconds=seconds,
        data_wait=st.wait,
        img_per_s=float(totals[2]) / mean_seconds if mean_seconds > 0 else 0.0,
    )
