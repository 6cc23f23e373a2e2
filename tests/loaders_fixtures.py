"""Test caches whose images encode their own index in their pixels (FFCV's trick): identity for free."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachebuild.storage.cache import write_cache

__all__ = ["decode_index", "make_cache", "make_images"]


def make_images(n: int, h: int = 8, w: int = 6) -> np.ndarray:
    """uint8 (n, h, w, 3): channel 0/1/2 of pixel (0, 0) hold the index base 256; the rest a pattern."""
    i = np.arange(n, dtype=np.int64)
    img = ((i[:, None, None, None] * 7 + np.arange(h)[:, None, None] * 3 + np.arange(w)[:, None] * 5
            + np.arange(3)) % 251).astype(np.uint8)
    img = np.broadcast_to(img, (n, h, w, 3)).copy()
    img[:, 0, 0, 0] = i % 256
    img[:, 0, 0, 1] = (i // 256) % 256
    img[:, 0, 0, 2] = i // 65536
    return img


def decode_index(batch: np.ndarray) -> np.ndarray:
    """Indices encoded by :func:`make_images` in a (B, H, W, 3) batch."""
    p = batch[:, 0, 0].astype(np.int64)
    return p[:, 0] + 256 * p[:, 1] + 65536 * p[:, 2]


def make_cache(root: Path, n: int = 50, storage: str = "npy", shard_size: int = 16, *, boxes: bool = False,
               h: int = 8, w: int = 6, compression: str = "none") -> tuple[Path, np.ndarray, np.ndarray]:
    images = make_images(n, h, w)
    labels = (np.arange(n) * 3) % 5
    box = None
    if boxes:
        box = np.stack([np.arange(n) % 2, np.zeros(n), np.full(n, h), np.full(n, w) - np.arange(n) % 3], 1)
    write_cache(root, images, labels, [f"class{k}" for k in range(5)], storage=storage, shard_size=shard_size,
                boxes=box, fit="pad" if boxes else "crop", compression=compression, replace=True)
    return root, images, labels
