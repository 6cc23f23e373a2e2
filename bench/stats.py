"""Summaries of repeated runs: median with min-max, and ratios between summaries."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["ratio", "summary"]


def summary(runs: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """``{"median", "min", "max", "runs"}`` of the measured runs (warm-ups already left out)."""
    if not runs:
        raise ValueError("summary of no runs")
    vals = [float(v) for v in runs]
    return {"median": round(statistics.median(vals), digits), "min": round(min(vals), digits),
            "max": round(max(vals), digits), "runs": [round(v, digits) for v in vals]}


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """Median of ``a`` over median of ``b`` (None when either is missing)."""
    if not a or not b or not b.get("median"):
        return None
    return round(a["median"] / b["median"], 3)
