"""Per-channel pixel statistics over a seeded sample of a cache: the mean and std users copy into
``Normalize``. Exact: per-channel histograms of the uint8 values (integer counts), so mean and std are
those of numpy over the same pixels, to float rounding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachebuild.format import CacheReader
from cachebuild.inspect.select import pick_random

__all__ = ["PixelStats", "pixel_stats"]

BATCH_BYTES = 32 << 20


@dataclass(frozen=True)
class PixelStats:
    mean: tuple[float, float, float]  # of pixel / 255, R, G, B
    std: tuple[float, float, float]
    samples: int  # samples in the sample
    count: int  # samples in the cache
    pixels: int  # pixels per channel counted
    seed: int
    histogram: np.ndarray  # int64 (3, 256): counts of each value per channel


def pixel_stats(reader: CacheReader, sample: int = 10_000, seed: int = 0) -> PixelStats:
    """Mean and std of each channel (values / 255) over ``min(sample, N)`` samples drawn without replacement
    (all of them when ``sample >= N``), read in storage order a batch at a time."""
    m = reader.manifest
    idx = pick_random(m.count, sample, seed)
    per_batch = max(1, BATCH_BYTES // max(1, m.sample_nbytes))
    hist = np.zeros((3, 256), dtype=np.int64)
    buf = np.empty((min(per_batch, max(1, len(idx))), *m.shape), dtype=np.uint8)
    for lo in range(0, len(idx), per_batch):
        part = idx[lo : lo + per_batch]
        batch = reader.read(part, out=buf[: len(part)])
        flat = batch.reshape(-1, 3)
        for c in range(3):
            hist[c] += np.bincount(flat[:, c], minlength=256)
    total = int(hist[0].sum())
    values = np.arange(256, dtype=np.float64) / 255.0
    if total:
        mean = (hist * values).sum(axis=1) / total
        var = (hist * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
    else:
        mean = var = np.zeros(3)
    std = np.sqrt(var)
    return PixelStats(mean=(float(mean[0]), float(mean[1]), float(mean[2])),
                      std=(float(std[0]), float(std[1]), float(std[2])), samples=len(idx), count=m.count,
                      pixels=total, seed=seed, histogram=hist)
