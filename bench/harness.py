"""``python -m bench``: run every section on one set of files, write results.json, results.md, charts.

    python -m bench                      # full profile: results in bench/results/<date>-<host>/
    python -m bench --profile quick      # a small set, the same tables (< 3 min on 2 cores)
    python -m bench --profile tiny --out /tmp/x --no-peers   # seconds: what the test runs

Peers run when their venvs exist (``make bench-peers``), and are skipped with the reason otherwise.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import peers
from bench.machine import machine_info
from bench.sections.extras import EXTRA_SECTIONS, run_extra

__all__ = ["PROFILES", "SCHEMA", "main", "run"]

SCHEMA = 1
ROOT = Path(__file__).resolve().parent
SECTIONS = ("build", "load", "transforms", "train", "gpu", *EXTRA_SECTIONS)

_COMMON = {"size": 224, "jobs": 2, "workers": 2, "train_model": "small_cnn", "train_crop": 112, "train_lr": 0.05,
           "child_timeout": 1200, "gpu_workers": min(8, os.cpu_count() or 1), "peers": True, "gpu": True,
           "peer_rounds": 3}
PROFILES: dict[str, dict[str, Any]] = {
    # < 25 min on 2 cores
    "full": {**_COMMON, "n": 5000, "steady_base": 2000, "steady_n": 20000, "batch": 256, "rounds": 5, "epochs": 3,
             "tf_batch": 256, "tf_size": 224, "compile": True, "train_n": 2000},
    # < 5 min on 2 cores: the same tables on a small set, but the build goal's (peers build once here: their
    # start-up, numba's compilation included, is most of a small build). steady_base, steady_n: the two sets of
    # the whole-process build rows, whose difference is the steady state the build goal is read from
    "quick": {**_COMMON, "n": 500, "steady_base": 2000, "steady_n": 20000, "batch": 64, "rounds": 3, "epochs": 3,
              "tf_batch": 64, "tf_size": 224, "compile": True, "train_n": 256, "child_timeout": 300,
              "peer_rounds": 1},
    # seconds: the test of the harness's code path (tiny images, one run each: no figures to read)
    "tiny": {**_COMMON, "n": 40, "steady_base": 20, "steady_n": 40, "size": 64, "batch": 8, "rounds": 1,
             "epochs": 1, "tf_batch": 8, "tf_size": 56, "compile": False, "train_n": 32, "train_crop": 48,
             "child_timeout": 120},
}


def _notes(cfg: dict[str, Any]) -> list[str]:
    return [
        "Warm-ups are left out: each build contender's imports, plan and worker-pool start-up come before its clock "
        "(but for the two build rows marked whole process, timed from their process's start to its exit, fresh "
        "workers included, as `time cachebuild imagenet SRC` is: the build goal is read from those); "
        "each load contender's first epoch, each train contender's first 2 steps and each transform's first 3 calls "
        "(they compile; TorchScript profiles its first two) are not counted.",
        "Page cache: warm throughout, never dropped (the source JPEGs are read once before the build section, "
        "every cache once before the load section). Each build starts after os.sync().",
        f"Every figure is the median of {cfg['rounds']} build rounds (peers: {min(cfg['rounds'], cfg['peer_rounds'])}) "
        f"/ {cfg['epochs']} epochs / {cfg['rounds']} transform rounds, with min-max; ratios to the build limit are "
        "taken within each round, then the median.",
        f"Same files, same image size ({cfg['size']} px), batch size ({cfg['batch']}), worker count "
        f"({cfg['workers']} loader workers, {cfg['jobs']} build processes) for every contender.",
        "Load epochs: our contenders and the two limits run interleaved, epoch by epoch, in one process (peers "
        "after them, each in its venv); before each timed epoch that process's own heap is collected and frozen "
        "(gc.collect, gc.freeze), so a full collection of it (~0.15 s) does not land in one contender's epoch.",
        "Measured, not estimated: nothing in this folder is an estimate.",
        "The machine may be shared: its load average at the start is recorded; read ratios within a run, not "
        "digits across runs.",
    ] + ([] if not os.environ.get("GLIBC_TUNABLES") else [
        f"Run with GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']} (`make bench BENCH_GLIBC=...`; docs/performance.md's "
        "\"Memory copies on virtual machines\" says why one would): every contender and limit ran under it "
        "(peers too); the load rows marked \"glibc's default copy threshold\" were measured again in a process "
        "without it."
    ]) + ([] if cfg["profile"] == "full" else [
        f"A small set: each cache is {cfg['n'] * cfg['size'] ** 2 * 3 / 1e6:,.0f} MB, which may fit a CPU's "
        "last-level cache, so the bare-gather limit is optimistic (and the loaders' ratios to it pessimistic); "
        "epochs are short."])


def run(cfg: dict[str, Any], out: Path, work: Path, sections: tuple[str, ...], command: str,
        log: Any = print) -> dict[str, Any]:
    from bench.report import goals, write_charts, write_markdown

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    res = _start(cfg, sections, command, log)

    def save() -> None:
        res["run"]["seconds"] = round(time.perf_counter() - t_start, 1)
        res["goals"] = goals(res)
        (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")

    try:
        _run_sections(cfg, res, work, sections, save, log)
    except Exception:
        res["error"] = traceback.format_exc()
        raise
    finally:
        save()
        write_charts(res, out)
        write_markdown(res, out)
        shutil.rmtree(work / "build-out", ignore_errors=True)
        log(f"results: {out}/results.json, results.md, charts ({res['run']['seconds']:.0f} s)")
    return res


def _start(cfg: dict[str, Any], sections: tuple[str, ...], command: str, log: Any) -> dict[str, Any]:
    """The results' head: the run, the machine, the config, and each peer's status before anything ran."""
    res: dict[str, Any] = {
        "schema": SCHEMA,
        "run": {"profile": cfg["profile"], "command": command, "started": dt.datetime.now(dt.timezone.utc).isoformat(
            timespec="seconds"), "seconds": 0.0, "sections": list(sections), "notes": _notes(cfg)},
        "machine": machine_info(),
        "config": {k: v for k, v in cfg.items() if k != "profile"},
        "peers": {},
    }
    for name in peers.PEERS:
        py, why = peers.peer_python(name)
        status = ("skipped: peers not requested" if not cfg["peers"] else
                  "ran" if py else f"skipped: {why}")
        res["peers"][name] = {"status": status, "settings": peers.SETTINGS[name],
                              "version": peers.peer_version(name) if status == "ran" else None}
        if status != "ran":
            log(f"peer {name}: {status}")
    return res


def _run_sections(cfg: dict[str, Any], res: dict[str, Any], work: Path, sections: tuple[str, ...],
                  save: Callable[[], None], log: Any) -> None:
    """Each section asked for, in order, into ``res`` (saved after each); then the peers' build outcomes."""
    from bench.data import file_list, source_tree, subset_tree
    from bench.sections.build import run_build

    def tree(n: int) -> Path:
        return subset_tree(source_tree(work, n), n, work / f"set-{n}")

    log(f"source: {cfg['n']} real-photo JPEGs (made once in {work})")
    src = tree(cfg["n"])
    files = file_list(src, work / f"files-{cfg['n']}.json")
    outputs: dict[str, Path] = {}
    if "build" in sections:
        big = tree(cfg["steady_n"])
        base = subset_tree(big, cfg["steady_base"], work / f"set-{cfg['steady_base']}-of-{cfg['steady_n']}")
        log(f"== build (whole-process rows on {cfg['steady_base']:,} and {cfg['steady_n']:,} files)")
        res["build"], outputs = run_build(cfg, work, src, work / f"files-{cfg['n']}.json", log, (base, big))
        save()
    elif set(sections) & {"load", "train", "gpu"}:  # their caches, built once and not reported
        log("== caches (the build section's contenders, one round, not reported)")
        _, outputs = run_build({**cfg, "rounds": 1}, work, src, work / f"files-{cfg['n']}.json", log)
    if "load" in sections:
        from bench.sections.load import run_load

        log("== load")
        res["load"] = run_load(cfg, src, files, outputs, log, work / f"files-{cfg['n']}.json")
        save()
        if "cachebuild_npy" in outputs:
            from bench.sections.peers_remote import run_remote_peers

            log("== load from URLs (loopback S3 and HTTP): cachebuild and the peers that read URLs, cold and warm")
            res["load"]["remote"] = run_remote_peers(cfg, outputs, work, log)
            save()
    if "transforms" in sections:
        from bench.sections.transforms import run_transforms

        log("== transforms")
        res["transforms"] = run_transforms(cfg, log)
        save()
    if "train" in sections:
        from bench.sections.train import run_train

        log("== train")
        res["train"] = run_train(cfg, src, outputs, log)
        save()
    if "gpu" in sections:
        from bench.sections.gpu import run_gpu

        log("== gpu")
        res["gpu"] = run_gpu(cfg, src, outputs, log)
        save()
    for section in EXTRA_SECTIONS:
        if section in sections:
            log(f"== {section}")
            res[section] = run_extra(section, cfg, work, log)
            save()
    for key, p in res.get("build", {}).get("skipped", {}).items():
        res["peers"][key]["status"] = f"skipped: {p}"
    for key, why in res.get("build", {}).get("failed", {}).items():
        peer = key.split("_")[0]
        if peer in res["peers"]:
            res["peers"][peer]["status"] = f"failed: {why}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="full")
    ap.add_argument("--out", type=Path, help="results folder (default bench/results/<date>-<host>[-profile])")
    ap.add_argument("--work", type=Path, default=ROOT / "work", help="source JPEGs (kept) and build outputs")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--no-peers", dest="peers", action="store_false", help="skip the peers (bench/peers)")
    ap.add_argument("--no-gpu", dest="gpu", action="store_false", help="skip the CUDA section even with a GPU")
    for name in ("n", "steady_base", "steady_n", "batch", "workers", "jobs", "rounds", "epochs", "size"):
        ap.add_argument(f"--{name}", type=int, help=f"override the profile's {name}")
    a = ap.parse_args(argv)
    sections = tuple(s.strip() for s in a.sections.split(",") if s.strip())
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    cfg = {**PROFILES[a.profile], "profile": a.profile, "peers": a.peers, "gpu": a.gpu}
    for name in ("n", "steady_base", "steady_n", "batch", "workers", "jobs", "rounds", "epochs", "size"):
        if getattr(a, name) is not None:
            cfg[name] = getattr(a, name)
    if a.out is None:
        suffix = "" if a.profile == "full" else f"-{a.profile}"
        a.out = ROOT / "results" / f"{dt.date.today().isoformat()}-{socket.gethostname()}{suffix}"
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    t0 = time.perf_counter()
    run(cfg, a.out, a.work, sections, "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
        log=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True))
    return 0
