"""One build contender in its own process (run by ``bench.sections.build`` through ``bench.children``).

    python -m bench.sections.build_child CONTENDER --src TRAIN_DIR --out DIR --size S --jobs J [--whole-process]

Prints one JSON line: ``seconds``, ``images``, ``bytes_written``. ``seconds`` is the timed part only: imports,
the plan (cachebuild) and the warm-up of what runs the blocks (the worker pool, or this process where the
build runs them in its threads) come before it. With ``--whole-process`` it is the
whole process instead, from its creation (interpreter start, imports, fresh workers' start-up, the plan) to
its end: what ``time cachebuild imagenet SRC --size S --jobs J`` measures, and the contender runs exactly that
command's code (cachebuild_npy only; bare_decode likewise pays its own start-up and its workers'). Contenders:
  bare_decode      cv2.imdecode of every file, J processes: the decode limit; each JPEG decoded at the DCT
                   scale (1, 1/2, 1/4, 1/8) the build decodes it at (``--scales``, from
                   ``scales_file``: the decode the build needs, not a full-size decode of its large photos)
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
WHOLE_PROCESS = ("bare_decode", "cachebuild_npy")  # the acceptance check's pair


def scales_file(src: Path, size: int, dest: Path) -> Path:
    """``dest``: {path: DCT reduction r} for every file of ``src``, as the build picks it for ``size`` (crop
    fit, reduced decode on: the defaults), so the bare decoder does the decode the build needs. Made by the
    bench parent once, outside every contender's clock (the build probes each header inside its own)."""
    from cachebuild.builder.sample import ResizeSpec, probe, reduction  # the build's own rule, not a copy of it

    spec = ResizeSpec(size)
    scales = {}
    for p, _ in _files(src):
        h, w, fmt = probe(Path(p).read_bytes(), spec.max_pixels)
        scales[p] = reduction(h, w, spec) if fmt == "JPEG" else 1
    dest.write_text(json.dumps(scales))
    return dest


def _files(src: Path) -> list[tuple[str, int]]:
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    return [(str(f), k) for k, c in enumerate(classes) for f in sorted((src / c).iterdir())]


def _warm(sample: str, contender: str) -> int:
    """Start-up, excluded from the timing: what the contender imports, and the first call of each kernel (the
    bare decoder imports OpenCV alone, so its memory is its own). For a build, torch's kernel too (the build
    imports it at its first large downscale), on one thread as in a build."""
    import cv2

    cv2.setNumThreads(1)
    with open(sample, "rb") as f:
        data = f.read()
    if contender == "bare_decode":
        cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    else:
        import torch

        from cachebuild.builder.sample import ResizeSpec, decode_into

        if contender == "cachebuild_zarr":
            import zarr  # noqa: F401
        torch.set_num_threads(1)
        decode_into(data, ResizeSpec(224), np.empty((224, 224, 3), np.uint8))
        decode_into(np.zeros((1000, 1000, 3), np.uint8), ResizeSpec(224), np.empty((224, 224, 3), np.uint8))
    if multiprocessing.parent_process() is not None:  # a pool worker: stay busy so every worker gets one
        time.sleep(0.2)
    return os.getpid()


def _warm_pool(sample: str, contender: str, jobs: int) -> None:
    """:func:`_warm` in each of the ``jobs`` worker processes joblib's pool starts (twice as many tasks)."""
    from joblib import Parallel, delayed

    Parallel(n_jobs=jobs)(delayed(_warm)(sample, contender) for _ in range(jobs * 2))


def _warm_build(sample: str, contender: str, jobs: int, storage: str) -> None:
    """The warm-up of what will run the build's blocks, by the build's own rule (``pipeline._prefer``): this
    process for threads (or ``--jobs 1``), else the pool's worker processes."""
    from cachebuild.builder.pipeline import BuildOptions, _prefer

    if jobs <= 1 or _prefer(BuildOptions(size=224, storage=storage)) == "threads":  # the blocks run here
        _warm(sample, contender)
    else:
        _warm_pool(sample, contender, jobs)


def _decode_chunk(paths: list[tuple[str, int]]) -> int:
    import cv2

    cv2.setNumThreads(1)
    flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
             8: cv2.IMREAD_REDUCED_COLOR_8}
    n = 0
    for p, r in paths:
        with open(p, "rb") as f:
            n += cv2.imdecode(np.frombuffer(f.read(), np.uint8), flags[r]) is not None
    return n


def _cli_build(a: argparse.Namespace) -> int:
    """``cachebuild imagenet <root> --split train --size S --jobs J --format F`` in this process (the console
    script's own entry point); returns the bytes it wrote."""
    from cachebuild.cli import main as cli

    summary = a.out.parent / f"{a.out.name}.summary.json"
    cli.main(["imagenet", str(a.src.parent), "--split", "train", "--size", str(a.size), "--jobs", str(a.jobs),
              "--format", a.contender.rsplit("_", 1)[1], "--out", str(a.out), "--no-progress", "-q",
              "--json", str(summary)], prog_name="cachebuild", standalone_mode=False)
    doc = json.loads(summary.read_text())
    summary.unlink()
    return int(doc["bytes_written"])


def _process_start() -> float:
    """This process's start on the ``time.time()`` clock, from the kernel's record (10 ms ticks since boot).
    Not ``psutil.Process().create_time()``: on Linux that adds the ticks to /proc/stat's ``btime``, a whole
    second, so it put the start up to 1 s early (0.95 s on the machine it was found on) and every
    whole-process row paid that much more; here the ticks are set against /proc/uptime, read now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        return psutil.Process().create_time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("contender", choices=CONTENDERS)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--scales", type=Path, help="bare_decode: the DCT reduction of each file (scales_file)")
    ap.add_argument("--whole-process", action="store_true",
                    help="time the whole process (start-up, imports, fresh workers, plan), not the build alone")
    a = ap.parse_args()
    if a.whole_process and a.contender not in WHOLE_PROCESS:
        ap.error(f"--whole-process runs {', '.join(WHOLE_PROCESS)}")
    started = _process_start() if a.whole_process else 0.0
    from joblib import Parallel, delayed

    files = _files(a.src)
    paths = [p for p, _ in files]
    if a.contender == "bare_decode" and not a.whole_process:
        _warm_pool(paths[0], a.contender, a.jobs)
    written = 0
    if a.whole_process and a.contender != "bare_decode":
        written = _cli_build(a)
        seconds = time.time() - started
    elif a.contender == "bare_decode":
        scales = json.loads(a.scales.read_text()) if a.scales else {}
        work = [(p, int(scales.get(p, 1))) for p in paths]
        chunks = [work[i : i + 64] for i in range(0, len(work), 64)]
        t0 = time.perf_counter()
        Parallel(n_jobs=a.jobs)(delayed(_decode_chunk)(c) for c in chunks)
        seconds = (time.time() - started) if a.whole_process else time.perf_counter() - t0
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
        _warm_build(paths[0], a.contender, a.jobs, storage)
        t0 = time.perf_counter()
        r = build(plan, a.out, BuildOptions(size=a.size, jobs=a.jobs, storage=storage, progress=False))
        seconds = time.perf_counter() - t0
        written = r.bytes_written
    print(json.dumps({"seconds": seconds, "images": len(paths), "bytes_written": written}), flush=True)


if __name__ == "__main__":
    main()
