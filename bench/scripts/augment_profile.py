"""Where an augmented image's time goes on the CPU: the fused crop + flip + normalize (``crop=``, ``normalize=``),
stage by stage, and the limits beside it, in one run.

    python bench/scripts/augment_profile.py --json out.json [--n 2048 --batch 256 --rounds 5]

What it reports (per image, medians over rounds; one thread, OpenCV on 1 thread, as in a DataLoader worker):
  stages   ms per image of each step ``CropPlan.gather`` takes for one batch, timed apart over the same batches:
           ``draw`` (the boxes and flips: uniforms + draw_crops, vectorised per batch), ``views`` (memory-map
           views of the samples), ``resize`` (OpenCV bilinear resize of the box, + in-place flip), ``normalize``
           (the uint8 crop copied to float32, then one ``cv2.transform`` into its float32 slot),
           ``normalize_lut`` (the way before it, for comparison: a 256-entry ``cv2.LUT`` to float32, not in
           ``sum``); ``sum`` and ``gather`` (the whole call, to show the stages are all of it).
  limits   ``write``: ms per image to write the float32 output alone (np.copyto of a batch from a batch: the
           memory traffic every loader of normalized float batches pays); ``copy_uint8``: the same for a
           uint8 crop.
  loader   img/s of a shuffled epoch: ``CachedImageDataset(crop=, normalize=)`` in 0 workers (this process) and
           in ``--workers`` DataLoader workers with ``collate_batch``; ``scaling`` = workers img/s / (workers x
           the 0-worker rate): what the batch's trip to the main process and the 2 cores' shared memory cost.
The cache is synthetic (smooth upsampled noise, 224 px): resize and LUT cost the same on any pixels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.scripts.worker_crop import _synthetic_cache  # noqa: E402
from loaders import transforms as T  # noqa: E402
from loaders.collate import collate_batch  # noqa: E402
from loaders.dataset import CachedImageDataset, DatasetOptions  # noqa: E402
from loaders.sampler import CacheSampler  # noqa: E402
from loaders.worker_crop import RandomResizedCrop, draw_crops, resize_into, uniforms  # noqa: E402

__all__ = ["main"]


def _stages(ds: CachedImageDataset, batches: list[np.ndarray], size: int, lut: np.ndarray) -> dict[str, float]:
    """Seconds of each stage over ``batches``, each stage timed apart over the same samples and crops."""
    plan, samples = ds.crop, ds
    assert plan is not None and plan.matrix is not None and isinstance(plan.spec, RandomResizedCrop)
    out = np.empty((len(batches[0]), size, size, 3), dtype=np.float32)
    tmp = np.empty((size, size, 3), dtype=np.uint8)
    ftmp = np.empty((size, size, 3), dtype=np.float32)
    sec = dict.fromkeys(("draw", "views", "resize", "normalize", "normalize_lut", "gather"), 0.0)
    for idx in batches:
        idx = np.sort(idx)
        t0 = time.perf_counter()
        boxes = samples.valid_boxes(idx)
        crops, flips = draw_crops(plan.spec, boxes, samples.shape[:2], uniforms(plan.seed, 0, idx), plan.flip_p)
        t1 = time.perf_counter()
        views = samples.sample_views(idx)
        assert views is not None  # a local npy cache: memory-map views
        t2 = time.perf_counter()
        for j in range(len(idx)):
            resize_into(views[j], crops[j], tmp, bool(flips[j]))
        t3 = time.perf_counter()
        for j in range(len(idx)):
            np.copyto(ftmp, tmp)
            cv2.transform(ftmp, plan.matrix, dst=out[j])
        t4 = time.perf_counter()
        for j in range(len(idx)):
            cv2.LUT(tmp, lut, dst=out[j])
        t5 = time.perf_counter()
        plan.gather(samples, idx, out[: len(idx)])
        t6 = time.perf_counter()
        for k, dt in zip(sec, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            sec[k] += dt
    return sec


def _limits(batch: int, size: int, rounds: int) -> dict[str, float]:
    """Seconds per image to write a float32 and a uint8 batch of crops (memory traffic alone)."""
    res = {}
    for name, dt in (("write", np.float32), ("copy_uint8", np.uint8)):
        a, b = np.ones((batch, size, size, 3), dtype=dt), np.empty((batch, size, size, 3), dtype=dt)
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - t0)
        res[name] = statistics.median(times[1:]) / batch
    return res


def _epoch_rate(ds: CachedImageDataset, workers: int, batch: int, epochs: int) -> float:
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=CacheSampler(ds, seed=0), num_workers=workers,
                                     collate_fn=collate_batch, persistent_workers=workers > 0,
                                     prefetch_factor=4 if workers else None)
    rates = []
    for _ in range(epochs + 1):  # the first epoch starts the workers: left out
        t0 = time.perf_counter()
        n = sum(len(x) for x, _ in dl)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--size", type=int, default=224, help="stored and crop size")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    cv2.setNumThreads(1)  # as in a DataLoader worker: one core each
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as d:
        cache = _synthetic_cache(Path(d) / "cache", a.n, a.size)
        ds = CachedImageDataset(cache, DatasetOptions(crop=RandomResizedCrop(a.size), flip=True, in_memory=False,
                                                      normalize=(T.IMAGENET_MEAN, T.IMAGENET_STD)))
        v = np.arange(256, dtype=np.float64)[:, None] / 255.0
        lut = ((v - np.asarray(T.IMAGENET_MEAN)) / np.asarray(T.IMAGENET_STD)).astype(np.float32).reshape(256, 1, 3)
        rng = np.random.default_rng(0)
        rounds = []
        for _ in range(a.rounds + 1):
            order = rng.permutation(a.n)
            batches = [order[i : i + a.batch] for i in range(0, a.n - a.batch + 1, a.batch)]
            sec = _stages(ds, batches, a.size, lut)
            rounds.append({k: v / (len(batches) * a.batch) * 1e3 for k, v in sec.items()})
        rounds = rounds[1:]  # the first warms the page cache and OpenCV
        stages = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        stages["sum"] = sum(stages[k] for k in ("draw", "views", "resize", "normalize"))
        limits = {k: v * 1e3 for k, v in _limits(a.batch, a.size, a.rounds).items()}
        one = _epoch_rate(ds, 0, a.batch, a.rounds)
        many = _epoch_rate(ds, a.workers, a.batch, a.rounds)
    result = {"load_average_at_start": load, "cpus": os.cpu_count(), "n": a.n, "size": a.size, "batch": a.batch,
              "workers": a.workers, "rounds": a.rounds, "torch": torch.__version__, "opencv": cv2.__version__,
              "ms_per_image": {k: round(v, 4) for k, v in stages.items()},
              "limit_ms_per_image": {k: round(v, 4) for k, v in limits.items()},
              "loader_img_s": {"0_workers": round(one), f"{a.workers}_workers": round(many)},
              "scaling": round(many / (a.workers * one), 3)}
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
