"""A/B of the steady-state build rate against bare decode, for source trees (a change against its baseline).

    python -m bench.scripts.build_ab --src bench/work/set-20000/train --base 2000 --rounds 5 TREE_A TREE_B ...

The harness's build goal (``bench.sections.build``: the steady state) for several checkouts at once. Each round
runs, in an order rotated from round to round: the bare decoder (``bench.sections.build_child bare_decode
--whole-process``, at the build's DCT scales) and ``cachebuild imagenet SRC --size S --jobs J`` as a whole
process (``cachebuild_npy --whole-process``, that tree's own code and child on ``PYTHONPATH``), each on all of
``SRC`` and on the first ``--base`` of its files (a subset of hard links). The difference of a contender's two
runs leaves its start-up out: ``(n - base) / (t_all - t_base)`` is its steady rate, and each tree's is read
against the bare decoder's of the same round. Prints one JSON line per run and the medians at the end; each
tree builds once untimed first (bytecode compiled, page cache warm).
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
from bench.data import subset_tree
from bench.sections.build_child import scales_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path, help="source trees whose cachebuild is timed")
    ap.add_argument("--src", type=Path, required=True, help="a class-folder tree of JPEGs")
    ap.add_argument("--base", type=int, default=2000, help="files of the smaller set (a subset of --src)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    a.src = a.src.resolve()  # the children run in each tree's folder
    load_start = os.getloadavg()[0]
    here = Path(__file__).resolve().parents[2]
    work = Path(tempfile.mkdtemp(prefix="build-ab-"))
    sets = {"all": a.src, "base": subset_tree(a.src, a.base, work / "base")}
    files = {k: sum(1 for f in v.rglob("*") if f.is_file()) for k, v in sets.items()}
    for f in a.src.rglob("*"):  # the sources in the page cache for everyone
        if f.is_file():
            f.read_bytes()
    scales = {k: scales_file(v, a.size, work / f"scales-{k}.json") for k, v in sets.items()}

    def seconds(who: str, tree: Path, key: str) -> float:
        extra = ["--scales", str(scales[key])] if who == "bare_decode" else []
        out = work / "out"
        os.sync()
        ans, _ = run_child([sys.executable, "-m", "bench.sections.build_child", who, "--out", str(out), "--src",
                            str(sets[key]), "--size", str(a.size), "--jobs", str(a.jobs), "--whole-process", *extra],
                           timeout=1200, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=str(tree))
        shutil.rmtree(out, ignore_errors=True)
        return float(ans["seconds"])

    contenders = [("bare", "bare_decode", here), *((str(t), "cachebuild_npy", t.resolve()) for t in a.trees)]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    ratios: dict[str, list[float]] = {str(t): [] for t in a.trees}
    try:
        for _, who, tree in contenders[1:]:  # untimed: a fresh tree's first run compiles its bytecode
            seconds(who, tree, "base")
        for r in range(a.rounds):
            k = r % len(contenders)
            for name, who, tree in contenders[k:] + contenders[:k]:
                t_all, t_base = seconds(who, tree, "all"), seconds(who, tree, "base")
                rate = (files["all"] - files["base"]) / (t_all - t_base)
                rates[name].append(rate)
                print(json.dumps({"round": r, "tree": name, "seconds_all": round(t_all, 2),
                                  "seconds_base": round(t_base, 2), "steady_img_s": round(rate, 1)}), flush=True)
            for t in a.trees:
                ratios[str(t)].append(rates[str(t)][-1] / rates["bare"][-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"images": files, "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0],
                      "median_steady_img_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                      "x_bare_rounds": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
                      "median_x_bare": {k: round(statistics.median(v), 3) for k, v in ratios.items()}}), flush=True)


if __name__ == "__main__":
    main()
