"""One build contender in its own process (run by ``bench.sections.build`` through ``bench.children``).

    python -m bench.sections.build_child CONTENDER --src TRAIN_DIR --out DIR --size S --jobs J

Prints one JSON line: ``seconds`` (the timed part only: imports and the warm-up of the worker pool
come before it), ``images``, ``bytes_written``. Contenders:
  bare_decode      cv2.imdecode of every file (IMREAD_COLOR), J processes: the decode limit
  naive_npy        one process: cv2.imread, cvtColor, resize (S, S) INTER_AREA, then one np.save
  cachebuild_npy   cachebuild.builder.pipeline.build(..., storage="npy"), J processes
  cachebuild_zarr  the same, storage="zarr"
  cachebuild_jpeg  the same, storage="jpeg" (a compact cache: JPEG q90, decoded on read)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np

CONTENDERS = ("bare_decode", "naive_npy", "cachebuild_npy", "cachebuild_zarr", "cachebuild_jpeg")


def _files(src: Path) -> list[tuple[str, int]]:
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    return [(str(f), k) for k, c in enumerate(classes) for f in sorted((src / c).iterdir())]


def _warm(sample: str, contender: str) -> int:
    """Worker start-up, excluded from the timing: what the contender's workers import, and the first call
    of each kernel (the bare decoder imports OpenCV alone, so its memory is its own)."""
    import cv2

    cv2.setNumThreads(1)
    with open(sample, "rb") as f:
        data = f.read()
    if contender == "bare_decode":
        cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    else:
        import torch

        from cachebuild.builder.block import _init_worker
        from cachebuild.builder.decode import ResizeSpec, decode_into

        if contender == "cachebuild_zarr":
            import zarr  # noqa: F401
        _init_worker()
        torch.set_num_threads(1)
        decode_into(data, ResizeSpec(224), np.empty((224, 224, 3), np.uint8))
    if multiprocessing.parent_process() is not None:  # a pool worker: stay busy so every worker gets one
        time.sleep(0.2)
    return os.getpid()


def _decode_chunk(paths: list[str]) -> int:
    import cv2

    cv2.setNumThreads(1)
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += cv2.imdecode(np.frombuffer(f.read(), np.uint8), cv2.IMREAD_COLOR) is not None
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("contender", choices=CONTENDERS)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    from joblib import Parallel, delayed

    files = _files(a.src)
    paths = [p for p, _ in files]
    if a.contender != "naive_npy":
        Parallel(n_jobs=a.jobs)(delayed(_warm)(paths[0], a.contender) for _ in range(a.jobs * 2))
    written = 0
    if a.contender == "bare_decode":
        chunks = [paths[i : i + 64] for i in range(0, len(paths), 64)]
        t0 = time.perf_counter()
        Parallel(n_jobs=a.jobs)(delayed(_decode_chunk)(c) for c in chunks)
        seconds = time.perf_counter() - t0
    elif a.contender == "naive_npy":
        import cv2

        cv2.setNumThreads(1)
        t0 = time.perf_counter()
        images = []
        for p in paths:
            img = cv2.imread(p)
            if img is None:
                continue
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
            images.append(cv2.resize(img, (a.size, a.size), interpolation=cv2.INTER_AREA))
        a.out.mkdir(parents=True, exist_ok=True)
        np.save(a.out / "images.npy", np.stack(images))
        np.save(a.out / "labels.npy", np.array([k for _, k in files], np.int64))
        seconds = time.perf_counter() - t0
        written = len(images) * a.size * a.size * 3
    else:
        from cachebuild.builder.pipeline import BuildOptions, build
        from cachebuild.sources.folder import folder_plan

        plan = folder_plan(a.src, dataset="bench", split="train")
        storage = a.contender.rsplit("_", 1)[1]
        t0 = time.perf_counter()
        r = build(plan, a.out, BuildOptions(size=a.size, jobs=a.jobs, storage=storage, progress=False))
        seconds = time.perf_counter() - t0
        written = r.bytes_written
    print(json.dumps({"seconds": seconds, "images": len(paths), "bytes_written": written}), flush=True)


if __name__ == "__main__":
    main()
