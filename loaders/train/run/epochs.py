"""The epoch loop of a run: each epoch trained (from a resume position), logged, evaluated, checkpointed."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loaders.train.checkpoints.resume import Checkpointer, Position
from loaders.train.config import TrainConfig
from loaders.train.data import TrainData, on_device
from loaders.train.distributed import DistInfo, all_reduce_sum
from loaders.train.loop.step import EpochConfig, EpochResult, StepInfo, evaluate, train_one_epoch
from loaders.train.metrics import MetricsWriter

__all__ = ["STOP_EXIT_CODE", "EpochLoop"]

STOP_EXIT_CODE = 75  # --stop-after-steps: a hard exit (os._exit) that tests treat as a crash


@dataclass
class EpochLoop:
    """Everything the epochs of a run drive; :meth:`run` returns one record per epoch trained."""

    cfg: TrainConfig
    info: DistInfo
    data: TrainData
    model: nn.Module  # what trains (DDP-wrapped under torchrun)
    eval_model: nn.Module  # the same weights, not through DDP
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    amp_dtype: torch.dtype | None
    metrics: MetricsWriter
    say: Callable[[str], None]
    progress: bool
    checkpoint: Checkpointer
    num_batches: int  # micro-batches of a whole epoch
    steps_per_epoch: int

    def run(self, start: Position) -> list[dict[str, Any]]:
        history = []
        global_step = start.global_step
        for epoch in range(start.epoch, self.cfg.epochs):
            record = self.epoch(epoch, start.batch if epoch == start.epoch else 0, global_step)
            global_step = record["global_step"]
            history.append(record)
        return history

    def epoch(self, epoch: int, skip: int, global_step: int) -> dict[str, Any]:
        """Train epoch ``epoch`` from micro-batch ``skip``; evaluate, record, checkpoint its end."""
        cfg, data, info = self.cfg, self.data, self.info
        data.sampler.set_epoch(epoch)
        if skip and hasattr(data.sampler, "load_state_dict"):
            st = dict(data.sampler.state_dict())
            st.update(epoch=epoch, position=skip * cfg.batch_size)
            data.sampler.load_state_dict(st)
        steps_before = global_step - math.ceil(skip / cfg.accum)
        settings = EpochConfig(
            accum=cfg.accum, num_batches=self.num_batches, start_batch=skip, num_samples=data.sampler.num_samples,
            amp_dtype=self.amp_dtype, device=info.device, clip_grad=cfg.clip_grad, log_every=cfg.log_every,
            progress=self.progress, desc=f"epoch {epoch + 1}/{cfg.epochs}",
        )
        res = train_one_epoch(
            self.model, on_device(data.loader, info.device), self.optimizer, settings, loss_fn=self.loss_fn,
            transform=data.train_tf, batch_transform=data.batch_tf, scheduler=self.scheduler, scaler=self.scaler,
            on_log=lambda entry: self._on_log(entry, epoch, steps_before),
            on_step=lambda s: self._on_step(s, epoch, steps_before),
        )
        record = self._record(epoch, steps_before + self.steps_per_epoch, res)
        self.checkpoint(epoch + 1, 0, record["global_step"])
        return record

    def _on_log(self, entry: dict[str, float], epoch: int, steps_before: int) -> None:
        entry = {"epoch": epoch, "global_step": steps_before + int(entry["step"]), **entry}
        self.metrics.write("train", **entry)
        self.say(f"epoch {epoch + 1}/{self.cfg.epochs} step {int(entry['step'])}/{self.steps_per_epoch}  "
                 f"loss {entry['loss']:.4f}  lr {entry['lr']:.4g}  {entry['img_per_s']:.0f} img/s  "
                 f"data wait {entry['data_wait']:.1%}")

    def _on_step(self, s: StepInfo, epoch: int, steps_before: int) -> None:
        cfg = self.cfg
        step = steps_before + s.step
        if cfg.ckpt_every and step % cfg.ckpt_every == 0 and s.batch < s.num_batches:
            self.checkpoint(epoch, s.batch, step)
        if cfg.stop_after_steps is not None and step >= cfg.stop_after_steps:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(STOP_EXIT_CODE)  # a crash, not a shutdown: nothing else gets written

    def _record(self, epoch: int, global_step: int, res: EpochResult) -> dict[str, Any]:
        """The epoch's record (data-wait share over all ranks, val metrics), written and said."""
        info, data = self.info, self.data
        share = torch.tensor([res.data_wait, res.seconds], dtype=torch.float64, device=info.device)
        all_reduce_sum(share)
        wait_share = float(share[0] / share[1]) if share[1] > 0 else 0.0
        val = {}
        if data.val_loader is not None:
            # Not through DDP: ranks hold unequal val shards, and DDP's forward may sync buffers.
            val = evaluate(self.eval_model, on_device(data.val_loader, info.device), transform=data.eval_tf,
                           amp_dtype=self.amp_dtype, device=info.device, progress=self.progress)
        record = {
            "epoch": epoch, "global_step": global_step, "train_loss": res.loss, "img_per_s": res.img_per_s,
            "data_wait": wait_share, "seconds": res.seconds, "skipped_steps": res.skipped_steps,
            **{f"val_{k}": v for k, v in val.items()},
        }
        self.metrics.write("epoch", **record)
        msg = (f"epoch {epoch + 1}/{self.cfg.epochs} done in {res.seconds:.1f}s: train loss {res.loss:.4f}, "
               f"{res.img_per_s:.0f} img/s, data wait {wait_share:.1%}")
        if val:
            msg += f"; val loss {val['loss']:.4f} top-1 {val['top1']:.1%} top-5 {val['top5']:.1%}"
        self.say(msg)
        return record
