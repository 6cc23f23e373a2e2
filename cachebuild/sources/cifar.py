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
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan

__all__ = ["CIFAR10", "CIFAR100", "CifarOptions", "CifarReader", "CifarSource", "cifar_plans"]

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
    return [_split_plan(root, variant, s) for s in (SPLITS if split == "all" else (split,))]


def _split_plan(root: str, variant: str, split: str) -> Plan:
    data = _load(root, variant, split)
    h = hashlib.sha256(memoryview(np.ascontiguousarray(data.images)).cast("B"))
    h.update(data.labels.astype(np.int64).tobytes())
    if data.coarse_labels is not None:
        h.update(data.coarse_labels.astype(np.int64).tobytes())
    extra_labels = {}
    extra: dict[str, object] = {}
    if data.coarse_labels is not None:
        extra_labels["coarse_labels"] = np.asarray(data.coarse_labels, dtype=np.int64)
        extra["coarse_classes"] = list(data.coarse_classes or [])
    return Plan(
        dataset=variant,
        split=split,
        root=root,
        keys=list(data.keys),
        labels=np.asarray(data.labels, dtype=np.int64),
        classes=list(data.classes),
        source_digest=h.hexdigest(),
        reader=CifarReader(root, variant, split),
        native_size=int(data.images.shape[1]),
        extra_labels=extra_labels,
        extra=extra,
    )


@dataclass(frozen=True)
class CifarOptions(SourceOptions):
    split: str = option("all", None, choices=(*SPLITS, "all"))


class CifarSource(SourceKind):
    """CIFAR-10 or CIFAR-100 (the kind's name is the variant)."""

    options = CifarOptions
    url_src = False
    default_size = 32
    size_help = "Output side; 32 keeps CIFAR's pixels."

    def plan(self, src: str, options: CifarOptions, *, classes: list[str] | None = None,
             jobs: int = 1) -> list[Plan]:
        return cifar_plans(src, self.name, options.split)


def _help(variant: str) -> str:
    return f"{variant.upper()} python batches at SRC: the folder holding them, their folder, or the .tar.gz."


class CIFAR10(CifarSource):
    name = "cifar10"
    help = _help(name)


class CIFAR100(CifarSource):
    name = "cifar100"
    help = _help(name)
