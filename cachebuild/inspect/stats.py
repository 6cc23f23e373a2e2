"""Per-channel pixel statistics over a seeded sample of a cache: the mean and std users copy into
``Normalize``. Exact: per-channel histograms of the uint8 values (integer counts), so mean and std are
those of numpy over the same pixels, to float rounding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachebuild.inspect.select import pick_random
from cachebuild.storage.cache import CacheReader

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
    # --fit pad caches: the same over the real pixels only (inside each sample's box), else None
    inside: PixelStats | None = None


def _moments(hist: np.ndarray) -> tuple[tuple[float, float, float], tuple[float, float, float], int]:
    total = int(hist[0].sum())
    values = np.arange(256, dtype=np.float64) / 255.0
    if total:
        mean = (hist * values).sum(axis=1) / total
        var = (hist * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
    else:
        mean = var = np.zeros(3)
    std = np.sqrt(var)
    return (float(mean[0]), float(mean[1]), float(mean[2])), (float(std[0]), float(std[1]), float(std[2])), total


def _add(hist: np.ndarray, pixels: np.ndarray) -> None:
    flat = pixels.reshape(-1, 3)
    for c in range(3):
        hist[c] += np.bincount(flat[:, c], minlength=256)


def pixel_stats(reader: CacheReader, sample: int = 10_000, seed: int = 0) -> PixelStats:
    """Mean and std of each channel (values / 255) over ``min(sample, N)`` samples drawn without replacement
    (all of them when ``sample >= N``), read in storage order a batch at a time. A cache with boxes
    (``--fit pad``) also gets them over the pixels inside each sample's box (``inside``)."""
    m = reader.manifest
    idx = pick_random(m.count, sample, seed)
    per_batch = max(1, BATCH_BYTES // max(1, m.sample_nbytes))
    hist = np.zeros((3, 256), dtype=np.int64)
    inside = np.zeros((3, 256), dtype=np.int64) if reader.boxes is not None else None
    buf = np.empty((min(per_batch, max(1, len(idx))), *m.shape), dtype=np.uint8)
    for lo in range(0, len(idx), per_batch):
        part = idx[lo : lo + per_batch]
        batch = reader.gather(part, out=buf[: len(part)])
        _add(hist, batch)
        if inside is not None and reader.boxes is not None:
            for img, (y0, x0, y1, x1) in zip(batch, reader.boxes[part].tolist(), strict=True):
                _add(inside, img[y0:y1, x0:x1])
    mean, std, total = _moments(hist)
    sub = None
    if inside is not None:
        i_mean, i_std, i_total = _moments(inside)
        sub = PixelStats(i_mean, i_std, len(idx), m.count, i_total, seed, inside)
    return PixelStats(mean=mean, std=std, samples=len(idx), count=m.count, pixels=total, seed=seed,
                      histogram=hist, inside=sub)
