"""Build section: the same source JPEGs -> a cache, every contender in its own process, in rounds.

Each round runs every contender once, in the same order, each on a synced disk (``os.sync()`` first,
so nobody pays another's writeback) and with the source files in the page cache (read once before).
Timed, in the rows the tables have always had: the build alone; imports, the plan and the worker pool's
start-up come before the clock (said in the results). The "whole process" rows time what a user's
``time cachebuild imagenet SRC --size S --jobs J`` does, against a bare decoder timed the same way: each a fresh
process from its start to its exit (interpreter, imports, the plan, fresh workers' start-up), on two sets of
the same photos, ``steady_n`` and a subset of ``steady_base`` of them. The difference of the two runs of one
contender leaves its start-up out: ``(steady_n - steady_base) / (t_big - t_base)`` is its steady-state rate,
what a user waits for at ImageNet's count; the build goal is the ratio of the two steady rates within each
round, then the median. The bare decoder decodes each JPEG at the DCT scale the build decodes it at
(``scales_file``). Each round runs the contenders in another order (rotated), so no one always goes first.
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
                   steady: tuple[tuple[Path, int, Path], tuple[Path, int, Path]] | None = None
                   ) -> list[BuildContender]:
    """Our rows and the bare decoder's. ``steady``: ((tree, files, scales file) of the base set, of the big
    set) for the whole-process rows, whose difference is the steady state; without it they run on ``src``."""
    def child(name: str, source: Path, *extra: str) -> Callable[[Path], list[str]]:
        return lambda out: [sys.executable, "-m", "bench.sections.build_child", name, "--src", str(source),
                            "--out", str(out), "--size", str(size), "--jobs", str(jobs), *extra]

    rows = [
        BuildContender("bare_decode", f"bare cv2.imdecode at the build's DCT scale, {_procs(jobs)} (the limit)",
                       child("bare_decode", src, "--scales", str(scales)), n, rounds),
    ]
    for suffix, (tree, files, tree_scales) in zip(("_base", ""), steady or ((src, n, scales), (src, n, scales)),
                                                  strict=True):
        on = f", whole process, {files:,} photos"
        rows += [
            BuildContender(f"bare_decode_process{suffix}", f"bare cv2.imdecode at the build's DCT scale, "
                           f"{_procs(jobs)}{on} (the limit)",
                           child("bare_decode", tree, "--scales", str(tree_scales), "--whole-process"), files, rounds),
            BuildContender(f"cachebuild_npy_process{suffix}", f"`cachebuild imagenet --size S --jobs {jobs}`{on}",
                           child("cachebuild_npy", tree, "--whole-process"), files, rounds),
        ]
    return [
        *rows,
        BuildContender("naive_npy", "naive npy cache: 1 process imread+resize+np.save", child("naive_npy", src), n,
                       rounds),
        # --jobs, not processes: a local build runs its blocks in threads (builder.pipeline._prefer)
        BuildContender("cachebuild_npy", f"cachebuild npy, --jobs {jobs}", child("cachebuild_npy", src), n, rounds),
        BuildContender("cachebuild_zarr", f"cachebuild zarr, {_procs(jobs)}", child("cachebuild_zarr", src), n,
                       rounds),
        BuildContender("cachebuild_jpeg", f"cachebuild jpeg (compact, q90), --jobs {jobs}",
                       child("cachebuild_jpeg", src), n, rounds),
    ]


def steady_state(runs: dict[str, dict[str, list[float]]], images: dict[str, int]) -> dict[str, Any]:
    """Per round, each whole-process contender's steady rate (the difference of its big and base runs) and the
    build's over the bare decoder's; their medians."""
    rates: dict[str, list[float]] = {}
    for key in ("bare_decode_process", "cachebuild_npy_process"):
        big, base = runs[key]["img_s"], runs[f"{key}_base"]["img_s"]
        n_big, n_base = images[key], images[f"{key}_base"]
        rates[key] = [(n_big - n_base) / (n_big / a - n_base / b) for a, b in zip(big, base, strict=False)]
    ratios = [b / a for a, b in zip(rates["bare_decode_process"], rates["cachebuild_npy_process"], strict=False)]
    return {"images": images["cachebuild_npy_process"] - images["cachebuild_npy_process_base"],
            "bare_img_s": summary(rates["bare_decode_process"], 1),
            "cachebuild_img_s": summary(rates["cachebuild_npy_process"], 1),
            "x_bare_decode": summary(ratios, 3), "rounds": ratios}


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
              steady: tuple[Path, Path] | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Returns (the section's results, {contender key: its last output}). ``steady``: the trees of
    ``cfg["steady_base"]`` and ``cfg["steady_n"]`` files the whole-process rows build."""
    n, size, jobs, rounds = cfg["n"], cfg["size"], cfg["jobs"], cfg["rounds"]
    from bench.sections.build_child import scales_file

    sets = None
    if steady is not None:
        base, big = ((tree, cfg[key], scales_file(tree, size, work / f"decode-scales-{cfg[key]}.json"))
                     for tree, key in zip(steady, ("steady_base", "steady_n"), strict=True))
        sets = (base, big)
    contenders = own_contenders(src, n, size, jobs, rounds, scales_file(src, size, work / "decode-scales.json"),
                                sets)
    skipped: dict[str, str] = {}
    for p in peers.build_contenders(cfg, files_json, skipped):
        contenders.append(BuildContender(p["key"], p["label"], p["command"], n, min(rounds, cfg["peer_rounds"])))
    for f in [*src.rglob("*"), *(f for t in (steady or ()) for f in t.rglob("*"))]:  # in the page cache for all
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
        for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
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
        # a whole-process row against the whole-process limit on its set, every other row against the timed part's
        whole = c.key.partition("_process")[2] if "_process" in c.key else None
        limit = runs.get("bare_decode" if whole is None else f"bare_decode_process{whole}", {}).get("img_s", [])
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
    result = {"contenders": rows, "failed": failed, "skipped": skipped, "images": n, "size": size, "jobs": jobs,
              "rounds": rounds, **_source_stats(src)}
    images = {c.key: c.images for c in contenders}
    if all(runs[k]["img_s"] for k in ("bare_decode_process", "bare_decode_process_base", "cachebuild_npy_process",
                                      "cachebuild_npy_process_base")) and \
            images["cachebuild_npy_process"] > images["cachebuild_npy_process_base"]:  # two sets: a difference
        result["steady_state"] = steady_state(runs, images)
    return result, outputs
