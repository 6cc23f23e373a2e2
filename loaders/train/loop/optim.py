"""The optimizer (SGD with momentum, or AdamW) and its per-step LR schedule (linear warm-up, cosine decay)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from loaders.train.config import TrainConfig

__all__ = ["WarmupCosine", "build_optimizer", "build_scheduler"]


class WarmupCosine:
    """Linear warm-up from ~0 to 1 over ``warmup`` steps, then a cosine to 0 at ``total`` steps.

    A class rather than a lambda so that ``LambdaLR.state_dict()`` stores its fields (plain ints) and a
    checkpoint stays loadable with ``weights_only=True``.
    """

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup = int(warmup)
        self.total = max(int(total), 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = (step - self.warmup) / max(self.total - self.warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (momentum) or AdamW; no weight decay on biases and norm scales (1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def build_scheduler(optimizer: torch.optim.Optimizer, steps_per_epoch: int, cfg: TrainConfig) -> Any:
    """Per-optimizer-step schedule: ``warmup_epochs`` of linear warm-up, then cosine decay to 0."""
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, cfg.epochs * steps_per_epoch))
