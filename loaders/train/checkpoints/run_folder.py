"""The run folder (``--out``): the files a run writes there, refusing one that holds a run, cleaning up.

A run owns exactly :data:`RUN_FILES` (and their temporaries); ``--overwrite`` removes those and nothing
else, and a resume removes only the temporaries whose writer is gone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachebuild.atomic import is_temporary_name, temporary_writer, write_bytes_atomic
from loaders.train.config import TrainConfig, TrainSetupError
from loaders.train.distributed import all_gather_objects

__all__ = [
    "CHECKPOINT_NAME",
    "METRICS_NAME",
    "RUN_FILES",
    "claim_run_folder",
    "remove_dead_temporaries",
    "run_files",
    "write_json",
]

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
