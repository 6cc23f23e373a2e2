"""``cachebuild train`` / ``python -m loaders.train`` / ``torchrun -m loaders.train``: parse, check, call ``fit``."""

from __future__ import annotations

import os
import sys

import click

from cachebuild.errors import CacheBuildError, OptionError

__all__ = ["main", "train"]


def _check_model(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from loaders.train.models import is_known_model

    if not is_known_model(value):
        raise click.BadParameter(
            f"unknown model {value!r}; try small_cnn, tiny_cnn, resnet18, resnet50 "
            "(any torchvision classifier name)", ctx=ctx, param=param,
        )
    return value


@click.command("train", context_settings={"show_default": True, "max_content_width": 110})
@click.argument("cache", type=click.Path(file_okay=False))
@click.option("--val", type=click.Path(file_okay=False), default=None,
              help="Validation cache (same classes): top-1/top-5 after every epoch.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/train",
              help="Run folder: checkpoint.pt, metrics.jsonl, metrics.png, config.json, summary.json.")
@click.option("--model", default="small_cnn", callback=_check_model,
              help="small_cnn / tiny_cnn / linear (CPU demos) or a torchvision model name (weights=None).")
@click.option("--epochs", type=click.IntRange(min=1), default=1)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, help="Per process, per micro-batch.")
@click.option("--accum", type=click.IntRange(min=1), default=1,
              help="Micro-batches per optimizer step (gradient accumulation).")
@click.option("--amp", type=click.Choice(["auto", "bf16", "fp16", "off"]), default="auto",
              help="autocast dtype; auto: bf16 where native, fp16 on older GPUs, off on CPUs without bf16.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.1, help="Peak learning rate.")
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default="sgd")
@click.option("--momentum", type=click.FloatRange(0, 1), default=0.9)
@click.option("--weight-decay", type=click.FloatRange(min=0), default=5e-5)
@click.option("--warmup-epochs", type=click.FloatRange(min=0), default=0.0,
              help="Linear warm-up, then cosine decay to 0 (stepped per optimizer step).")
@click.option("--label-smoothing", type=click.FloatRange(0, 1, max_open=True), default=0.0)
@click.option("--clip-grad", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Clip the gradient norm (after unscaling, under fp16).")
@click.option("--augment", type=click.Choice(["auto", "imagenet", "cifar", "none"]), default="auto",
              help="Device transform preset; auto: cifar for 32x32 caches, else imagenet (RandomResizedCrop).")
@click.option("--crop", type=click.IntRange(min=8), default=None,
              help="Train/eval resolution [default: the cache's image size].")
@click.option("--workers", type=click.IntRange(min=0), default=2,
              help="DataLoader worker processes (--loader dataloader) or gather threads (threads).")
@click.option("--loader", type=click.Choice(["auto", "dataloader", "threads"]), default="auto",
              help="auto: FastLoader threads on CPU (no processes competing for the cores), DataLoader on CUDA.")
@click.option("--in-memory", type=click.Choice(["auto", "yes", "no"]), default="auto",
              help="Load the cache into shared RAM once (auto: when it fits half the free memory).")
@click.option("--device", default="auto", help="cpu, cuda, cuda:N or auto.")
@click.option("--seed", type=int, default=0)
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the model.")
@click.option("--deterministic", is_flag=True, help="Deterministic algorithms (slower; for exact resume).")
@click.option("--log-every", type=click.IntRange(min=0), default=20, help="Optimizer steps between log lines.")
@click.option("--ckpt-every", type=click.IntRange(min=0), default=0,
              help="Optimizer steps between checkpoints (0: end of each epoch only).")
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint.pt, mid-epoch if it was written so.")
@click.option("--overwrite", is_flag=True,
              help="Start over in an OUT that holds a run: removes that run's files there (only those), not others.")
@click.option("--progress/--no-progress", default=None, help="Progress bar [default: when on a terminal].")
@click.option("--stop-after-steps", type=click.IntRange(min=1), default=None, hidden=True,
              help="Testing: exit hard (os._exit) after this many optimizer steps, like a crash.")
def train(
    cache: str, val: str | None, out: str, model: str, epochs: int, batch_size: int, accum: int, amp: str,
    lr: float, optimizer: str, momentum: float, weight_decay: float, warmup_epochs: float,
    label_smoothing: float, clip_grad: float | None, augment: str, crop: int | None, workers: int,
    loader: str, in_memory: str, device: str, seed: int, compile_: bool, deterministic: bool, log_every: int,
    ckpt_every: int, resume: bool, overwrite: bool, progress: bool | None, stop_after_steps: int | None,
) -> None:
    """Train a classifier on a cachebuild CACHE: cache -> loader -> device transforms -> model.

    Run under `torchrun --nproc_per_node N -m loaders.train ...` for DDP (one process per GPU; gloo on CPU).
    An OUT that already holds a run is refused unless --resume (continue it) or --overwrite (start over).
    """
    from loaders.train.amp import resolve_amp
    from loaders.train.distributed import resolve_device
    from loaders.train.run import TrainConfig, fit

    try:
        dev = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    try:
        resolve_amp(amp, dev)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--amp") from None
    try:
        cfg = TrainConfig(
            train=cache, val=val, out=out, model=model, epochs=epochs, batch_size=batch_size, accum=accum,
            amp=amp, lr=lr, optimizer=optimizer, momentum=momentum, weight_decay=weight_decay,
            warmup_epochs=warmup_epochs, label_smoothing=label_smoothing, clip_grad=clip_grad, augment=augment,
            crop=crop, workers=workers, loader=loader, in_memory=in_memory, device=device, seed=seed,
            compile=compile_, deterministic=deterministic, log_every=log_every, ckpt_every=ckpt_every,
            resume=resume, overwrite=overwrite, progress=progress, stop_after_steps=stop_after_steps,
        )
    except OptionError as e:
        raise click.UsageError(str(e)) from None
    try:
        fit(cfg, echo=_echo)
    except CacheBuildError as e:
        raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _echo(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)


def main() -> None:
    """Entry point of ``python -m loaders.train`` (and ``torchrun -m loaders.train``)."""
    train(prog_name="python -m loaders.train")
