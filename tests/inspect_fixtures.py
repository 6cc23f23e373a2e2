"""Caches for the ``show``/``report`` tests: every storage kind, colourful samples, awkward source paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachebuild.storage.cache import write_cache

__all__ = ["AWKWARD_PATHS", "coloured_images", "inspect_cache"]

# names a naive reader of paths.json would split wrongly: commas, quotes, backslashes (one ending a name),
# brackets, non-ASCII, and bytes that are not UTF-8 (os.fsdecode form)
AWKWARD_PATHS = ['a,b/c, d.JPEG', 'q"uote/x".png', 'back\\slash\\', '["br]ack{e}t"]', "ünï/ċödé.jpg",
                 "bad_\udcff\udcfe_name.JPEG", 'esc\\"aped', ", ", ""]


def coloured_images(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """uint8 (n, h, w, 3): a gradient in a per-sample colour plus noise, so tiles differ and survive JPEG."""
    rng = np.random.default_rng(seed)
    base = rng.integers(30, 226, (n, 1, 1, 3))
    ramp = (np.arange(h)[:, None, None] * 60 // max(1, h - 1)) + (np.arange(w)[None, :, None] * 40 // max(1, w - 1))
    img = base + ramp[None] - 50 + rng.integers(-8, 9, (n, h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def inspect_cache(root: Path, storage: str = "npy", n: int = 90, h: int = 40, w: int = 40, *, classes: int = 6,
                  pad: bool = False, awkward: bool = False) -> tuple[Path, np.ndarray, np.ndarray, list[str]]:
    """A cache of :func:`coloured_images` with labels ``i % classes`` (class 5 has fewer samples: every
    sample ``i % 15 == 5`` is relabelled 0); returns (root, images, labels, paths)."""
    images = coloured_images(n, h, w)
    labels = np.arange(n) % classes
    labels[(np.arange(n) % 15 == 5)] = 0
    paths = [f"c{labels[i]}/img_{i:05d}.JPEG" for i in range(n)]
    if awkward:
        paths[: len(AWKWARD_PATHS)] = AWKWARD_PATHS
    boxes = None
    if pad:
        boxes = np.stack([np.zeros(n), np.arange(n) % 5, np.full(n, h), np.full(n, w) - np.arange(n) % 4], 1)
    write_cache(root, images, labels, [f"class-{k}" for k in range(classes)], storage=storage, shard_size=16,
                paths=paths, boxes=boxes, fit="pad" if pad else "crop", replace=True,
                compression="none")
    return root, images, labels, paths
