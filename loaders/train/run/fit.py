"""A whole run: cache -> sampler -> DataLoader -> device -> transforms -> model, epochs, checkpoints, metrics.

``fit(TrainConfig(...))`` is what ``cachebuild train`` and ``python -m loaders.train`` call; under
``torchrun`` every process calls it and joins the process group from the environment. The parts live
beside it: the settings (``config``), the run folder (``run_folder``), the data (``data``), resuming
and checkpoints (``resume``), the epoch loop (``epochs``) and what the run reports (``report``).
"""

from __future__ import annotations

import gc
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loaders.batch_ring import drop_dead_rings
from loaders.train.checkpoints.resume import Checkpointer, Position, read_checkpoint, restore_run, run_layout
from loaders.train.checkpoints.run_folder import CHECKPOINT_NAME, METRICS_NAME, RUN_FILES, claim_run_folder, write_json
from loaders.train.config import AUGMENTS, IN_MEMORY, LOADERS, OPTIMIZERS, TrainConfig, TrainSetupError
from loaders.train.data import TrainData, build_data, transforms_for
from loaders.train.distributed import DistInfo, cleanup_distributed, init_distributed
from loaders.train.loop.amp import make_scaler, resolve_amp
from loaders.train.loop.optim import WarmupCosine, build_optimizer, build_scheduler
from loaders.train.loop.step import num_optimizer_steps
from loaders.train.metrics import MetricsWriter
from loaders.train.models import build_model
from loaders.train.run.epochs import STOP_EXIT_CODE, EpochLoop
from loaders.train.run.report import resolved_config, say_start, summarize, write_summary

__all__ = [
    "AUGMENTS",
    "IN_MEMORY",
    "LOADERS",
    "OPTIMIZERS",
    "RUN_FILES",
    "STOP_EXIT_CODE",
    "TrainConfig",
    "TrainSetupError",
    "WarmupCosine",
    "build_optimizer",
    "build_scheduler",
    "fit",
    "transforms_for",
]


def fit(cfg: TrainConfig, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the summary that rank 0 prints (also on other ranks).

    Raises :class:`TrainSetupError`, :class:`~loaders.train.checkpoints.state.CheckpointError`,
    :class:`~loaders.train.loop.amp.AmpUnsupportedError` or a cache error before the first step when the
    inputs do not fit together.
    """
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    info = init_distributed(cfg.device)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return _fit(cfg, info, echo or _default_echo)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)  # fit() may run inside a larger program
        cleanup_distributed()
        # The DataLoader's workers are shut down once it is collected; then unmap their batch rings,
        # which the main process would otherwise keep until another DataLoader's workers register.
        gc.collect()
        drop_dead_rings()


def _default_echo(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stdout)


def _fit(cfg: TrainConfig, info: DistInfo, echo: Callable[[str], None]) -> dict[str, Any]:
    main = info.is_main
    say = echo if main else (lambda _msg: None)
    amp_dtype = resolve_amp(cfg.amp, info.device)
    out = Path(cfg.out)
    stale = claim_run_folder(out, cfg, main)  # --overwrite: removed just before the first write
    _set_determinism(cfg, info)

    data = build_data(cfg, info)
    ckpt_path = out / CHECKPOINT_NAME
    data.sampler.set_epoch(0)
    num_batches = math.ceil(data.sampler.num_samples / cfg.batch_size)  # the whole epoch, not what is left
    steps_per_epoch = num_optimizer_steps(num_batches, cfg.accum)
    layout = run_layout(cfg, info, len(data.train_ds))
    state = read_checkpoint(ckpt_path, cfg, len(data.classes), layout) if cfg.resume else None

    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model = build_model(cfg.model, len(data.classes), image_size=data.crop).to(info.device)
    optimizer = build_optimizer(raw_model, cfg)
    scheduler = build_scheduler(optimizer, steps_per_epoch, cfg)
    scaler = make_scaler(amp_dtype, info.device)
    torch.manual_seed(cfg.seed + 1_000_003 * info.rank)  # augmentation draws differ between ranks
    start = Position()
    if state is not None:
        start = restore_run(state, ckpt_path, raw_model, optimizer, scheduler, scaler, info)

    eval_model: nn.Module = torch.compile(raw_model) if cfg.compile else raw_model  # type: ignore[assignment]
    model = eval_model
    if info.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            eval_model, device_ids=[info.device.index] if info.device.type == "cuda" else None
        )
    loss_fn = loss_function(cfg, data)
    for f in stale:
        f.unlink(missing_ok=True)
    metrics = MetricsWriter(out / METRICS_NAME, enabled=main)
    progress = cfg.progress if cfg.progress is not None else (main and sys.stderr.isatty())
    n_params = sum(p.numel() for p in raw_model.parameters())
    resolved = resolved_config(cfg, info, data, amp_dtype, num_batches, steps_per_epoch, n_params)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", resolved)
    say_start(say, cfg, info, data, resolved, start if state is not None else None)

    checkpoint = Checkpointer(ckpt_path, cfg, main, model, optimizer, scheduler, scaler, data.sampler,
                              len(data.classes), layout)
    loop = EpochLoop(cfg, info, data, model, eval_model, optimizer, scheduler, scaler, loss_fn, amp_dtype,
                     metrics, say, progress, checkpoint, num_batches, steps_per_epoch)
    summary = summarize(cfg, info, loop.run(start))
    if main:
        write_summary(say, cfg, info, summary)
    return summary


def loss_function(cfg: TrainConfig, data: TrainData) -> nn.CrossEntropyLoss:
    """Cross-entropy with the run's label smoothing, taking soft (N, C) targets too; a mixed batch's targets
    are already smoothed by the mix (``data.mixing``), so then the loss smooths nothing."""
    return nn.CrossEntropyLoss(label_smoothing=0.0 if data.batch_tf is not None else cfg.label_smoothing)


def _set_determinism(cfg: TrainConfig, info: DistInfo) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif info.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
