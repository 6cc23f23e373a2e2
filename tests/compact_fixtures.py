"""Compact (jpeg) test caches whose samples survive JPEG and still say which sample they are.

FFCV's trick of writing the index into a pixel does not survive a lossy codec; flat 8x8 blocks do (a
flat block aligned with JPEG's grid is its DC coefficient alone). A 32 x 32 sample carries its index in
16 such blocks, dark for 0 and light for 1, plus a gradient in its colour so that samples differ.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from cachebuild.storage.cache import write_cache

__all__ = ["jpeg_index_cache", "jpeg_index_images", "read_index", "shard_payloads"]

_SIDE = 32


def jpeg_index_images(n: int) -> np.ndarray:
    """uint8 (n, 32, 32, 3): bit k of the index is the grey level of 8x8 block k (row-major)."""
    if n > 1 << 16:
        raise ValueError("16 blocks hold indices below 65536")
    bits = (np.arange(n)[:, None] >> np.arange(16)) & 1  # (n, 16)
    grey = np.where(bits, 208, 48).astype(np.uint8).reshape(n, 4, 4)
    img = np.repeat(np.repeat(grey, 8, axis=1), 8, axis=2)  # (n, 32, 32)
    return np.repeat(img[..., None], 3, axis=3)


def read_index(batch: np.ndarray) -> np.ndarray:
    """The indices written by :func:`jpeg_index_images`, from decoded (B, 32, 32, 3) samples."""
    b = np.asarray(batch, dtype=np.float64)
    means = b.reshape(len(b), 4, 8, 4, 8, 3).mean(axis=(2, 4, 5)).reshape(len(b), 16)
    return ((means > 128) * (1 << np.arange(16))).sum(axis=1)


def jpeg_index_cache(root: Path, n: int = 70, shard_size: int = 16) -> tuple[Path, np.ndarray, np.ndarray]:
    """A jpeg cache of :func:`jpeg_index_images`; returns (root, the images as written, labels)."""
    images = jpeg_index_images(n)
    labels = (np.arange(n) * 3) % 5
    write_cache(root, images, labels, [f"class{k}" for k in range(5)], storage="jpeg", shard_size=shard_size,
                replace=True)
    return root, images, labels


def shard_payloads(path: Path) -> list[bytes]:
    """The stored JPEG of every sample of one shard, read with plain numpy (FORMAT.md's layout)."""
    with open(path, "rb") as f:
        offsets = np.load(f)
        np.load(f)  # crc32
        payload = np.load(f)
    return [payload[a:z].tobytes() for a, z in itertools.pairwise(offsets)]
