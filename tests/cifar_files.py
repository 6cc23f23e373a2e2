"""CIFAR python batches for the tests: support's writers (``support.cifar_layout``), their pictures cut from the
sample photos, so that the classes are learnable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.samples.photos import photo_bank, render_sample
from support import cifar_layout

__all__ = ["cifar_images", "write_cifar10", "write_cifar100"]


def cifar_images(labels: np.ndarray, seed: int, n_classes: int) -> np.ndarray:
    """``(N, 32, 32, 3)`` uint8 RGB crops: class ``k`` from photo / region ``k`` plus a class tint."""
    bank = photo_bank()
    rng = np.random.default_rng(seed)
    out = np.empty((len(labels), 32, 32, 3), dtype=np.uint8)
    for i, k in enumerate(np.asarray(labels).tolist()):
        if not 0 <= k < n_classes:
            raise ValueError(f"label {k} outside [0, {n_classes})")
        out[i] = render_sample(bank, k, 32, 32, rng, scale=(0.2, 1.0), tint=0.25)
    return out


def write_cifar10(root: Path, **kw: Any) -> dict[str, Any]:
    """:func:`support.cifar_layout.write_cifar10` of :func:`cifar_images`."""
    return cifar_layout.write_cifar10(root, cifar_images, **kw)


def write_cifar100(root: Path, **kw: Any) -> dict[str, Any]:
    """:func:`support.cifar_layout.write_cifar100` of :func:`cifar_images`."""
    return cifar_layout.write_cifar100(root, cifar_images, **kw)
