"""The whole-count checks beside the curves: a build SIGKILLed at ~70% and resumed, the flat val with its
devkit ground truth, and the same build on a 2-worker Dask ``LocalCluster``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.scale.runner import ROOT, Runner, cache_checksums

__all__ = ["dask_build", "kill_and_resume", "val_build"]

_RESUMED = re.compile(r"resuming .*: (\d+) of (\d+) blocks already built")


def _blocks(staging: Path) -> tuple[int, int]:
    """(blocks begun: a shard file or its temporary exists, blocks recorded as finished)."""
    try:
        names = os.listdir(staging)
        recorded = sum(n.endswith(".json") for n in os.listdir(staging / "blocks"))  # not a record being written
    except FileNotFoundError:
        return 0, 0
    begun = {n.split(".")[0] for n in names if n.startswith("images-")}
    return len(begun), recorded


def kill_and_resume(r: Runner, src: Path, reference: Path, total_blocks: int, at: float = 0.7) -> dict[str, Any]:
    """SIGKILL the build's process group once ``at`` of its blocks are recorded, rerun it, and compare with the
    uninterrupted build at ``reference`` (its ``train`` cache)."""
    out = r.work / "caches" / "killed"
    shutil.rmtree(out, ignore_errors=True)
    staging = out / "train.partial"
    cmd = [sys.executable, "-m", "bench.scale.steps", *r.build_args(src, out), "-q"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=r.env, cwd=str(ROOT), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    want = max(1, round(at * total_blocks))
    while proc.poll() is None and _blocks(staging)[1] < want and time.perf_counter() - t0 < r.timeout:
        time.sleep(0.05)
    if proc.poll() is not None:
        return {"error": f"the build ended (exit {proc.returncode}) before {want} of {total_blocks} blocks were done"}
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_after = time.perf_counter() - t0
    time.sleep(0.5)  # the workers of the killed group are gone too
    begun, recorded = _blocks(staging)
    r.log(f"    killed after {killed_after:.1f} s: {recorded} of {total_blocks} blocks recorded, {begun} begun")
    res = r.step("resume", *r.build_args(src, out))  # not -q: its log says how many blocks it kept
    m = _RESUMED.search(res.get("output", ""))
    kept = int(m.group(1)) if m else 0
    res.update(killed_after=killed_after, blocks_total=total_blocks, blocks_recorded_at_kill=recorded,
               blocks_begun_at_kill=begun, blocks_kept=kept, blocks_redone=begun - kept,
               checksums_equal=out.joinpath("train", "manifest.json").is_file()
               and cache_checksums(out / "train") == cache_checksums(reference / "train"))
    st = r.step("status_after_resume", "cli", "status", str(out / "train"))
    res["status_after"] = "up to date" if st.get("exit_code") == 0 and "error" not in st else st.get("output", "")
    if m is None and "error" not in res:
        res["error"] = "the resumed build did not say it resumed"
    shutil.rmtree(out, ignore_errors=True)
    return res


def val_build(r: Runner, full: Path, train_cache: Path) -> dict[str, Any]:
    """The flat 50k val (devkit ground truth) built into the classes of the train cache, in the same order."""
    out = r.work / "caches" / "val"
    shutil.rmtree(out, ignore_errors=True)
    res = r.step("val_build", *r.build_args(full, out, "val"), "-q")
    if "error" in res:
        return res
    val_m = json.loads((out / "val" / "manifest.json").read_text())
    train_m = json.loads((train_cache / "manifest.json").read_text())
    res.update(count=val_m["count"], classes=len(val_m["classes"]),
               same_classes=val_m["classes"] == train_m["classes"], img_per_s=val_m["count"] / res["seconds"])
    shutil.rmtree(out, ignore_errors=True)
    return res


def dask_build(r: Runner, src: Path, reference: Path, n: int) -> dict[str, Any]:
    """The same build through ``--dask-scheduler`` on a 2-worker LocalCluster on 127.0.0.1 (started in the
    step's process; its workers are that process's children, so the tree's memory counts them), between two
    joblib builds of the same tree (joblib, Dask, joblib): single builds minutes apart swung 80-200 s on the
    shared box, so Dask is compared with the joblib builds beside it (``joblib_img_per_s``: their mean)."""
    out = r.work / "caches" / "dask"
    joblib_rates: list[float] = []

    def joblib_build() -> None:
        shutil.rmtree(out, ignore_errors=True)
        got = r.step("joblib_beside", *r.build_args(src, out), "-q")
        if "error" not in got:
            joblib_rates.append(n / got["seconds"])

    joblib_build()
    shutil.rmtree(out, ignore_errors=True)
    res = r.step("dask_build", "dask", json.dumps({"args": [*r.build_args(src, out)[1:], "-q"],
                                                   "workers": r.jobs}))
    if "error" not in res:
        res.update(img_per_s=n / res["seconds"],
                   checksums_equal=cache_checksums(out / "train") == cache_checksums(reference / "train"))
    joblib_build()
    res["joblib_img_per_s_rounds"] = joblib_rates
    res["joblib_img_per_s"] = sum(joblib_rates) / len(joblib_rates) if joblib_rates else None
    shutil.rmtree(out, ignore_errors=True)
    return res
