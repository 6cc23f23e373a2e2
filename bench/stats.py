"""Summaries of repeated runs: median with min-max, and ratios between summaries."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["format_ratio", "format_summary", "ratio", "summary"]


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


def format_summary(s: dict[str, Any] | None, fmt: str = "{:,.0f}") -> str:
    """A summary as the tables write it: "median (min-max)"; "-" for none."""
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def format_ratio(v: float | None) -> str:
    """A ratio as the tables write it: "1.49x"; "-" for none."""
    return "-" if v is None else f"{v:.2f}x"
