"""CIFAR-10 / CIFAR-100 python batches as a plan. Pixels come from the restricted reader
(``cifar_pickle``), already RGB 32x32; the plan order is torchvision's, so sample i is ``.data[i]``."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.cifar_pickle import CifarSplit, load_cifar_split
from cachebuild.sources.plan import Plan
from cachebuild.sources.recipe import with_recipe

__all__ = ["CifarReader", "cifar_plans"]

SPLITS = ("train", "test")


@lru_cache(maxsize=2)
def _load(root: str, variant: str, split: str) -> CifarSplit:
    # Once per worker process: a split is at most 150 MB and every block of it needs the same arrays.
    return load_cifar_split(Path(root), variant, split)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CifarReader:
    root: str
    variant: str
    split: str

    def __call__(self, index: int, key: str) -> np.ndarray:
        return _load(self.root, self.variant, self.split).images[index]


def cifar_plans(src: str | os.PathLike[str], variant: str, split: str = "all") -> list[Plan]:
    if split not in (*SPLITS, "all"):
        raise SourceError(f"unknown split {split!r}: expected train, test or all")
    root = str(Path(src))
    plans = []
    for s in SPLITS if split == "all" else (split,):
        data = _load(root, variant, s)
        h = hashlib.sha256(memoryview(np.ascontiguousarray(data.images)).cast("B"))
        h.update(data.labels.astype(np.int64).tobytes())
        if data.coarse_labels is not None:
            h.update(data.coarse_labels.astype(np.int64).tobytes())
        extra_labels = {}
        extra: dict[str, object] = {}
        if data.coarse_labels is not None:
            extra_labels["coarse_labels"] = np.asarray(data.coarse_labels, dtype=np.int64)
            extra["coarse_classes"] = list(data.coarse_classes or [])
        plans.append(with_recipe(
            Plan(
                dataset=variant,
                split=s,
                root=root,
                keys=list(data.keys),
                labels=np.asarray(data.labels, dtype=np.int64),
                classes=list(data.classes),
                fingerprint=h.hexdigest(),
                reader=CifarReader(root, variant, s),
                native_size=int(data.images.shape[1]),
                extra_labels=extra_labels,
                extra=extra,
            ), variant, src, split=s))
    return plans
