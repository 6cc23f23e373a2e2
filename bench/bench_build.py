"""Build throughput, side by side in one run on the same real-photo JPEGs (see DESIGN.md, "How we measure").

Contenders, each with worker start-up excluded (pools are warmed first):
  naive      single process: cv2.imread, cvtColor, resize INTER_AREA, np.save of the stacked array
  decode     bare cv2.imdecode of the same bytes in --jobs processes: the decode limit
  cachebuild build() into npy shards (and zarr), --jobs processes
bare decode, cachebuild npy and the naive loop run in --rounds rounds; the issue's ratios are taken
within each round and their median reported (the machine's speed drifts). Then peak resident memory
of a whole `cachebuild` CLI build (process tree) at two dataset sizes.

    python bench/bench_build.py --n 8000 --jobs 2 --json bench-out/build.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed


def _warm(sample: str) -> int:
    """Worker start-up, excluded from every contender: imports and the first call of each kernel."""
    import cv2
    import torch
    import zarr  # noqa: F401  (the zarr contender's workers)

    from cachebuild.decode import ResizeSpec, decode_into
    from cachebuild.pipeline import _init_worker

    _init_worker()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    with open(sample, "rb") as f:
        decode_into(f.read(), ResizeSpec(224), np.empty((224, 224, 3), np.uint8))
    return os.getpid()


def _decode_chunk(paths: list[str]) -> int:
    import cv2

    cv2.setNumThreads(1)
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            img = cv2.imdecode(np.frombuffer(f.read(), np.uint8), cv2.IMREAD_COLOR)
        n += img is not None
    return n


def naive_loop(paths: list[str], size: int, out: Path) -> float:
    import cv2

    cv2.setNumThreads(1)
    t = time.perf_counter()
    images = []
    for p in paths:
        img = cv2.imread(p)
        if img is None:
            continue
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        images.append(cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA))
    np.save(out, np.stack(images))
    return time.perf_counter() - t


def bare_decode(paths: list[str], jobs: int) -> float:
    chunks = [paths[i : i + 256] for i in range(0, len(paths), 256)]
    t = time.perf_counter()
    Parallel(n_jobs=jobs)(delayed(_decode_chunk)(c) for c in chunks)
    return time.perf_counter() - t


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def peak_memory_of_cli(args: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS of the whole process tree, peak RSS of the parent alone)."""
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_tree = peak_parent = 0
    t = time.perf_counter()
    while proc.poll() is None:
        peak_tree = max(peak_tree, _tree_rss(proc.pid))
        peak_parent = max(peak_parent, _tree_rss_single(proc.pid))
        time.sleep(0.05)
    if proc.returncode:
        raise RuntimeError(f"cachebuild {' '.join(args)} failed with exit code {proc.returncode}")
    return time.perf_counter() - t, peak_tree, peak_parent


def _tree_rss_single(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (FileNotFoundError, StopIteration):
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8000, help="number of JPEGs (>= 8000 for the reported figures)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of bare decode / cachebuild / naive loop")
    ap.add_argument("--work", type=Path, default=Path("bench-out/build"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from cachebuild.format import open_cache
    from cachebuild.pipeline import BuildOptions, build
    from cachebuild.samples.imagenet_layout import write_imagenet
    from cachebuild.sources.imagenet import imagenet_plans

    n_classes = 10
    per_class = -(-args.n // n_classes)
    src = args.work / f"imagenet-{n_classes}x{per_class}"
    if not (src / "train").is_dir():
        print(f"writing {n_classes * per_class} real-photo JPEGs to {src} (once) ...", flush=True)
        shutil.rmtree(src, ignore_errors=True)
        write_imagenet(src, n_classes=n_classes, train_per_class=per_class, val_per_class=1, seed=0)
    plan = imagenet_plans(src, "train")[0]
    paths = [str(Path(plan.root) / k) for k in plan.keys]
    n = len(paths)
    sizes = np.array([os.path.getsize(p) for p in paths])
    print(f"{n} JPEGs, {sizes.sum() / 1e6:.0f} MB, -> {args.size}x{args.size}, {args.jobs} processes")

    Parallel(n_jobs=args.jobs)(delayed(_warm)(paths[0]) for _ in range(args.jobs * 4))  # start-up excluded
    _decode_chunk(paths[:200])  # page cache warm for everyone

    results: dict[str, dict[str, float]] = {}
    rates: dict[str, list[float]] = {}

    def record(name: str, seconds: float, written: float = 0.0) -> float:
        rate = n / seconds
        rates.setdefault(name, []).append(rate)
        results[name] = {"seconds": seconds, "img_per_s": float(np.median(rates[name])),
                         "mb_written_per_s": written / 1e6 / seconds, "rounds": rates[name]}
        print(f"  {name:<28} {seconds:7.2f} s  {rate:8.0f} img/s  {written / 1e6 / seconds:6.0f} MB/s", flush=True)
        return rate

    out = args.work / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    def timed_build(name: str, opts: BuildOptions) -> float:
        dest = out / name.replace(" ", "-")
        os.sync()  # each contender starts with no dirty pages of the one before to write back
        t = time.perf_counter()
        r = build(plan, dest, opts)
        rate = record(name, time.perf_counter() - t, r.bytes_written)
        assert open_cache(dest).manifest.count == n
        shutil.rmtree(dest)
        return rate

    # The ratios the issue sets are taken within each round, between neighbours in time, and their
    # median reported: this machine's speed drifts by up to 30% within minutes.
    naive_n = min(n, 1000)  # the slow loop on a subset; its rate is per image
    per_round: dict[str, list[float]] = {"cachebuild / naive": [], "cachebuild / bare decode": []}
    for rnd in range(args.rounds):
        print(f" round {rnd + 1} of {args.rounds}", flush=True)
        bare = record("decode (bare imdecode)", bare_decode(paths, args.jobs))
        ours = timed_build("cachebuild npy", BuildOptions(size=args.size, jobs=args.jobs, progress=False))
        naive = record("naive loop (1 process)",
                       naive_loop(paths[:naive_n], args.size, out / "naive.npy") * n / naive_n,
                       n * args.size * args.size * 3)
        per_round["cachebuild / naive"].append(ours / naive)
        per_round["cachebuild / bare decode"].append(ours / bare)
        if rnd == 0:
            timed_build("cachebuild npy linear", BuildOptions(size=args.size, jobs=args.jobs, interpolation="linear",
                                                              progress=False))
            zarr_rate = timed_build("cachebuild zarr", BuildOptions(size=args.size, jobs=args.jobs, storage="zarr",
                                                                    progress=False))
            per_round["cachebuild zarr / bare decode"] = [zarr_rate / bare]

    ratios = {k: float(np.median(v)) for k, v in per_round.items()}
    for k, v in ratios.items():
        print(f"  {k:<28} {v:6.2f}x  (median; rounds: {', '.join(f'{r:.2f}' for r in per_round[k])})")

    # Peak memory of the whole CLI build (parent + workers) at two dataset sizes: it must stay flat.
    memory = {}
    for frac in (4, 1):
        m = n // frac
        sub = args.work / f"subset-{m}"
        if not sub.exists():
            sub.mkdir(parents=True)
            for i, k in enumerate(plan.keys[:m]):
                dst = sub / "train" / k
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(Path(plan.root) / k, dst) if i >= 0 else None
        dest = out / f"mem-{m}"
        seconds, tree, parent = peak_memory_of_cli(["imagenet", str(sub), "--split", "train", "--size", str(args.size),
                                                    "--jobs", str(args.jobs), "--out", str(dest), "--no-progress"])
        memory[m] = {"seconds": seconds, "peak_rss_tree_mb": tree / 1e6, "peak_rss_parent_mb": parent / 1e6}
        print(f"  memory, {m:>6} images: peak RSS {tree / 1e6:6.0f} MB (process tree), parent {parent / 1e6:5.0f} MB")

    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor()},
        "n": n, "size": args.size, "jobs": args.jobs, "mean_jpeg_kb": float(sizes.mean() / 1e3),
        "results": results, "ratios": ratios, "ratios_per_round": per_round, "memory": memory,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
