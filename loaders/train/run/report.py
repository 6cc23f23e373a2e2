"""What a run says and writes about itself: ``config.json`` (settings and resolved values), the lines at its
start, ``summary.json`` and the closing lines."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loaders.train.checkpoints.resume import Position
from loaders.train.checkpoints.run_folder import CHECKPOINT_NAME, METRICS_NAME, write_json
from loaders.train.config import TrainConfig
from loaders.train.data import TrainData
from loaders.train.distributed import DistInfo
from loaders.train.metrics import PlotsUnavailableError, plot_metrics

__all__ = ["resolved_config", "say_start", "summarize", "write_summary"]

Say = Callable[[str], None]


def resolved_config(cfg: TrainConfig, info: DistInfo, data: TrainData, amp_dtype: torch.dtype | None,
                    num_batches: int, steps_per_epoch: int, n_params: int) -> dict[str, Any]:
    """``config.json``: every field of ``cfg`` and, under ``resolved``, what ``auto`` and the caches made of it."""
    return {
        **dataclasses.asdict(cfg),
        "resolved": {
            "device": str(info.device), "world_size": info.world_size,
            "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else "off",
            "num_classes": len(data.classes), "image_shape": list(data.shape), "augment": data.augment,
            "crop": data.crop, "loader": data.loader_kind, "train_count": len(data.train_ds),
            "val_count": len(data.val_ds) if data.val_ds is not None else 0,
            "batches_per_epoch": num_batches, "steps_per_epoch": steps_per_epoch,
            "global_batch": cfg.batch_size * cfg.accum * info.world_size, "params": n_params,
        },
    }


def say_start(say: Say, cfg: TrainConfig, info: DistInfo, data: TrainData, resolved: dict[str, Any],
              resumed: Position | None) -> None:
    r = resolved["resolved"]
    say(f"train {cfg.train}: {r['train_count']} images {data.shape[0]}x{data.shape[1]}, "
        f"{r['num_classes']} classes; val {cfg.val or '-'} ({r['val_count']} images)")
    say(f"model {cfg.model} ({r['params'] / 1e6:.2f} M params) on {info.device} x {info.world_size} process(es), "
        f"amp {r['amp_dtype']}, batch {cfg.batch_size} x accum {cfg.accum} x {info.world_size} = "
        f"{r['global_batch']}, {r['steps_per_epoch']} steps/epoch, augment {data.augment} @ {data.crop}px, "
        f"loader {data.loader_kind} x {cfg.workers}")
    for note in data.notes:
        say(note)
    if resumed is not None:
        say(f"resumed from {Path(cfg.out) / CHECKPOINT_NAME}: epoch {resumed.epoch + 1}, micro-batch "
            f"{resumed.batch}/{r['batches_per_epoch']}, step {resumed.global_step}")


def summarize(cfg: TrainConfig, info: DistInfo, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary ``fit`` returns: the last epoch's record and the means over the epochs trained."""
    return {
        "cache": cfg.train, "val": cfg.val, "out": str(Path(cfg.out)), "model": cfg.model,
        "device": str(info.device), "world_size": info.world_size, "epochs_run": len(history),
        **(history[-1] if history else {}),
        "mean_img_per_s": _mean([h["img_per_s"] for h in history]),
        "mean_data_wait": _mean([h["data_wait"] for h in history]),
    }


def write_summary(say: Say, cfg: TrainConfig, info: DistInfo, summary: dict[str, Any]) -> None:
    """Rank 0: ``metrics.png``, ``summary.json`` and the closing lines."""
    out = Path(cfg.out)
    png = None
    if (out / METRICS_NAME).is_file():
        try:
            png = plot_metrics(out / METRICS_NAME, out / "metrics.png")
        except PlotsUnavailableError as e:  # the run itself is done: say what the picture needs, go on
            say(str(e))
    write_json(out / "summary.json", summary)
    say("")
    say(f"cache       {cfg.train}" + (f"  (val {cfg.val})" if cfg.val else ""))
    if summary["epochs_run"]:
        say(f"throughput  {summary['img_per_s']:.0f} img/s last epoch "
            f"({summary['mean_img_per_s']:.0f} mean), {info.world_size} process(es) on {info.device}")
        say(f"data wait   {summary['data_wait']:.1%} of step time last epoch "
            f"({summary['mean_data_wait']:.1%} mean)")
        if "val_top1" in summary:
            say(f"accuracy    val top-1 {summary['val_top1']:.1%}  top-5 {summary['val_top5']:.1%}  "
                f"(loss {summary['val_loss']:.4f}, epoch {summary['epoch'] + 1})")
        else:
            say(f"loss        train {summary['train_loss']:.4f} (no --val cache given)")
    else:
        say("nothing to do: the checkpoint is already past the last epoch")
    say(f"run         {out}: {CHECKPOINT_NAME}, metrics.jsonl, {png.name if png else '-'}, config.json")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
