"""Training checkpoints: everything a mid-epoch resume needs, written atomically, read with ``weights_only``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cachebuild.atomic import AtomicFile
from cachebuild.errors import CacheBuildError

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "capture_rng",
    "load_checkpoint",
    "restore_model",
    "restore_rng",
    "save_checkpoint",
    "state_digest",
    "unwrap_model",
]

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


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_name: str,
    num_classes: int,
    epoch: int,
    batch: int,
    global_step: int,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any | None = None,
    sampler: dict[str, Any] | None = None,
    layout: dict[str, Any] | None = None,
    rng: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint to ``path`` via a temporary file and a rename: a crash leaves the old one whole.

    ``epoch``/``batch`` say where training resumes (micro-batch ``batch`` of ``epoch``); ``layout``
    holds the settings a mid-epoch resume must not change (batch size, accumulation, world size);
    ``rng`` the global RNG states of every rank (default: this process's), so augmentation draws
    continue where they stopped.
    """
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


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model_name: str | None = None,
    num_classes: int | None = None,
    layout: dict[str, Any] | None = None,
    map_location: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` (no pickled code runs) and check it fits.

    Raises :class:`CheckpointError` when the file is missing or not ours, or when it was made for
    another model, class count, or (for ``layout``) batch size / accumulation / world size.
    """
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
    return state


def restore_model(model: nn.Module, state: dict[str, Any], path: str | os.PathLike[str] = "checkpoint") -> None:
    """Load the weights into ``model`` (under any wrapper), as a :class:`CheckpointError` on mismatch."""
    try:
        unwrap_model(model).load_state_dict(state["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: weights do not fit this model: {' '.join(first[:2])}") from e
