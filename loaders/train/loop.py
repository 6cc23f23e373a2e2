"""The reference loop: ``train_one_epoch`` (AMP, GradScaler, accumulation, DDP ``no_sync``) and ``evaluate``.

Both take any iterable of ``(x, y)`` batches (``device_loader`` output, a list of tensors...) and a
``transform`` applied to ``x`` on the device, so they work with or without the rest of ``loaders``.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loaders.train.amp import autocast
from loaders.train.distributed import all_reduce_sum, is_distributed

__all__ = ["EpochResult", "StepInfo", "evaluate", "num_optimizer_steps", "train_one_epoch", "window_size"]

Transform = Callable[[torch.Tensor], torch.Tensor]


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


def _unwrap_logits(out: Any) -> torch.Tensor:
    # Inception / GoogLeNet return (logits, aux...) in train mode; the main logits come first.
    return out if isinstance(out, torch.Tensor) else out[0]


def _model_device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _scheduler_step(scheduler: Any, quiet: bool) -> None:
    if not quiet:
        scheduler.step()
        return
    # A GradScaler skip means optimizer.step() was not called; torch then warns that the scheduler
    # stepped first. Stepping anyway keeps the schedule on the planned step count, as timm does.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()


def train_one_epoch(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    transform: Transform | None = None,
    accum: int = 1,
    num_batches: int | None = None,
    start_batch: int = 0,
    num_samples: int | None = None,
    scheduler: Any | None = None,
    scaler: torch.amp.GradScaler | None = None,
    amp_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    clip_grad: float | None = None,
    log_every: int = 0,
    on_log: Callable[[dict[str, float]], None] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    progress: bool = False,
    desc: str = "train",
) -> EpochResult:
    """Train ``model`` on one epoch of ``batches``; returns timings and the mean loss.

    Gradient accumulation: the optimizer steps on every ``accum``-th micro-batch and on the last one;
    each micro-batch's loss is divided by the length of *its own* window, so a shorter last window is
    weighed like a full one (for equal micro-batch sizes, one window = one batch of their union). The
    scheduler steps once per optimizer step. Under DDP, micro-batches that do not update run in
    ``no_sync()`` so gradients are all-reduced once per window.

    ``num_samples`` (this process's samples in the whole epoch) weighs each micro-batch by its share of
    its window's samples instead, so that a short last micro-batch (the rest a loader without
    ``drop_last`` yields) counts per sample like the others and every window equals one batch of their
    union; every micro-batch but the epoch's last must then be full, or ValueError.

    ``num_batches`` is the length of the *whole* epoch (default: ``start_batch + len(batches)``);
    ``start_batch`` > 0 resumes mid-epoch, with ``batches`` yielding from that micro-batch on (it must
    sit on a window boundary, as checkpoints written from ``on_step`` do).

    AMP: the forward pass and loss run under ``torch.autocast(device, amp_dtype)``; with a ``scaler``
    (fp16) the loss is scaled, gradients are unscaled before clipping, and an inf/NaN gradient makes
    the scaler skip the step, leaving the weights as they were.
    """
    if accum < 1:
        raise ValueError(f"accum must be >= 1, got {accum}")
    if num_batches is None:
        if not hasattr(batches, "__len__"):
            raise ValueError("num_batches is required when batches has no len()")
        num_batches = start_batch + len(batches)  # type: ignore[arg-type]
    if start_batch % accum:
        raise ValueError(f"start_batch {start_batch} is not on an update boundary (accum={accum})")
    if start_batch > num_batches:
        raise ValueError(f"start_batch {start_batch} is past the end of the epoch ({num_batches} batches)")
    device = torch.device(device) if device is not None else _model_device(model)
    loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
    can_skip_sync = hasattr(model, "no_sync")  # DistributedDataParallel
    world = torch.distributed.get_world_size() if is_distributed() else 1

    model.train()
    optimizer.zero_grad(set_to_none=True)
    bar = _progress_bar(progress, num_batches, start_batch, desc)

    b = start_batch
    steps = skipped = samples = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    win: dict[str, Any] = {"loss": torch.zeros((), dtype=torch.float64, device=device), "n": 0, "samples": 0,
                           "wait": 0.0}
    t_start = t_win = t_prev = time.perf_counter()
    wait_total = 0.0
    w_expected = w_seen = 0  # samples of the current window: expected (from num_samples), seen
    step_lr = 0.0  # the LR the last optimizer step applied (the scheduler moves it on right after)
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        x, y = batch[0], batch[1]  # device_loader may add valid-image boxes (``--fit pad`` caches)
        waited = time.perf_counter() - t0
        if b >= num_batches:
            raise ValueError(f"batches yielded more than num_batches={num_batches} micro-batches")
        wait_total += waited
        win["wait"] += waited

        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        window = window_size(b, num_batches, accum)
        update = (b + 1) % accum == 0 or b + 1 == num_batches
        if num_samples is not None and b % accum == 0:
            # Only the epoch's last micro-batch may be short, so a window's first one gives its sample count.
            w_expected = len(y) if window == 1 else min(window * len(y), num_samples - b * len(y))
            w_seen = 0
        sync = contextlib.nullcontext() if update or not can_skip_sync else model.no_sync()  # type: ignore[operator]
        if transform is not None:  # outside autocast: the transforms choose their own output dtype
            x = transform(x, batch[2]) if len(batch) > 2 else transform(x)
        with sync:
            with autocast(device, amp_dtype):
                loss = loss_fn(_unwrap_logits(model(x)), y)
            scaled = loss / window if num_samples is None else loss * (len(y) / w_expected)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()

        loss_d = loss.detach().to(torch.float64)
        loss_sum += loss_d
        win["loss"] += loss_d
        win["n"] += 1
        win["samples"] += len(y)
        samples += len(y)
        b += 1

        if num_samples is not None:
            w_seen += len(y)
            if update and w_seen != w_expected:  # checked before the step: the weights stay as they were
                raise ValueError(f"micro-batches {b - window}-{b - 1} held {w_seen} samples, {w_expected} expected "
                                 f"from num_samples={num_samples}: all but the epoch's last must be full")
        if update:
            did_skip = False
            step_lr = float(optimizer.param_groups[0]["lr"])
            if scaler is not None:
                if clip_grad is not None:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                did_skip = scaler.get_scale() < scale_before  # the scale backs off only on inf/NaN
            else:
                if clip_grad is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
                optimizer.step()
            if scheduler is not None:
                _scheduler_step(scheduler, quiet=did_skip)
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            skipped += int(did_skip)
            if on_step is not None:
                on_step(StepInfo(batch=b, step=math.ceil(b / accum), num_batches=num_batches))

        now = time.perf_counter()
        if bar is not None:
            bar.update(1)
        if log_every and update and (math.ceil(b / accum) % log_every == 0 or b == num_batches):
            # Collective under DDP: every rank reaches the same step counts, so this never deadlocks.
            stats = torch.tensor(
                [float(win["loss"].item()), win["n"], win["samples"], win["wait"], now - t_win],
                dtype=torch.float64, device=device,
            )
            all_reduce_sum(stats)
            elapsed = float(stats[4]) / world
            entry = {
                "batch": b,
                "step": math.ceil(b / accum),
                "loss": float(stats[0]) / max(float(stats[1]), 1.0),
                "lr": step_lr,
                "img_per_s": float(stats[2]) / elapsed if elapsed > 0 else 0.0,
                "data_wait": float(stats[3] / stats[4]) if stats[4] > 0 else 0.0,
            }
            if bar is not None:
                bar.set_postfix(loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.3g}",
                                ips=f"{entry['img_per_s']:.0f}", wait=f"{entry['data_wait']:.0%}")
            if on_log is not None:
                on_log(entry)
            win = {"loss": torch.zeros_like(win["loss"]), "n": 0, "samples": 0, "wait": 0.0}
            t_win = time.perf_counter()
        t_prev = now
    if bar is not None:
        bar.close()

    seconds = t_prev - t_start
    done = b - start_batch
    if b != num_batches and b % accum:
        # A short iterable ending inside a window would silently drop its accumulated gradients.
        warnings.warn(f"epoch ended after {start_batch + done} of {num_batches} micro-batches; "
                      "the last window's gradients were not applied", RuntimeWarning, stacklevel=2)
    totals = torch.tensor([float(loss_sum.item()), done, samples, seconds], dtype=torch.float64, device=device)
    all_reduce_sum(totals)
    mean_seconds = float(totals[3]) / world
    return EpochResult(
        loss=float(totals[0] / totals[1]) if totals[1] > 0 else math.nan,
        samples=samples,
        batches=done,
        steps=steps,
        skipped_steps=skipped,
        seconds=seconds,
        data_wait=wait_total,
        img_per_s=float(totals[2]) / mean_seconds if mean_seconds > 0 else 0.0,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    transform: Transform | None = None,
    amp_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Loss, top-1 and top-5 accuracy (fractions) of ``model`` on ``batches``, summed over DDP ranks.

    Under DDP give each rank a disjoint share of the samples (no padding): the counts are summed,
    so each sample is counted once. Top-5 becomes top-C for fewer than five classes.
    """
    device = torch.device(device) if device is not None else _model_device(model)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # summed here, divided by the global count below
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1, top5, count
    n = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    bar = _progress_bar(progress, n, 0, "val")
    try:
        for batch in batches:
            x = batch[0].to(device, non_blocking=True)
            y = batch[1].to(device, non_blocking=True)
            if transform is not None:
                x = transform(x, batch[2]) if len(batch) > 2 else transform(x)
            with autocast(device, amp_dtype):
                logits = _unwrap_logits(model(x))
            logits = logits.float()
            k = min(5, logits.shape[1])
            top = logits.topk(k, dim=1).indices
            hit = top == y[:, None]
            totals[0] += loss_fn(logits, y).double()
            totals[1] += hit[:, 0].sum()
            totals[2] += hit.any(dim=1).sum()
            totals[3] += len(y)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    all_reduce_sum(totals)
    count = float(totals[3])
    if count == 0:
        return {"loss": math.nan, "top1": math.nan, "top5": math.nan, "count": 0}
    return {
        "loss": float(totals[0]) / count,
        "top1": float(totals[1]) / count,
        "top5": float(totals[2]) / count,
        "count": int(count),
    }


def _progress_bar(enabled: bool, total: int | None, initial: int, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True)
