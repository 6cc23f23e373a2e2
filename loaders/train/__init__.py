"""The reference training loop: cache -> loader -> device transforms -> model.

The pieces (``train_one_epoch``, ``evaluate``, ``build_model``, checkpoints) for your own loop, or a whole run:
``cachebuild train CACHE ...`` / ``fit(TrainConfig(...))``. Layout: ``config`` (every setting), ``cli``,
``run.fit`` (a run, its epochs, its reports), ``loop/`` (one epoch: AMP, accumulation, optimizer and schedule,
evaluation), ``data`` (caches, sampler, loaders), ``checkpoints`` (resume, the run folder), ``models``,
``metrics``, ``distributed``. Names are imported on first use: the ``cachebuild`` command group imports
``loaders.train.cli`` without torch.
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
