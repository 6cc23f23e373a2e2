"""One `cachebuild imagenet SRC --size 32 --jobs J` in this fresh process, timed by phase (README.md here).

    PYTHONPATH=WT python bench/results/2026-12-04-vm-scale-flat/phases.py SRC OUT [JOBS] [build flags...]

``total`` is what the scale harness times (``bench.scale.steps.run_cli``: the command after this process's
imports); the phases come from wrappers on the pipeline's functions and a progress bar that records when each
block's result reached the parent. ``steady_rate``: images of the blocks after the first one per worker, over
the time from then to the last block (start-up, torch import and the first blocks left out). ``NOTORCH=1``:
workers keep numpy's antialiased resize whatever the plan's size (the same bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

import psutil

import cachebuild.builder.pipeline as pl
import cachebuild.sources.registry as reg
from cachebuild.cli import main as cli

T: dict[str, float] = {}
done: list[tuple[float, int]] = []


def _timed(mod: Any, name: str) -> None:
    f = getattr(mod, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[name] = T.get(name, 0.0) + time.perf_counter() - t

    setattr(mod, name, wrapper)


class _Bar:
    def __enter__(self) -> _Bar:
        T["bar_enter"] = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        T["bar_exit"] = time.perf_counter()

    def update(self, k: int) -> None:
        done.append((time.perf_counter(), k))


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    jobs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    _timed(pl, "finish")
    _timed(reg, "plan_source")
    pl._progress = lambda *a, **k: _Bar()
    if os.environ.get("NOTORCH"):
        pl.TORCH_RESIZE_FROM = 10**12
    c0, t0 = time.process_time(), time.perf_counter()
    with contextlib.suppress(SystemExit):
        cli.main(["imagenet", src, "--split", "train", "--size", "32", "--out", out, "--jobs", str(jobs),
                  "--no-progress", "-q", *sys.argv[4:]], prog_name="cachebuild", standalone_mode=False)
    total = time.perf_counter() - t0
    parent_cpu = time.process_time() - c0
    workers = [sum(p.cpu_times()[:2]) for p in psutil.Process().children(recursive=True)]
    n = sum(k for _, k in done)
    first = done[min(jobs, len(done)) - 1][0]
    steady_n = sum(k for _, k in done[jobs:])
    print(json.dumps({
        "n": n, "total": total, "rate": n / total, "plan": T["plan_source"],
        "to_pool": T["bar_enter"] - t0 - T["plan_source"], "first_blocks": first - T["bar_enter"],
        "steady": done[-1][0] - first, "steady_rate": steady_n / (done[-1][0] - first) if len(done) > jobs else None,
        "finish": T["finish"], "blocks": len(done), "block_size": done[0][1], "load": os.getloadavg()[0],
        "cpu_parent": parent_cpu, "cpu_workers": [round(c, 2) for c in workers],
        "us_per_img_cpu": 1e6 * (parent_cpu + sum(workers)) / n,
    }))


if __name__ == "__main__":
    main()
