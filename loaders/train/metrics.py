"""Run metrics: one JSON object per line (append-only, survives a resume), and a PNG of loss and accuracy.

The PNG needs matplotlib, an optional extra (``cachebuild[plots]``); without it a run trains and logs as
before and says, in one line, what the PNG needs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from cachebuild.atomic import write_bytes_atomic
from cachebuild.errors import CacheBuildError

__all__ = ["MetricsWriter", "PlotsUnavailableError", "drop_records_after", "plot_metrics", "pyplot", "read_metrics"]


class PlotsUnavailableError(CacheBuildError, ImportError):
    """A plot was asked for and matplotlib (the ``plots`` extra) is not installed."""


def pyplot(what: str = "metrics.png") -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend (training nodes have no display);
    :class:`PlotsUnavailableError` naming ``what`` and the extra when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailableError(f"{what} needs matplotlib: pip install 'cachebuild[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class MetricsWriter:
    """Appends records to a JSON-lines file; disabled writers (ranks other than 0) drop everything.

    Each record is flushed at once, so a killed run keeps what it logged; a resumed run appends, once
    :func:`drop_records_after` has removed what was logged after its checkpoint.
    """

    def __init__(self, path: str | os.PathLike[str], enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, **{k: _jsonable(v) for k, v in fields.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=False) + "\n")


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file (a torn last line from a hard kill is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def drop_records_after(path: str | os.PathLike[str], global_step: int) -> int:
    """Rewrite a metrics file without its records past optimizer step ``global_step`` and its torn lines.

    For a resume from a checkpoint of that step: the steps after it are trained and logged again, and
    a line torn by a kill would swallow the first record appended to it. Returns the lines dropped.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("global_step") if isinstance(record, dict) else None
        if isinstance(step, int) and step > global_step:
            continue
        keep.append(line)
    if len(keep) < len(lines) or (text and not text.endswith("\n")):
        write_bytes_atomic(path, "".join(f"{line}\n" for line in keep).encode("utf-8"), durable=False)
    return len(lines) - len(keep)


def plot_metrics(metrics: str | os.PathLike[str], png: str | os.PathLike[str]) -> Path:
    """Training loss per logged step (left) and val top-1 / top-5 per epoch (right), as a PNG."""
    plt = pyplot(Path(png).name)
    records = read_metrics(metrics)
    train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        ax_loss.plot([r["global_step"] for r in train], [r["loss"] for r in train], label="train loss")
    val_loss = [(r["global_step"], r["val_loss"]) for r in epochs if r.get("val_loss") is not None]
    if val_loss:  # at the optimizer step where each epoch ended
        ax_loss.plot(*zip(*val_loss, strict=True), "o-", label="val loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    if ax_loss.lines:
        ax_loss.legend(loc="upper right")
    for key, label in (("val_top1", "val top-1"), ("val_top5", "val top-5"), ("train_top1", "train top-1")):
        pts = [(r["epoch"] + 1, r[key]) for r in epochs if r.get(key) is not None]
        if pts:
            ax_acc.plot(*zip(*pts, strict=True), "o-", label=label)
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.set_title("accuracy")
    if ax_acc.lines:
        ax_acc.legend(loc="lower right")
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png

