"""The reference training loop: cache -> loader -> device transforms -> model.

Use the pieces in your own code (``train_one_epoch``, ``evaluate``, ``build_model``, checkpoints), or
the whole run: ``cachebuild train CACHE --val VAL --model resnet50 ...`` / ``fit(TrainConfig(...))``.

Names are imported on first use, so ``from loaders.train.cli import train`` (what the ``cachebuild``
command group does) costs no torch import until the command actually runs.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AmpUnsupportedError",
    "CheckpointError",
    "EpochConfig",
    "EpochResult",
    "SmallCNN",
    "StepInfo",
    "TrainConfig",
    "TrainSetupError",
    "autocast",
    "available_models",
    "build_model",
    "evaluate",
    "fit",
    "load_checkpoint",
    "make_scaler",
    "num_optimizer_steps",
    "resolve_amp",
    "save_checkpoint",
    "train_one_epoch",
]

_WHERE = {
    "AmpUnsupportedError": "amp", "autocast": "amp", "make_scaler": "amp", "resolve_amp": "amp",
    "CheckpointError": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "EpochConfig": "loop", "EpochResult": "loop", "StepInfo": "loop", "evaluate": "loop", "num_optimizer_steps": "loop",
    "train_one_epoch": "loop",
    "SmallCNN": "models", "available_models": "models", "build_model": "models",
    "TrainConfig": "config", "TrainSetupError": "config", "fit": "run",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"loaders.train.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loaders.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
