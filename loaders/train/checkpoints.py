"""Checkpoints of a run and the run folder they live in.

A checkpoint holds everything a mid-epoch resume needs (weights, optimizer, schedule, scaler, sampler, every
rank's RNG), written atomically and read with ``weights_only`` and a checksum of its whole content. It also
holds the run's layout (batch size, accumulation, world size, train count) and its options (:func:`run_config`,
with the train cache's build key): a resume continues with them, so ``--resume --out RUN`` alone is enough,
and refuses another value of any option that changes what is trained (``RESUME_KEEPS``) or another cache,
naming each, since the restored weights, optimizer, schedule and RNG belong to the run as it started. A run
owns exactly :data:`RUN_FILES` in ``--out`` (and their temporaries); ``--overwrite`` removes those and nothing
else, a resume only temporaries whose writer is gone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cachebuild.atomic import AtomicFile, is_temporary_name, temporary_writer, write_bytes_atomic
from cachebuild.errors import CacheBuildError
from loaders.train.config import RESUME_KEEPS, RESUME_NOT_CARRIED, TrainConfig, TrainSetupError
from loaders.train.distributed import DistInfo, all_gather_objects
from loaders.train.metrics import drop_records_after

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_NAME", "CHECKPOINT_VERSION", "METRICS_NAME", "RUN_FILES", "SCHEDULE_KEYS",
           "CheckpointError", "Checkpointer", "Position", "capture_rng", "check_checkpoint", "check_resume",
           "claim_run_folder", "load_checkpoint", "read_checkpoint", "remove_dead_temporaries", "restore_model",
           "restore_rng", "restore_run", "resumed_config", "run_config", "run_files", "run_layout", "save_checkpoint",
           "state_digest", "unwrap_model", "write_json"]

CHECKPOINT_FORMAT = "cachebuild-train"
CHECKPOINT_VERSION = 2  # 2: a sha256 of the whole content ("digest"), checked on load


class CheckpointError(CacheBuildError, ValueError):
    """A checkpoint that is missing, unreadable, or made for another model or run layout."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def capture_rng() -> dict[str, Any]:
    """The global torch RNG states (tensors only, so ``weights_only`` loading accepts them)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    model_name: str, num_classes: int, epoch: int, batch: int, global_step: int,
                    scaler: torch.amp.GradScaler | None = None, scheduler: Any | None = None,
                    sampler: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
                    rng: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None,
                    config: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint to ``path`` via a temporary file and a rename (a crash leaves the old one whole):
    training resumes at micro-batch ``batch`` of ``epoch``; ``layout`` holds what a resume must not change;
    ``rng`` every rank's global RNG states (default: this process's), so augmentation draws continue;
    ``config`` the run's options (:func:`run_config`), which a resume continues with."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "model_name": model_name,
        "num_classes": int(num_classes),
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "epoch": int(epoch),
        "batch": int(batch),
        "global_step": int(global_step),
        "sampler": sampler,
        "layout": layout or {},
        "rng": rng if rng is not None else [capture_rng()],
        "extra": extra or {},
        "config": config or {},
    }
    state["digest"] = state_digest(state)
    with AtomicFile(path, durable=True) as f:  # a crash leaves the previous checkpoint whole
        torch.save(state, f.file)
    return path


def state_digest(state: Any) -> str:
    """sha256 over a checkpoint's content in order: every tensor's dtype, shape and bytes, every other
    value's type and repr (dict keys included), the ``digest`` entry itself left out."""
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
        elif isinstance(obj, dict):
            h.update(f"D{len(obj)}".encode())
            for k, v in obj.items():
                if k == "digest" and obj is state:
                    continue
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(obj, list | tuple):
            h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
            for v in obj:
                walk(v)
        else:
            h.update(f"{type(obj).__name__}:{obj!r};".encode())

    walk(state)
    return h.hexdigest()


def load_checkpoint(path: str | os.PathLike[str], *, model_name: str | None = None, num_classes: int | None = None,
                    layout: dict[str, Any] | None = None, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` (no pickled code runs); :class:`CheckpointError`
    when it is missing, not ours, damaged, or made for another model, class count or ``layout``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError... for bad files
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:200]
        raise CheckpointError(f"{path} is not a readable training checkpoint ({type(e).__name__}: {first})") \
            from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint version {state.get('version')!r}, this release reads {CHECKPOINT_VERSION}"
        )
    # torch.load does not check the bytes of tensors: a flipped bit in a weight loads silently.
    saved = state.pop("digest", None)
    if saved != state_digest(state):
        raise CheckpointError(f"{path} is corrupted: its content does not match the checksum saved with it; "
                              f"resume from an intact copy, or start the run afresh (another --out)")
    check_checkpoint(state, path, model_name=model_name, num_classes=num_classes, layout=layout)
    return state


def check_checkpoint(state: dict[str, Any], path: str | os.PathLike[str], *, model_name: str | None = None,
                     num_classes: int | None = None, layout: dict[str, Any] | None = None) -> None:
    """:class:`CheckpointError` when a loaded checkpoint was made for another model, class count or ``layout``."""
    if model_name is not None and state["model_name"] != model_name:
        raise CheckpointError(
            f"{path} holds a {state['model_name']!r} model; this run builds {model_name!r} "
            "(pass the same --model, or another --out)"
        )
    if num_classes is not None and state["num_classes"] != num_classes:
        raise CheckpointError(
            f"{path} was trained for {state['num_classes']} classes; this cache has {num_classes}"
        )
    if layout:
        saved = state.get("layout", {})
        diff = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise CheckpointError(f"{path}: cannot resume with a different layout ({what})")


def restore_model(model: nn.Module, state: dict[str, Any], path: str | os.PathLike[str] = "checkpoint") -> None:
    """Load the weights into ``model`` (under any wrapper), as a :class:`CheckpointError` on mismatch."""
    try:
        unwrap_model(model).load_state_dict(state["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: weights do not fit this model: {' '.join(first[:2])}") from e


# ---------------------------------------------------------------------------- the run folder

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"
# Every file a run writes into --out; --overwrite removes these (and their temporaries), nothing else.
RUN_FILES: tuple[str, ...] = (CHECKPOINT_NAME, METRICS_NAME, "metrics.png", "config.json", "summary.json")


def claim_run_folder(out: Path, cfg: TrainConfig, main: bool) -> list[Path]:
    """For a fresh run (not ``--resume``): refuse an ``out`` that holds a run unless ``--overwrite``; return
    the previous run's files that the caller removes just before its first write (rank 0; [] elsewhere)."""
    if cfg.resume:
        return []
    # Rank 0's view decides for every rank, so that all ranks refuse together (none waits in a collective).
    names: list[str] = all_gather_objects([f.name for f in run_files(out)] if main else None)[0]
    held = [n for n in names if n in RUN_FILES]
    if held and not cfg.overwrite:
        raise TrainSetupError(
            f"{out} already holds a run ({', '.join(held)}): pass --resume to continue it, another --out "
            f"for a new run, or --overwrite to start over (removes only those files)"
        )
    return [out / n for n in names] if main and cfg.overwrite else []


def run_files(out: Path) -> list[Path]:
    """The files of a run in ``out``: :data:`RUN_FILES` and temporaries that a killed write of one left."""
    if not out.is_dir():
        return []
    return [f for f in sorted(out.iterdir()) if f.is_file() and (
        f.name in RUN_FILES
        or (is_temporary_name(f.name) and any(f.name.startswith(f".{name}.") for name in RUN_FILES)))]


def remove_dead_temporaries(out: Path) -> None:
    """Temporaries of the run's files whose writer died (a kill during a checkpoint write leaves a
    checkpoint-sized one each time): removed on resume, so repeated kills do not fill the disk. The name
    carries the writer's pid (``cachebuild.atomic``); a live writer's file is left alone."""
    from cachebuild.processes import pid_alive

    for f in run_files(out):
        writer = temporary_writer(f.name)
        if writer is not None and not pid_alive(writer):
            f.unlink(missing_ok=True)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, default=str) + "\n").encode("utf-8"), durable=False)


# ---------------------------------------------------------------------------- resuming a run

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


def run_config(cfg: TrainConfig, cache_key: str) -> dict[str, Any]:
    """What a checkpoint keeps of its run's options: every field but those a resume never carries over, and the
    build key of the train cache (another cache of the same size is another run)."""
    return {**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in RESUME_NOT_CARRIED},
            "train_cache": cache_key}


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint ``--resume`` continues from (checked by :func:`check_resume` once the run is set up)."""
    if not path.is_file():
        raise TrainSetupError(f"--resume: no checkpoint at {path}")
    return load_checkpoint(path)


def resumed_config(cfg: TrainConfig, state: dict[str, Any], path: Path,
                   given: Collection[str] | None = None) -> TrainConfig:
    """``cfg`` as the run in ``state`` continues: the options not in ``given`` are the run's; a given option
    of :data:`RESUME_KEEPS` with another value than the run's is refused, naming each. ``given`` None: every
    option when ``cfg`` names its cache, else those that differ from their defaults (a caller of ``fit``
    that leaves the cache out means the run's)."""
    saved = state.get("config") or {}
    if given is None:
        given = {f.name for f in dataclasses.fields(cfg)} if cfg.train is not None else {
            f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}
    if not saved:
        if cfg.train is None:
            raise CheckpointError(f"{path} was written by an earlier release and holds no options: name CACHE and "
                                  f"pass the run's options")
        return cfg
    if "model" in given:
        check_checkpoint(state, path, model_name=cfg.model)  # its own words: weights of another model
    changed = [f"{k}: checkpoint {saved[k]!r} vs now {getattr(cfg, k)!r}" for k in RESUME_KEEPS
               if k in given and k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        raise CheckpointError(
            f"{path}: cannot resume with other training options ({', '.join(changed)}): a resumed run trains with "
            f"the options it started with; leave them out (the run's are used) or pass the run's values, or start "
            f"over (another --out, or --overwrite)")
    names = {f.name for f in dataclasses.fields(cfg)}
    carried = {k: v for k, v in saved.items() if k in names and k not in given and k not in RESUME_NOT_CARRIED}
    return dataclasses.replace(cfg, **carried)


def check_resume(state: dict[str, Any], path: Path, cfg: TrainConfig, num_classes: int, layout: dict[str, Any],
                 cache_key: str) -> None:
    """The checkpoint against this run as set up: its model, class count, layout and train cache (a checkpoint
    of an earlier release, without its options, against the optimizer and schedule it holds)."""
    check_checkpoint(state, path, model_name=cfg.model, num_classes=num_classes, layout=layout)
    saved_cache = (state.get("config") or {}).get("train_cache")
    if saved_cache is not None and saved_cache != cache_key:
        raise CheckpointError(
            f"{cfg.train} is not the cache this run trained on (its build key {cache_key[:12]}, the run's "
            f"{saved_cache[:12]}, from {state['config'].get('train')}): pass the run's cache, or start over "
            f"(another --out, or --overwrite)")
    saved = state.get("layout", {})
    diff = [f"{k}: checkpoint {saved[k]!r} vs now {v!r}" for k, v in _schedule(cfg).items()
            if k in saved and saved[k] != v]  # what the options of an earlier release's checkpoint hold
    if diff:
        raise CheckpointError(
            f"{path}: cannot resume with other training options ({', '.join(diff)}): a resumed run trains with "
            f"the optimizer and LR schedule it started with; pass its values, or start over (another --out, or "
            f"--overwrite)")


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
    cache_key: str  # the train cache's build key

    def __call__(self, epoch: int, batch: int, step: int) -> None:
        rng = all_gather_objects(capture_rng())  # every rank's RNG state, so each resumes its own draws
        if not self.main:
            return
        sampler_state = dict(self.sampler.state_dict()) if hasattr(self.sampler, "state_dict") else {}
        sampler_state.update(epoch=epoch, position=batch * self.cfg.batch_size)
        save_checkpoint(self.path, model=self.model, optimizer=self.optimizer, model_name=self.cfg.model,
                        num_classes=self.num_classes, epoch=epoch, batch=batch, global_step=step,
                        scaler=self.scaler, scheduler=self.scheduler, sampler=_plain(sampler_state),
                        layout={**self.layout, **_schedule(self.cfg)}, rng=rng,
                        config=run_config(self.cfg, self.cache_key))


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """Sampler state as plain Python numbers (``weights_only`` loading refuses numpy scalars)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "item") and not isinstance(v, torch.Tensor):
            v = v.item()
        out[k] = v
    return out
