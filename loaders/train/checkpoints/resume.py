"""Checkpoints of a run: what a resume must keep, reading one back into the run, writing one.

A checkpoint holds the run's layout (batch size, accumulation, world size, train count) and its
optimizer / LR schedule settings (:data:`SCHEDULE_KEYS`); a resume refuses either changed, since the
restored optimizer and schedule would silently ignore the new values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loaders.train.checkpoints.run_folder import METRICS_NAME, remove_dead_temporaries
from loaders.train.checkpoints.state import (
    CheckpointError,
    capture_rng,
    load_checkpoint,
    restore_model,
    restore_rng,
    save_checkpoint,
)
from loaders.train.config import TrainConfig, TrainSetupError
from loaders.train.distributed import DistInfo, all_gather_objects
from loaders.train.metrics import drop_records_after

__all__ = ["SCHEDULE_KEYS", "Checkpointer", "Position", "read_checkpoint", "restore_run", "run_layout"]

# Settings a resume must keep: the optimizer and LR schedule are restored from the checkpoint, so a
# changed value would be ignored silently (more --epochs would train at the old schedule's final LR, 0).
SCHEDULE_KEYS: tuple[str, ...] = ("epochs", "warmup_epochs", "lr", "optimizer", "momentum", "weight_decay")


@dataclass(frozen=True)
class Position:
    """Where training (re)starts: micro-batch ``batch`` of ``epoch``, after ``global_step`` optimizer steps."""

    epoch: int = 0
    batch: int = 0
    global_step: int = 0


def run_layout(cfg: TrainConfig, info: DistInfo, train_count: int) -> dict[str, Any]:
    """The settings a mid-epoch resume must find unchanged (checked by ``load_checkpoint``)."""
    return {"batch_size": cfg.batch_size, "accum": cfg.accum, "world_size": info.world_size,
            "train_count": train_count}


def _schedule(cfg: TrainConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in SCHEDULE_KEYS}


def read_checkpoint(path: Path, cfg: TrainConfig, num_classes: int, layout: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint ``--resume`` continues from, checked against this run's model, layout and schedule."""
    if not path.is_file():
        raise TrainSetupError(f"--resume: no checkpoint at {path}")
    state = load_checkpoint(path, model_name=cfg.model, num_classes=num_classes, layout=layout)
    saved = state.get("layout", {})
    diff = [f"{k}: checkpoint {saved[k]!r} vs now {v!r}" for k, v in _schedule(cfg).items()
            if k in saved and saved[k] != v]  # checkpoints of earlier releases do not hold them
    if diff:
        raise CheckpointError(
            f"{path}: cannot resume with another optimizer or LR schedule ({', '.join(diff)}); the "
            f"checkpoint's would be used: pass its values, or start over (another --out, or --overwrite)"
        )
    return state


def restore_run(state: dict[str, Any], path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Any, scaler: torch.amp.GradScaler | None, info: DistInfo) -> Position:
    """Load ``state`` into the run (weights, optimizer, schedule, scaler, this rank's RNG); on rank 0 also
    drop the metrics logged after the checkpoint (they are trained and logged again) and dead temporaries."""
    restore_model(model, state, path)
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: optimizer/scheduler state does not fit this run: {e}") from e
    start = Position(state["epoch"], state["batch"], state["global_step"])
    if info.device.type == "cuda":
        torch.cuda.init()
    restore_rng(state["rng"][info.rank])  # the layout check made sure the world size is the same
    if info.is_main:
        drop_records_after(path.parent / METRICS_NAME, start.global_step)
        remove_dead_temporaries(path.parent)
    return start


@dataclass
class Checkpointer:
    """Writes the run's checkpoint at ``path``; a collective: every rank calls it at the same step."""

    path: Path
    cfg: TrainConfig
    main: bool
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    sampler: Any
    num_classes: int
    layout: dict[str, Any]

    def __call__(self, epoch: int, batch: int, step: int) -> None:
        rng = all_gather_objects(capture_rng())  # every rank's RNG state, so each resumes its own draws
        if not self.main:
            return
        sampler_state = dict(self.sampler.state_dict()) if hasattr(self.sampler, "state_dict") else {}
        sampler_state.update(epoch=epoch, position=batch * self.cfg.batch_size)
        save_checkpoint(self.path, model=self.model, optimizer=self.optimizer, model_name=self.cfg.model,
                        num_classes=self.num_classes, epoch=epoch, batch=batch, global_step=step,
                        scaler=self.scaler, scheduler=self.scheduler, sampler=_plain(sampler_state),
                        layout={**self.layout, **_schedule(self.cfg)}, rng=rng)


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """Sampler state as plain Python numbers (``weights_only`` loading refuses numpy scalars)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "item") and not isinstance(v, torch.Tensor):
            v = v.item()
        out[k] = v
    return out
