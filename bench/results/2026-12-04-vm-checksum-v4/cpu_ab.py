"""CPU seconds of one in-process build (``--jobs 1``: the block loop runs in this process) per tree, alternating.

    python bench/results/2026-12-04-vm-checksum-v4/cpu_ab.py SRC ROUNDS TREE_A TREE_B

Each run is a fresh process with that tree first on ``sys.path``; it plans ``SRC`` (a class-folder tree of
JPEGs), builds a 224 px npy cache and reports ``time.process_time()`` over the build (all of its threads), which
other processes on a shared machine change far less than they change wall time. One JSON line per run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.sources.folder import folder_plan
import cachebuild
plan = folder_plan(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    t0, w0 = time.process_time(), time.perf_counter()
    r = build(plan, Path(tmp) / "c", BuildOptions(size=224, jobs=1, progress=False))
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
print(json.dumps({"tree": str(Path(cachebuild.__file__).parents[1]), "images": r.count, "cpu_s": cpu,
                  "wall_s": wall}))
"""


def main() -> None:
    src, rounds, trees = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    cpu: dict[str, list[float]] = {t: [] for t in trees}
    print(json.dumps({"load_average_at_start": os.getloadavg()[0]}), flush=True)
    for r in range(rounds):
        for t in trees if r % 2 == 0 else trees[::-1]:
            with tempfile.TemporaryDirectory():
                out = subprocess.run([sys.executable, "-c", CHILD, src], capture_output=True, text=True, check=True,
                                     env={**os.environ, "PYTHONPATH": t}, cwd=t)
            ans = json.loads(out.stdout.strip().splitlines()[-1])
            cpu[t].append(ans["cpu_s"])
            print(json.dumps({"round": r, **ans, "ms_per_image": 1e3 * ans["cpu_s"] / ans["images"]}), flush=True)
    med = {t: statistics.median(v) for t, v in cpu.items()}
    print(json.dumps({"median_cpu_s": med, "load_average_at_end": os.getloadavg()[0],
                      "ratio_last_to_first": med[trees[-1]] / med[trees[0]]}))


if __name__ == "__main__":
    main()
