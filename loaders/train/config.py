"""``TrainConfig``: every setting of a run, and the one declaration of each training choice.

The tuples below are where the choices live: ``TrainConfig`` checks against them and ``cachebuild
train``'s options take their ``click.Choice`` lists (and every default) from them and from the fields.
Imports no torch, so the CLI can build its options without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachebuild.errors import CacheBuildError, OptionError
from cachebuild.options import (
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    parse_optional_bool,
    parse_path,
)

__all__ = [
    "AMP_CHOICES",
    "AUGMENTS",
    "AUGMENT_IN",
    "IN_MEMORY",
    "LOADERS",
    "OPTIMIZERS",
    "TrainConfig",
    "TrainSetupError",
]

AMP_CHOICES: tuple[str, ...] = ("auto", "bf16", "fp16", "off")
AUGMENTS: tuple[str, ...] = ("auto", "imagenet", "cifar", "none")
# Where the preset's crop + resize + flip run: "device" on the batch (loaders.transforms), "workers" per sample
# in the loader's workers or threads, straight into a batch of the crop's size (loaders.worker_crop).
AUGMENT_IN: tuple[str, ...] = ("device", "workers")
IN_MEMORY: tuple[str, ...] = ("auto", "yes", "no")
# "threads": a ThreadLoader (loaders.thread_loader) gathers batches in threads of the training process;
# "dataloader": torch's DataLoader with worker processes; "auto": threads on CPU, dataloader on CUDA.
LOADERS: tuple[str, ...] = ("auto", "dataloader", "threads")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


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
    # batch-level mixing (loaders.transforms.MixUpCutMix): Beta(alpha, alpha) lambdas; 0 switches one off
    mixup: float = 0.0
    cutmix: float = 0.0
    clip_grad: float | None = None
    augment: str = "auto"
    crop: int | None = None  # training/eval resolution; default: the cache's image size
    augment_in: str = "device"  # one of AUGMENT_IN
    # "A:B[:START:END]": train at A px until epoch START, then up to B px at epoch END (default: 0 and the
    # last epoch); needs augment_in "workers". Evaluation stays at `crop`.
    progressive: str | None = None
    workers: int = 2  # DataLoader worker processes, or ThreadLoader threads
    loader: str = "auto"  # one of LOADERS
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
        parse_float("mixup", self.mixup, 0)
        parse_float("cutmix", self.cutmix, 0)
        parse_float("clip_grad", self.clip_grad, 0, min_open=True, optional=True)
        parse_choice("augment", self.augment, AUGMENTS)
        parse_int("crop", self.crop, 8, optional=True)
        parse_choice("augment_in", self.augment_in, AUGMENT_IN)
        if self.progressive is not None:
            self.progressive_schedule()  # checks it
            if self.augment_in != "workers":
                raise OptionError("progressive resizing crops in the loader's workers: add --augment-in workers")
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

    def progressive_schedule(self) -> tuple[int, int, int, int] | None:
        """``progressive`` as (low, high, start epoch, end epoch), or None; OptionError when malformed."""
        if self.progressive is None:
            return None
        parts = str(self.progressive).split(":")
        try:
            vals = [int(p) for p in parts]
        except ValueError:
            vals = []
        if len(vals) not in (2, 4):
            raise OptionError(f"progressive must be LOW:HIGH or LOW:HIGH:START:END (integers), "
                              f"got {self.progressive!r}")
        low, high = vals[0], vals[1]
        start, end = (vals[2], vals[3]) if len(vals) == 4 else (0, max(self.epochs - 1, 0))
        if not 8 <= low <= high or not 0 <= start <= end:
            raise OptionError(f"progressive {self.progressive!r}: need 8 <= LOW <= HIGH and 0 <= START <= END")
        return low, high, start, end

    def check(self) -> None:
        """Kept for callers of earlier releases: every value is checked when the config is made."""
