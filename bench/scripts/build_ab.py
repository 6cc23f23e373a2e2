"""A/B of the whole-process build against bare decode: the acceptance check of issue 36, for source trees.

    python -m bench.scripts.build_ab --src bench/work/jpegs-5000/train --rounds 5 TREE_A TREE_B ...

Each round runs the bare decoder (``bench.sections.build_child bare_decode --whole-process``, at the
build's DCT scales) and then ``cachebuild imagenet SRC --size S --jobs J`` timed as a whole process
(``cachebuild_npy --whole-process``) once per tree, that tree's code on ``PYTHONPATH``: baseline and change
alternate in the same run, and each build is read against the bare decode of its own round. Prints one
JSON line per run and a summary (median ratio per tree) at the end. Each tree builds once untimed first
(bytecode compiled, page cache warm).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.children import run_child
from bench.sections.build_child import scales_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path, help="source trees whose cachebuild is timed")
    ap.add_argument("--src", type=Path, required=True, help="a class-folder tree of JPEGs")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    a.src = a.src.resolve()  # the children run in each tree's folder
    load_start = os.getloadavg()[0]
    here = Path(__file__).resolve().parents[2]
    work = Path(tempfile.mkdtemp(prefix="build-ab-"))
    n = sum(1 for f in a.src.rglob("*") if f.is_file())
    for f in a.src.rglob("*"):  # the sources in the page cache for everyone
        if f.is_file():
            f.read_bytes()
    scales = scales_file(a.src, a.size, work / "scales.json")
    common = ["--src", str(a.src), "--size", str(a.size), "--jobs", str(a.jobs), "--whole-process"]
    ratios: dict[str, list[float]] = {str(t): [] for t in a.trees}
    rates: dict[str, list[float]] = {"bare": [], **{str(t): [] for t in a.trees}}
    try:
        for t in a.trees:  # untimed: a fresh tree's first run compiles its bytecode (parent and workers)
            run_child([sys.executable, "-m", "bench.sections.build_child", "cachebuild_npy", "--out",
                       str(work / "warm"), *common], timeout=600, env={**os.environ, "PYTHONPATH": str(t.resolve())},
                      cwd=str(t.resolve()))
            shutil.rmtree(work / "warm", ignore_errors=True)
        for r in range(a.rounds):
            os.sync()
            env = {**os.environ, "PYTHONPATH": str(here)}
            ans, _ = run_child([sys.executable, "-m", "bench.sections.build_child", "bare_decode", "--out",
                                str(work / "bare"), "--scales", str(scales), *common], timeout=600, env=env,
                               cwd=str(here))
            bare = n / ans["seconds"]
            rates["bare"].append(bare)
            print(json.dumps({"round": r, "tree": "bare", "img_s": round(bare, 1)}), flush=True)
            for t in a.trees:
                out = work / f"out-{r}"
                os.sync()
                env = {**os.environ, "PYTHONPATH": str(t.resolve())}
                ans, _ = run_child([sys.executable, "-m", "bench.sections.build_child", "cachebuild_npy", "--out",
                                    str(out), *common], timeout=600, env=env, cwd=str(t.resolve()))
                shutil.rmtree(out, ignore_errors=True)
                rate = n / ans["seconds"]
                rates[str(t)].append(rate)
                ratios[str(t)].append(rate / bare)
                print(json.dumps({"round": r, "tree": str(t), "img_s": round(rate, 1),
                                  "x_bare": round(rate / bare, 3)}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"images": n, "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0],
                      "median_img_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                      "median_x_bare": {k: round(statistics.median(v), 3) for k, v in ratios.items()}}), flush=True)


if __name__ == "__main__":
    main()
