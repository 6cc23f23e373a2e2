"""Sample datasets in the real ImageNet and CIFAR layouts, cut from photographs shipped in wheels.

Used by the tests, the benchmarks and ``make demo``; everything is deterministic from a seed.
"""

from __future__ import annotations

from cachebuild.samples.broken import BROKEN_KINDS, write_all_broken
from cachebuild.samples.cifar_layout import py2_pickle_dumps, write_cifar10, write_cifar100
from cachebuild.samples.imagenet_layout import IMAGENET_SYNSETS, VAL_LAYOUTS, write_imagenet
from cachebuild.samples.photos import photo_bank, render_sample

__all__ = [
    "BROKEN_KINDS",
    "IMAGENET_SYNSETS",
    "VAL_LAYOUTS",
    "photo_bank",
    "py2_pickle_dumps",
    "render_sample",
    "write_all_broken",
    "write_cifar10",
    "write_cifar100",
    "write_imagenet",
]
