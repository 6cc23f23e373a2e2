"""Small separable image sets for training tests: class k is a noisy image of colour k."""

from __future__ import annotations

import numpy as np

CLASSES = ["red", "green", "blue", "yellow"]
_COLOURS = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]], dtype=np.float32)


def colour_images(n: int, seed: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Class k = a noisy image of colour k with a random darker square: separable, not trivial."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(CLASSES)
    img = _COLOURS[labels][:, None, None, :] + rng.normal(0, 40, size=(n, size, size, 3))
    for i in range(n):
        y, x = rng.integers(0, size // 2, size=2)
        img[i, y : y + size // 2, x : x + size // 2] *= 0.5
    return np.clip(img, 0, 255).astype(np.uint8), labels


_colour_images = colour_images  # the name the training tests use
