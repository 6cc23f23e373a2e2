"""``TrainConfig``: every setting of a run, and the one declaration of each training choice.

Each field declares its flag, help, default, choices and bounds once (:func:`cachebuild.options.option`);
``cachebuild train`` is made from the fields (:func:`cachebuild.options.field_options`) and ``TrainConfig``
checks itself against the same declarations. The tuples below are where the choices live. Imports no torch,
so the CLI can build its options without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachebuild.errors import CacheBuildError, OptionError
from cachebuild.options import check_fields, option

__all__ = ["AMP_CHOICES", "AUGMENTS", "AUGMENT_IN", "IN_MEMORY", "OPTIMIZERS", "RESUME_FREE", "RESUME_KEEPS",
           "RESUME_NOT_CARRIED", "TrainConfig", "TrainSetupError", "parse_progressive"]

AMP_CHOICES: tuple[str, ...] = ("auto", "bf16", "fp16", "off")
AUGMENTS: tuple[str, ...] = ("auto", "imagenet", "cifar", "none")
# Where the preset's crop + resize + flip run: "device" on the batch (loaders.transforms), "workers" per sample
# in the DataLoader's workers, straight into a batch of the crop's size (loaders.worker_crop).
AUGMENT_IN: tuple[str, ...] = ("device", "workers")
IN_MEMORY: tuple[str, ...] = ("auto", "yes", "no")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class TrainSetupError(CacheBuildError, ValueError):
    """A run that cannot start: mismatched caches, impossible sizes, a missing checkpoint to resume."""


def _known_model(name: str) -> None:
    from loaders.train.models import is_known_model  # imports torch: only when a model is named

    if not is_known_model(name):
        raise ValueError(f"unknown model {name!r}; try small_cnn, tiny_cnn, linear, resnet18, resnet50 (any "
                         "torchvision classifier name)")


def _no_loader(value: str) -> None:
    raise ValueError("--loader is no longer a flag of train: batches are loaded by DataLoader worker processes "
                     "(--workers N; --workers 0 loads in the main process), in Python "
                     "torch.utils.data.DataLoader(ds, ..., collate_fn=collate_batch)")


def _device(name: str) -> None:
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"must be cpu, cuda, cuda:N or auto; got {name!r}")


def parse_progressive(text: str) -> tuple[int, int, int | None, int | None]:
    """``LOW:HIGH[:START:END]`` as (low, high, start, end), START and END None when not given."""
    try:
        vals = [int(p) for p in str(text).split(":")]
    except ValueError:
        vals = []
    if len(vals) not in (2, 4):
        raise ValueError(f"must be LOW:HIGH or LOW:HIGH:START:END (integers), got {text!r}")
    low, high = vals[0], vals[1]
    start, end = (vals[2], vals[3]) if len(vals) == 4 else (None, None)
    if not 8 <= low <= high or (start is not None and end is not None and not 0 <= start <= end):
        raise ValueError(f"{text!r}: need 8 <= LOW <= HIGH and 0 <= START <= END")
    return low, high, start, end


# What a resume keeps: each of these changes what is trained (the model, its steps and schedule, the data, its
# augmentation and mixing, the seed of every draw); a resumed run refuses another value. The rest is free: where
# the run's files and caches are, what runs it and how fast, what it reports. Every field is in one of the two.
RESUME_KEEPS: tuple[str, ...] = (
    "model", "epochs", "batch_size", "accum", "amp", "lr", "optimizer", "momentum", "weight_decay", "warmup_epochs",
    "label_smoothing", "labels", "mixup", "cutmix", "clip_grad", "augment", "crop", "augment_in", "progressive",
    "seed", "shard_window")
RESUME_FREE: tuple[str, ...] = (
    "train", "val", "out", "workers", "loader", "in_memory", "device", "compile", "deterministic", "log_every",
    "ckpt_every", "resume", "overwrite", "progress", "stop_after_steps")
# Free options a resume does not take from the run it continues (the rest it does, unless given).
RESUME_NOT_CARRIED: tuple[str, ...] = ("out", "resume", "overwrite", "progress", "stop_after_steps", "loader")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run; written to ``OUT/config.json`` (with the resolved values) at the start.

    Each field is declared once (:func:`~cachebuild.options.option`: its flag, help, choices and bounds beside
    its default): ``cachebuild train``'s options are made from these fields. Frozen and checked when made: a
    value that cannot work raises :class:`~cachebuild.errors.OptionError` naming the field, before any cache is
    opened.
    """

    train: str | None = option(None, None, argument=True, metavar="[CACHE]", path="dir")  # None: --resume's run's
    val: str | None = option(None, "Validation cache (same classes): top-1/top-5 after every epoch.", path="dir")
    out: str = option("runs/train", "Run folder: checkpoint.pt, metrics.jsonl, metrics.png, config.json, "
                      "summary.json.", path="dir")
    model: str = option("small_cnn", "small_cnn / tiny_cnn / linear (CPU demos) or a torchvision model name "
                        "(weights=None).", check=_known_model)
    epochs: int = option(1, None, min=1)
    batch_size: int = option(64, "Per process, per micro-batch.", min=1)
    accum: int = option(1, "Micro-batches per optimizer step (gradient accumulation).", min=1)
    amp: str = option("auto", "autocast dtype; auto: bf16 where native, fp16 on older GPUs, off on CPUs without "
                      "bf16.", choices=AMP_CHOICES)
    lr: float = option(0.1, "Peak learning rate.", min=0, min_open=True)
    optimizer: str = option("sgd", None, choices=OPTIMIZERS)
    momentum: float = option(0.9, None, min=0, max=1)
    weight_decay: float = option(5e-5, None, min=0)
    warmup_epochs: float = option(0.0, "Linear warm-up, then cosine decay to 0 (stepped per optimizer step).",
                                  min=0)
    label_smoothing: float = option(0.0, None, min=0, max=1, max_open=True)
    labels: str | None = option(None, "Train on this column of the cache (cachebuild columns add) instead of its "
                                "labels: integer class indices (relabelled) or float (N, C) soft labels "
                                "(distillation; MixUp/CutMix mix them); the val cache uses it when it has it.",
                                metavar="NAME")
    # batch-level mixing (loaders.transforms.MixUpCutMix): Beta(alpha, alpha) lambdas; 0 switches one off
    mixup: float = option(0.0, "MixUp on the device batch with Beta(ALPHA, ALPHA) lambdas (0: off; DeiT uses "
                          "0.8).", min=0, metavar="ALPHA")
    cutmix: float = option(0.0, "CutMix on the device batch (0: off; DeiT uses 1.0); with --mixup too, one of the "
                           "two per batch, each with probability 0.5. Targets become soft; --label-smoothing "
                           "smooths them.", min=0, metavar="ALPHA")
    clip_grad: float | None = option(None, "Clip the gradient norm (after unscaling, under fp16).", min=0,
                                     min_open=True)
    augment: str = option("auto", "Device transform preset; auto: cifar for 32x32 caches, else imagenet "
                          "(RandomResizedCrop).", choices=AUGMENTS)
    crop: int | None = option(None, "Train/eval resolution [default: the cache's image size].", min=8)
    augment_in: str = option("device", "Where the preset's crop, resize and flip run: device (on the batch) or "
                             "workers (per sample, in the DataLoader's workers, straight into a batch of the "
                             "crop's size; the device only normalizes). imagenet and none presets.",
                             choices=AUGMENT_IN)
    progressive: str | None = option(None, "Progressive resizing (needs --augment-in workers): train at LOW px "
                                     "until epoch START, then rise to HIGH px at epoch END (multiples of 8) "
                                     "[START, END default: 0 and the last epoch]. Evaluation stays at --crop.",
                                     metavar="LOW:HIGH[:START:END]", check=parse_progressive)
    workers: int = option(2, "DataLoader worker processes (0: batches are loaded in the main process).", min=0)
    loader: str | None = option(None, None, hidden=True, check=_no_loader)  # an earlier release's flag: refused
    in_memory: str = option("auto", "Load the cache into shared RAM once (auto: when it fits half the free "
                            "memory).", choices=IN_MEMORY)
    device: str = option("auto", "cpu, cuda, cuda:N or auto.", check=_device)
    seed: int = option(0, None)
    shard_window: int | None = option(None, "Shuffle the cache's shards, then samples within groups of this many "
                                      "shards, each fetched whole (a cache at a URL with a block cache); not a "
                                      "uniform shuffle [default: the exact shuffle].", metavar="W", min=1)
    compile: bool = option(False, "torch.compile the model.")
    deterministic: bool = option(False, "Deterministic algorithms (slower; for exact resume).")
    log_every: int = option(20, "Optimizer steps between log lines.", min=0)
    ckpt_every: int = option(0, "Optimizer steps between checkpoints (0: end of each epoch only).", min=0)
    resume: bool = option(False, "Continue from OUT/checkpoint.pt, mid-epoch if it was written so, with the run's "
                          "options (CACHE and options left out are the run's; a changed training option is "
                          "refused).")
    overwrite: bool = option(False, "Start over in an OUT that holds a run: removes that run's files there (only "
                             "those), not others.")
    progress: bool | None = option(None, "Progress bar [default: when on a terminal].")  # None: stderr a terminal
    stop_after_steps: int | None = option(None, "Testing: exit hard (os._exit) after this many optimizer steps, "
                                          "like a crash.", min=1, hidden=True)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.train is None and not self.resume:
            raise OptionError("missing argument CACHE: the cache to train on (or --resume --out RUN, which "
                              "continues the run in RUN with its own cache and options)")
        if self.progressive is not None and self.augment_in != "workers":
            raise OptionError("progressive resizing crops in the loader's workers: add --augment-in workers")
        if self.resume and self.overwrite:
            raise OptionError("resume and overwrite exclude each other: --resume continues the run in --out, "
                              "--overwrite starts it over")

    @property
    def cache(self) -> str:
        """The train cache (``train``, which only a resume that has not yet read its run may leave unset)."""
        if self.train is None:
            raise OptionError("no train cache: name CACHE, or --resume a run folder that holds one")
        return self.train

    def progressive_schedule(self) -> tuple[int, int, int, int] | None:
        """``progressive`` as (low, high, start epoch, end epoch), or None; OptionError when malformed."""
        if self.progressive is None:
            return None
        try:
            low, high, start, end = parse_progressive(self.progressive)
        except ValueError as e:
            raise OptionError(f"progressive {e}") from None
        if start is None or end is None:
            start, end = 0, max(self.epochs - 1, 0)
        return low, high, start, end
