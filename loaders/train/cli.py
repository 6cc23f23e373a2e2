"""``cachebuild train`` / ``python -m loaders.train`` / ``torchrun -m loaders.train``: parse, check, call ``fit``."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import click

from cachebuild.errors import CacheBuildError, OptionError
from loaders.train.config import AMP_CHOICES, AUGMENT_IN, AUGMENTS, IN_MEMORY, LOADERS, OPTIMIZERS, TrainConfig

__all__ = ["main", "train"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _default(field: str) -> Any:
    """An option's default is ``TrainConfig``'s, so that the two cannot drift."""
    return _DEFAULTS[field]


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
@click.option("--val", type=click.Path(file_okay=False), default=_default("val"),
              help="Validation cache (same classes): top-1/top-5 after every epoch.")
@click.option("--out", type=click.Path(file_okay=False), default="runs/train",
              help="Run folder: checkpoint.pt, metrics.jsonl, metrics.png, config.json, summary.json.")
@click.option("--model", default=_default("model"), callback=_check_model,
              help="small_cnn / tiny_cnn / linear (CPU demos) or a torchvision model name (weights=None).")
@click.option("--epochs", type=click.IntRange(min=1), default=_default("epochs"))
@click.option("--batch-size", type=click.IntRange(min=1), default=_default("batch_size"),
              help="Per process, per micro-batch.")
@click.option("--accum", type=click.IntRange(min=1), default=_default("accum"),
              help="Micro-batches per optimizer step (gradient accumulation).")
@click.option("--amp", type=click.Choice(AMP_CHOICES), default=_default("amp"),
              help="autocast dtype; auto: bf16 where native, fp16 on older GPUs, off on CPUs without bf16.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=_default("lr"), help="Peak learning rate.")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=_default("optimizer"))
@click.option("--momentum", type=click.FloatRange(0, 1), default=_default("momentum"))
@click.option("--weight-decay", type=click.FloatRange(min=0), default=_default("weight_decay"))
@click.option("--warmup-epochs", type=click.FloatRange(min=0), default=_default("warmup_epochs"),
              help="Linear warm-up, then cosine decay to 0 (stepped per optimizer step).")
@click.option("--label-smoothing", type=click.FloatRange(0, 1, max_open=True), default=_default("label_smoothing"))
@click.option("--mixup", type=click.FloatRange(min=0), default=_default("mixup"), metavar="ALPHA",
              help="MixUp on the device batch with Beta(ALPHA, ALPHA) lambdas (0: off; DeiT uses 0.8).")
@click.option("--cutmix", type=click.FloatRange(min=0), default=_default("cutmix"), metavar="ALPHA",
              help="CutMix on the device batch (0: off; DeiT uses 1.0); with --mixup too, one of the two per "
                   "batch, each with probability 0.5. Targets become soft; --label-smoothing smooths them.")
@click.option("--clip-grad", type=click.FloatRange(min=0, min_open=True), default=_default("clip_grad"),
              help="Clip the gradient norm (after unscaling, under fp16).")
@click.option("--augment", type=click.Choice(AUGMENTS), default=_default("augment"),
              help="Device transform preset; auto: cifar for 32x32 caches, else imagenet (RandomResizedCrop).")
@click.option("--crop", type=click.IntRange(min=8), default=_default("crop"),
              help="Train/eval resolution [default: the cache's image size].")
@click.option("--augment-in", type=click.Choice(AUGMENT_IN), default=_default("augment_in"),
              help="Where the preset's crop, resize and flip run: device (on the batch) or workers (per sample, "
                   "in the loader's workers/threads, straight into a batch of the crop's size; the device only "
                   "normalizes). imagenet and none presets.")
@click.option("--progressive", default=_default("progressive"), metavar="LOW:HIGH[:START:END]",
              help="Progressive resizing (needs --augment-in workers): train at LOW px until epoch START, then "
                   "rise to HIGH px at epoch END (multiples of 8) [START, END default: 0 and the last epoch]. "
                   "Evaluation stays at --crop.")
@click.option("--workers", type=click.IntRange(min=0), default=_default("workers"),
              help="DataLoader worker processes (--loader dataloader) or ThreadLoader threads (--loader threads).")
@click.option("--loader", type=click.Choice(LOADERS), default=_default("loader"),
              help="threads: a ThreadLoader (batches gathered by threads of this process); dataloader: "
                   "DataLoader worker processes; auto: threads on CPU (no processes competing for the cores), "
                   "dataloader on CUDA.")
@click.option("--in-memory", type=click.Choice(IN_MEMORY), default=_default("in_memory"),
              help="Load the cache into shared RAM once (auto: when it fits half the free memory).")
@click.option("--device", default=_default("device"), help="cpu, cuda, cuda:N or auto.")
@click.option("--seed", type=int, default=_default("seed"))
@click.option("--compile", "compile_", is_flag=True, default=_default("compile"), help="torch.compile the model.")
@click.option("--deterministic", is_flag=True, default=_default("deterministic"),
              help="Deterministic algorithms (slower; for exact resume).")
@click.option("--log-every", type=click.IntRange(min=0), default=_default("log_every"),
              help="Optimizer steps between log lines.")
@click.option("--ckpt-every", type=click.IntRange(min=0), default=_default("ckpt_every"),
              help="Optimizer steps between checkpoints (0: end of each epoch only).")
@click.option("--resume", is_flag=True, default=_default("resume"),
              help="Continue from OUT/checkpoint.pt, mid-epoch if it was written so.")
@click.option("--overwrite", is_flag=True, default=_default("overwrite"),
              help="Start over in an OUT that holds a run: removes that run's files there (only those), not others.")
@click.option("--progress/--no-progress", default=_default("progress"),
              help="Progress bar [default: when on a terminal].")
@click.option("--stop-after-steps", type=click.IntRange(min=1), default=_default("stop_after_steps"), hidden=True,
              help="Testing: exit hard (os._exit) after this many optimizer steps, like a crash.")
def train(
    cache: str, val: str | None, out: str, model: str, epochs: int, batch_size: int, accum: int, amp: str,
    lr: float, optimizer: str, momentum: float, weight_decay: float, warmup_epochs: float,
    label_smoothing: float, mixup: float, cutmix: float, clip_grad: float | None, augment: str, crop: int | None,
    augment_in: str, progressive: str | None,
    workers: int, loader: str, in_memory: str, device: str, seed: int, compile_: bool, deterministic: bool,
    log_every: int, ckpt_every: int, resume: bool, overwrite: bool, progress: bool | None, stop_after_steps: int | None,
) -> None:
    """Train a classifier on a cachebuild CACHE: cache -> loader -> device transforms -> model.

    Run under `torchrun --nproc_per_node N -m loaders.train ...` for DDP (one process per GPU; gloo on CPU).
    An OUT that already holds a run is refused unless --resume (continue it) or --overwrite (start over).
    """
    from loaders.train.distributed import resolve_device
    from loaders.train.loop.amp import resolve_amp
    from loaders.train.run.fit import fit

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
            warmup_epochs=warmup_epochs, label_smoothing=label_smoothing, mixup=mixup, cutmix=cutmix,
            clip_grad=clip_grad, augment=augment,
            crop=crop, augment_in=augment_in, progressive=progressive,
            workers=workers, loader=loader, in_memory=in_memory, device=device, seed=seed,
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
