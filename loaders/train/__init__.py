"""The reference training loop: cache -> loader -> device transforms -> model.

Use the pieces in your own code (``train_one_epoch``, ``evaluate``, ``build_model``, checkpoints), or
the whole run: ``cachebuild train CACHE --val VAL --model resnet50 ...`` / ``fit(TrainConfig(...))``.

Layout: ``config`` (every setting of a run), ``cli`` (the command), ``run.fit`` (a whole run: its epochs, what
it reports), ``loop/`` (one epoch: AMP, accumulation, the optimizer and its schedule, evaluation), ``data``
(caches, sampler, loaders), ``checkpoints`` (what a resume needs, the run folder), beside ``models``,
``metrics`` and ``distributed`` (DDP plumbing).

Names are imported on first use, so ``from loaders.train.cli import train`` (what the ``cachebuild``
command group does) costs no torch import until the command actually runs.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AmpUnsupportedError", "CheckpointError", "EpochConfig", "EpochResult", "SmallCNN", "StepInfo",
           "TrainConfig", "TrainSetupError", "autocast", "available_models", "build_model", "evaluate", "fit",
           "load_checkpoint", "make_scaler", "num_optimizer_steps", "resolve_amp", "save_checkpoint", "train_one_epoch"]

_WHERE = {
    "AmpUnsupportedError": "loop.amp", "autocast": "loop.amp", "make_scaler": "loop.amp", "resolve_amp": "loop.amp",
    "CheckpointError": "checkpoints", "load_checkpoint": "checkpoints", "save_checkpoint": "checkpoints",
    "EpochConfig": "loop.step", "EpochResult": "loop.step", "StepInfo": "loop.step", "evaluate": "loop.step",
    "num_optimizer_steps": "loop.step", "train_one_epoch": "loop.step",
    "SmallCNN": "models", "available_models": "models", "build_model": "models",
    "TrainConfig": "config", "TrainSetupError": "config", "fit": "run.fit",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"loaders.train.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loaders.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
