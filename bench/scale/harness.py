"""``python -m bench.scale --n 10000,100000,1281167 --size 32``: each step's cost as a curve of N.

For each N (a nested subset of the generated ImageNet-shaped tree, ``bench.scale.tree``), every step in its own
process (``bench.scale.curves``); at the largest N also the kill-and-resume build, the flat val and the Dask
build (``bench.scale.faults``). Writes ``bench/results/<date>-<host>-scale/scale.{json,md,png}`` with the
machine and the git commit, and prints pass/fail per target (``bench.scale.targets``). The generated tree and
the caches live in ``--work`` (default /work/scale-data), outside the repository, and the tree is reused.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from bench.scale import faults, tree
from bench.scale.curves import run_n
from bench.scale.report import write_md, write_png
from bench.scale.runner import ROOT, Runner
from bench.scale.targets import check_targets

__all__ = ["main", "run"]


def _commit_text(git: dict[str, Any] | None) -> str:
    return "unknown" if git is None else git["commit"] + ("+dirty" if git["dirty"] else "")


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(ns: list[int], size: int, work: Path, out: Path, *, jobs: int = 2, extras: bool = True,
        shard_size: int | None = None, timeout: float = 3600, full: Path | None = None,
        update_only: bool = False) -> dict[str, Any]:
    """Every curve point and check; returns the results (also written to ``out``). ``update_only``: of the
    whole-count checks, only the ``--update`` of 10 touched files (no kill, val or Dask build)."""
    t0 = time.perf_counter()
    machine = machine_info()  # its "git" is this tree's commit (bench.machine.git_commit)
    res: dict[str, Any] = {"schema": 1, "run": out.name, "git_commit": _commit_text(machine["git"]), "machine": machine,
                           "load_before": _load(), "load_after": "", "config": {"n": ns, "size": size, "jobs": jobs,
                                                              "shard_size": shard_size}}
    print(f"scale: N = {ns}, --size {size}, --jobs {jobs}; tree and caches in {work}")
    full = full or work / "imagenet-full"
    if full == work / "imagenet-full":
        tree.full_tree(full)
    srcs = {n: full if n == _train_count(full) else tree.subset_tree(full, n, work / f"imagenet-{n}") for n in ns}
    r = Runner(work, size, jobs, timeout, shard_size=shard_size)
    res["tree_read"] = tree.read_all(full)  # every build (joblib, resumed, Dask) then starts from a warm tree
    print(f"  read the tree once: {res['tree_read']['files']:,} files in {res['tree_read']['seconds']:.1f} s")
    res["curves"] = []
    last_out = None
    for n in ns:
        point, last_out = run_n(r, n, srcs[n])
        res["curves"].append(point)
        _save(out, res)
    if extras and last_out is not None and (last_out / "train" / "manifest.json").is_file():
        n = ns[-1]
        blocks = res["curves"][-1]["build"]["shards"]
        print(f"  whole-count checks at N = {n:,} ({blocks} blocks)")
    if extras and not update_only and last_out is not None and (last_out / "train" / "manifest.json").is_file():
        res["kill"] = faults.kill_and_resume(r, srcs[n], last_out, blocks) if blocks >= 4 else \
            {"error": f"only {blocks} blocks: nothing to kill part way (use a larger N or --shard-size)"}
        if (full / "val").is_dir():
            res["val"] = faults.val_build(r, full, last_out / "train")
        res["dask"] = faults.dask_build(r, srcs[n], last_out, n)
    if extras and last_out is not None and (last_out / "train" / "manifest.json").is_file():
        res["update"] = r.update_touched(srcs[n], last_out, res["curves"][-1]["build"]["seconds"])
    res["load_after"] = _load()
    res["seconds"] = time.perf_counter() - t0
    _save(out, res)
    shutil.rmtree(work / "caches", ignore_errors=True)  # GBs at full count; the tree itself is kept
    return res


def _train_count(root: Path) -> int:
    return int(json.loads((root / tree._MARK).read_text())["train"])


def _save(out: Path, res: dict[str, Any]) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    targets = check_targets(res)
    res["targets"] = targets
    (out / "scale.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    write_md(out / "scale.md", res, targets)
    if res["curves"]:
        write_png(out / "scale.png", res)
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default=f"10000,100000,{tree.FULL_TRAIN}", help="comma-separated train file counts")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("SCALE_WORK", "/work/scale-data")))
    ap.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<date>-<host>-scale)")
    ap.add_argument("--shard-size", type=int, default=None, help="samples per block (default: the build's)")
    ap.add_argument("--full", type=Path, default=None,
                    help="the largest tree (default <work>/imagenet-full, generated when missing); e.g. a smaller "
                         "one of the same shape made by bench.scale.tree.full_tree")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="only write scale.md, scale.png and the targets again from this scale.json")
    ap.add_argument("--no-extras", action="store_true", help="only the curves: no kill, val or Dask build")
    ap.add_argument("--update-only", action="store_true",
                    help="of the whole-count checks, only the --update of 10 touched files")
    a = ap.parse_args(argv)
    ns = sorted(int(x) for x in a.n.split(",") if x)
    if a.from_json:  # the figures again (e.g. after a change to the report), nothing measured
        res = json.loads(a.from_json.read_text())
        _save(a.from_json.parent, res)
        _print_targets(a.from_json.parent, res["targets"])
        return 0
    out = a.out or ROOT / "bench" / "results" / f"{dt.date.today().isoformat()}-{socket.gethostname()}-scale"
    res = run(ns, a.size, a.work, out, jobs=a.jobs, extras=not a.no_extras, shard_size=a.shard_size, full=a.full,
              update_only=a.update_only)
    _print_targets(out, res["targets"])
    return 0 if all(t["passed"] for t in res["targets"]) else 1


def _print_targets(out: Path, targets: list[dict[str, Any]]) -> None:
    print(f"\ntargets ({out}):")
    for t in targets:
        print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['target']}: {t['measured']} (limit {t['limit']})")
