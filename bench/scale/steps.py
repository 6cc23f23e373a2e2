"""The child side of the scale harness: one step per process, its answer one JSON line.

    python -m bench.scale.steps cli imagenet SRC --size 32 ...     # any cachebuild command, in this process
    python -m bench.scale.steps plan SRC JOBS
    python -m bench.scale.steps dask '{"args": [imagenet, SRC, ...], "workers": 2}'
    python -m bench.scale.steps open|first_batch|epoch|sampler '{"cache": ..., ...}'   (bench.scale.loader_steps)

Every answer carries ``seconds`` (the step itself, after this process's imports), ``rss_self_peak`` (this
process's peak resident set: the parent of a build's workers, or a reader) and what the step reports. The
harness adds the process tree's peak RSS/PSS (``bench.children.run_child``) and the process's whole wall
time, imports included: what a user waits for.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import sys
import time
from typing import Any

__all__ = ["main"]


def peak_rss_self() -> int:
    """This process's peak RSS in bytes: VmHWM, which starts again at exec (getrusage's ru_maxrss does not: it
    keeps the forking harness's peak)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds_of_tree() -> float:
    """CPU seconds (user + system) of this process, of its children still alive (a build's loky workers stay
    until exit) and of those it has reaped: what a step cost the machine, whatever else shares it."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # ended between the listing and the read: counted below once reaped
            continue
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + reaped.ru_utime + reaped.ru_stime


def run_cli(args: list[str]) -> dict[str, Any]:
    """A cachebuild command in this process: its exit code, its time, the CPU it and its workers used
    (``cpu_seconds``, imports before the command included: the same at every N) and the tail of its output."""
    from cachebuild.cli import main as cli

    out = io.StringIO()
    t0 = time.perf_counter()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main(args, prog_name="cachebuild", standalone_mode=False)
        except SystemExit as e:
            code = int(e.code or 0)
        except Exception as e:  # click's own errors and ours: the harness records them
            code = getattr(e, "exit_code", 1)
            print(f"{type(e).__name__}: {e}", file=out)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "exit_code": code, "cpu_seconds": cpu_seconds_of_tree(),
            "output": out.getvalue()[-4000:]}


def run_plan(src: str, jobs: int) -> dict[str, Any]:
    """Plan the train split as ``cachebuild imagenet --split train --jobs`` does: list, label, stat and digest
    every file."""
    from cachebuild.sources.imagenet import ImagenetOptions
    from cachebuild.sources.registry import plan_source

    t0 = time.perf_counter()
    (plan,) = plan_source("imagenet", src, ImagenetOptions(split="train"), jobs=jobs)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "count": len(plan), "classes": len(plan.classes)}


def run_dask(args: dict[str, Any]) -> dict[str, Any]:
    """A build through ``--dask-scheduler`` on a LocalCluster of ``workers`` single-threaded worker processes on
    127.0.0.1, started here before the clock."""
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=args["workers"], threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        return run_cli([*args["args"], "--dask-scheduler", cluster.scheduler_address])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    what, rest = argv[0], argv[1:]
    if what == "cli":
        answer = run_cli(rest)
    elif what == "dask":
        answer = run_dask(json.loads(rest[0]))
    elif what == "plan":
        answer = run_plan(rest[0], int(rest[1]))
    else:
        from bench.scale import loader_steps

        answer = loader_steps.STEPS[what](json.loads(rest[0]))
    answer["rss_self_peak"] = peak_rss_self()
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
