"""Every step of one N in the order a user meets them: plan, build, inspect, status, read, pull."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench.scale.runner import Runner

__all__ = ["STEP_NAMES", "run_n"]

STEP_NAMES = ("plan", "build", "info", "verify_quick", "verify", "status", "status_touched", "ls", "open",
              "first_batch_spawn", "first_batch_fork", "epoch", "sampler", "pull")


def run_n(r: Runner, n: int, src: Path) -> tuple[dict[str, Any], Path]:
    """The curve points of ``n`` (built from ``src``); returns them and the output folder (``<out>/train``)."""
    out = r.work / "caches" / f"n{n}"
    shutil.rmtree(out, ignore_errors=True)
    cache = str(out / "train")
    res: dict[str, Any] = {"n": n, "source": str(src)}
    r.log(f"  N = {n:,} ({src})")
    res["plan"] = r.step("plan", "plan", str(src), str(r.jobs))
    res["build"] = r.step("build", *r.build_args(src, out), "-q")
    if "error" in res["build"]:
        return res, out
    res["build"]["img_per_s"] = n / res["build"]["seconds"]
    if "cpu_seconds" in res["build"]:  # the machine's cost per image, which other sessions' load barely moves
        res["build"]["cpu_us_per_img"] = 1e6 * res["build"]["cpu_seconds"] / n
    m = json.loads((out / "train" / "manifest.json").read_text())
    res["build"].update(count=m["count"], shards=len(m["shards"]), failures=len(m.get("failures", [])))
    if m["count"] != n:
        res["build"]["error"] = f"the cache holds {m['count']} samples, the source {n}"
    res["info"] = r.step("info", "cli", "info", cache)
    res["verify_quick"] = r.step("verify_quick", "cli", "verify", "--quick", cache)
    res["verify"] = r.step("verify", "cli", "verify", cache)
    res["status"] = r.step("status", "cli", "status", cache)
    res["status_touched"] = r.touched_status(src, out / "train")
    res["ls"] = r.step("ls", "cli", "ls", str(out))
    arg = json.dumps({"cache": cache})
    res["open"] = r.step("open", "open", arg)
    for ctx in ("spawn", "fork"):
        # spawn's start-up (torch imported in each worker) swings by seconds on a shared box: 5 rounds each
        res[f"first_batch_{ctx}"] = r.step(f"first_batch_{ctx}", "first_batch",
                                           json.dumps({"cache": cache, "context": ctx,
                                                       "rounds": 5 if ctx == "spawn" else 3}))
    res["epoch"] = r.step("epoch", "epoch", arg)
    res["sampler"] = r.step("sampler", "sampler", json.dumps({"cache": cache, "world": 8}))
    res["pull"] = r.pull(out, r.work / "caches" / f"pulled-{n}")
    return res, out
