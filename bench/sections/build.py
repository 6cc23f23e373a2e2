"""Build section: the same source JPEGs -> a cache, every contender in its own process, in rounds.

Each round runs every contender once, in the same order, each on a synced disk (``os.sync()`` first,
so nobody pays another's writeback) and with the source files in the page cache (read once before).
Timed, in the rows the tables have always had: the build alone; imports, the plan and the worker pool's
start-up come before the clock (said in the results). The two "whole process" rows time what a user's
``time cachebuild imagenet SRC --size S --jobs J`` does, against a bare decoder timed the same way: each a fresh
process from its start to its exit (interpreter, imports, the plan, fresh workers' start-up); the build goal is
read from them. The bare decoder decodes each JPEG at the DCT scale the build decodes it at (``scales_file``).
Peak memory of the contender's whole process tree (imports included), sampled every 50 ms:
RSS summed (counts shared libraries once per process) and PSS summed (the real footprint). Ratios to the limit
(bare ``cv2.imdecode`` with the same process count) are taken within each round, then the median.
The last round's outputs are kept for the load and train sections.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import peers
from bench.children import ChildError, run_child
from bench.data import dir_bytes
from bench.stats import summary

__all__ = ["BuildContender", "run_build"]


@dataclass(frozen=True)
class BuildContender:
    key: str
    label: str
    command: Callable[[Path], list[str]]  # output folder -> command line
    images: int  # images it builds (its rate is per image)
    rounds: int  # rounds it runs (peers may run fewer: their start-up is long)


def _procs(n: int) -> str:
    return f"{n} process" + ("es" if n != 1 else "")


def own_contenders(src: Path, n: int, size: int, jobs: int, rounds: int, scales: Path,
                   goal: tuple[Path, int, Path] | None = None) -> list[BuildContender]:
    """Our rows and the bare decoder's. ``goal``: (source tree, its file count, its scales file) for the two
    whole-process rows, when they run on another set than the rest (``goal_n`` of the profile)."""
    def child(name: str, source: Path, *extra: str) -> Callable[[Path], list[str]]:
        return lambda out: [sys.executable, "-m", "bench.sections.build_child", name, "--src", str(source),
                            "--out", str(out), "--size", str(size), "--jobs", str(jobs), *extra]

    bare = ("--scales", str(scales))
    goal_src, goal_n, goal_scales = goal if goal is not None else (src, n, scales)
    on = "" if goal_n == n else f", {goal_n:,} photos"
    return [
        BuildContender("bare_decode", f"bare cv2.imdecode at the build's DCT scale, {_procs(jobs)} (the limit)",
                       child("bare_decode", src, *bare), n, rounds),
        BuildContender("bare_decode_process", f"bare cv2.imdecode at the build's DCT scale, {_procs(jobs)}, whole "
                       f"process{on} (the limit)",
                       child("bare_decode", goal_src, "--scales", str(goal_scales), "--whole-process"), goal_n,
                       rounds),
        BuildContender("cachebuild_npy_process", f"`cachebuild imagenet --size S --jobs {jobs}`, whole process{on}",
                       child("cachebuild_npy", goal_src, "--whole-process"), goal_n, rounds),
        BuildContender("naive_npy", "naive npy cache: 1 process imread+resize+np.save", child("naive_npy", src), n,
                       rounds),
        # --jobs, not processes: a local build runs its blocks in threads (builder.pipeline._prefer)
        BuildContender("cachebuild_npy", f"cachebuild npy, --jobs {jobs}", child("cachebuild_npy", src), n, rounds),
        BuildContender("cachebuild_zarr", f"cachebuild zarr, {_procs(jobs)}", child("cachebuild_zarr", src), n,
                       rounds),
        BuildContender("cachebuild_jpeg", f"cachebuild jpeg (compact, q90), --jobs {jobs}",
                       child("cachebuild_jpeg", src), n, rounds),
    ]


def _source_stats(src: Path) -> dict[str, Any]:
    from PIL import Image

    files = [f for f in src.rglob("*") if f.is_file()]
    hw = []
    for f in files:
        with Image.open(f) as im:
            hw.append((im.height, im.width))
    total = sum(f.stat().st_size for f in files)
    return {"source_mb": round(total / 1e6, 1), "source_mean_kb": round(total / 1e3 / len(files), 1),
            "source_mean_hw": [round(sum(h for h, _ in hw) / len(hw)), round(sum(w for _, w in hw) / len(hw))]}


def run_build(cfg: dict[str, Any], work: Path, src: Path, files_json: Path, log: Callable[[str], None],
              goal_src: Path | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Returns (the section's results, {contender key: its last output}). ``goal_src``: the tree of
    ``cfg["goal_n"]`` files the two whole-process rows build, where that is not ``src``."""
    n, size, jobs, rounds = cfg["n"], cfg["size"], cfg["jobs"], cfg["rounds"]
    from bench.sections.build_child import scales_file

    goal = None
    if goal_src is not None and goal_src != src:
        goal = (goal_src, cfg["goal_n"], scales_file(goal_src, size, work / f"decode-scales-{cfg['goal_n']}.json"))
    contenders = own_contenders(src, n, size, jobs, rounds, scales_file(src, size, work / "decode-scales.json"),
                                goal)
    skipped: dict[str, str] = {}
    for p in peers.build_contenders(cfg, files_json, skipped):
        contenders.append(BuildContender(p["key"], p["label"], p["command"], n, min(rounds, cfg["peer_rounds"])))
    for f in [*src.rglob("*"), *(goal[0].rglob("*") if goal else ())]:  # the sources in the page cache for everyone
        if f.is_file():
            f.read_bytes()
    out_root = work / "build-out"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir(parents=True)
    runs: dict[str, dict[str, list[float]]] = {c.key: {k: [] for k in ("img_s", "mb_s", "rss", "pss")}
                                               for c in contenders}
    disk: dict[str, int] = {}
    failed: dict[str, str] = {}
    outputs: dict[str, Path] = {}
    for r in range(rounds):
        log(f"build round {r + 1}/{rounds}")
        for c in contenders:
            if c.key in failed or r >= c.rounds:
                continue
            out = out_root / f"{c.key}-{r}"
            os.sync()
            try:
                ans, mem = run_child(c.command(out), timeout=cfg["child_timeout"])
            except ChildError as e:
                failed[c.key] = str(e).splitlines()[0]
                log(f"  {c.key}: FAILED {e}")
                continue
            sec = ans["seconds"]
            runs[c.key]["img_s"].append(c.images / sec)
            runs[c.key]["mb_s"].append(ans.get("bytes_written", 0) / 1e6 / sec)
            runs[c.key]["rss"].append(mem["rss"] / 1e6)
            runs[c.key]["pss"].append(mem["pss"] / 1e6)
            log(f"  {c.key:24s} {c.images / sec:8.0f} img/s  peak memory {mem['pss'] / 1e6:6.0f} MB (PSS)")
            if out.exists():
                disk[c.key] = dir_bytes(out)
                if r == c.rounds - 1:
                    outputs[c.key] = out
                else:
                    shutil.rmtree(out)
    rows: dict[str, Any] = {}
    for c in contenders:
        v = runs[c.key]
        if not v["img_s"]:
            continue
        # a whole-process row against the whole-process limit, every other row against the timed-part limit
        whole = c.key.endswith("_process")
        limit = runs.get("bare_decode_process" if whole else "bare_decode", {}).get("img_s", [])
        row = {"label": c.label, "images": c.images, "img_s": summary(v["img_s"], 1), "mb_s": summary(v["mb_s"], 1),
               "peak_rss_mb": summary(v["rss"], 1), "peak_pss_mb": summary(v["pss"], 1),
               "bytes_on_disk": disk.get(c.key)}
        if limit and not c.key.startswith("bare_decode"):  # within each round it ran
            row["x_bare_decode"] = summary([a / b for a, b in zip(v["img_s"], limit, strict=False)], 3)
        rows[c.key] = row
    naive = runs.get("naive_npy", {}).get("img_s", [])
    for key in ("cachebuild_npy", "cachebuild_zarr"):
        if key in rows and naive and len(naive) == len(runs[key]["img_s"]):
            rows[key]["x_naive"] = summary([a / b for a, b in zip(runs[key]["img_s"], naive, strict=True)], 3)
    result = {"contenders": rows, "failed": failed, "skipped": skipped, "images": n,
              "whole_process_images": goal[1] if goal else n, "size": size, "jobs": jobs,
              "rounds": rounds, **_source_stats(src)}
    return result, outputs
