"""Where a build's time goes, per image and per stage, against a bare decode of the same files.

    python -m bench.scripts.build_stages --src bench/work/jpegs-5000 --rounds 3

Each round builds ``SRC``'s train split (``cachebuild.builder.pipeline.build``, ``--jobs 1``: one thread, so
the stage clocks add up to the build) with the build's own stage functions wrapped in timers: the file read,
the decode, the resize (OpenCV's bilinear, or torch's antialiased kernel: its calls counted), the sink's write
and hash. Then the bench's bare decoder (``bench.sections.build_child``:
``cv2.imdecode`` of each file, read included, at the build's DCT scale) in the same process. The first
round is a warm-up, left out (fresh memory made the sink's writes ~6x slower on the VM). Prints one JSON
line per round and a table of medians; ``--json PATH`` writes them. The whole-process A/B with two
workers is ``bench.scripts.build_ab``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = {  # stage name -> (module, attribute) of the function whose time is that stage's
    "read": ("cachebuild.sources.plan", "FileReader.__call__"),
    "decode": ("cachebuild.builder.sample", "_decode"),
    "resize": ("cachebuild.builder.sample", "_resize_into"),
    "antialias": ("cachebuild.builder.sample", "_torch"),  # called once per antialiased resize: its count
    "write_and_hash": ("cachebuild.storage.kinds.npy", "NpyShardSink.commit"),
}


def _wrap(totals: dict[str, float], counts: dict[str, int]) -> None:
    import importlib

    for stage, (module, attr) in STAGES.items():
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*a: Any, _inner: Callable[..., Any] = inner, _stage: str = stage, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                totals[_stage] += time.perf_counter() - t0
                counts[_stage] += 1

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True, help="an ILSVRC2012-layout tree (its train/ is built)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds, after one warm-up")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import cv2

    from bench.sections.build_child import _decode_chunk, scales_file  # the bench's bare decoder and its scales
    from cachebuild.builder.pipeline import BuildOptions, build
    from cachebuild.sources.registry import get_source, plan_source

    cv2.setNumThreads(1)  # as in a build worker
    plan = next(p for p in plan_source("imagenet", a.src, get_source("imagenet").options(), classes=None, jobs=1)
                if p.split == "train")
    root, keys = Path(plan.root), list(plan.keys)
    out = Path(tempfile.mkdtemp(prefix="build-stages-")) / "c"
    scales = json.loads(scales_file(root, a.size, out.parent / "scales.json").read_text())
    bare_work = [(str(root / key), int(scales[str(root / key)])) for key in keys]
    totals: dict[str, float] = dict.fromkeys(STAGES, 0.0)
    counts: dict[str, int] = dict.fromkeys(STAGES, 0)
    _wrap(totals, counts)
    load_start = os.getloadavg()[0]
    rows = []
    try:
        for r in range(a.rounds + 1):
            for d in (totals, counts):
                for k in d:
                    d[k] = 0
            shutil.rmtree(out, ignore_errors=True)
            res = build(plan, out, BuildOptions(size=a.size, jobs=1, progress=False))
            t0 = time.perf_counter()
            _decode_chunk(bare_work)
            bare = time.perf_counter() - t0
            n = len(keys)
            timed = [k for k in STAGES if k != "antialias"]  # inside the resize's time
            row = {"round": r, "images": n, "build_ms": res.seconds / n * 1e3, "bare_decode_ms": bare / n * 1e3,
                   **{f"{k}_ms": totals[k] / n * 1e3 for k in timed}, "antialias_calls": counts["antialias"]}
            row["other_ms"] = row["build_ms"] - sum(row[f"{k}_ms"] for k in timed)
            row["x_bare"] = row["bare_decode_ms"] / row["build_ms"]
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            if r > 0:
                rows.append(row)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k != "round"}
    print(f"\n{len(keys)} files, {a.rounds} rounds (median), load {load_start:.2f} at the start; "
          "ms per image, one thread")
    for k, v in med.items():
        print(f"  {k:24s} {v:8.3f}")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"load_average_at_start": load_start, "rounds": rows, "median": med}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
