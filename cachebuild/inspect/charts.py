"""The report's charts, as PNGs drawn by matplotlib (Agg: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from cachebuild.errors import CacheBuildError

__all__ = ["counts_chart", "histogram_chart", "pyplot"]


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; a one-line error naming the extra when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise CacheBuildError("the report draws its charts with matplotlib: pip install 'cachebuild[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def counts_chart(counts: np.ndarray, classes: Sequence[str], png: Path | IO[bytes]) -> Path | IO[bytes]:
    """Samples per class as bars (class names on the axis when there are few enough to read)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    x = np.arange(len(counts))
    ax.bar(x, counts, width=0.9 if len(counts) < 200 else 1.0, color="#3b6ea8")
    if 0 < len(counts) <= 40:
        ax.set_xticks(x, [str(c) for c in classes], rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("class" if len(counts) <= 40 else "class index")
    ax.set_ylabel("samples")
    ax.set_title(f"samples per class ({len(counts)} classes, {int(counts.sum())} samples)")
    fig.tight_layout()
    fig.savefig(png, dpi=100, format="png")
    plt.close(fig)
    return png


def histogram_chart(hist: np.ndarray, png: Path | IO[bytes]) -> Path | IO[bytes]:
    """Per-channel value histograms (R, G, B) of the statistics' sample."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    total = max(1, int(hist[0].sum()))
    for c, colour in enumerate(("#d62728", "#2ca02c", "#1f77b4")):
        ax.plot(np.arange(256), hist[c] / total, color=colour, label="RGB"[c])
    ax.set_xlabel("stored value (0-255)")
    ax.set_ylabel("fraction of pixels")
    ax.set_xlim(0, 255)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=100, format="png")
    plt.close(fig)
    return png
