"""``cachebuild show``: a contact sheet of a few samples of a cache, read through the cache reader.

Only the pixels of the samples shown are read; a random pick is O(n) in the samples drawn, whatever the
cache's size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachebuild.errors import OptionError
from cachebuild.inspect.select import parse_class_spec, parse_index_spec, pick_per_class, pick_random
from cachebuild.inspect.sheet import Sheet, compose_sheet
from cachebuild.storage.cache import CacheReader

__all__ = ["Augment", "Selection", "class_label", "select", "show", "source_paths"]

# stored uint8 (N, H, W, 3) and boxes (N, 4) or None -> what the device transforms make of them, uint8 (N, h, w, 3)
Augment = Callable[[np.ndarray, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class Selection:
    indices: np.ndarray  # int64, in display order
    columns: int | None = None  # per class: one class per row


def select(reader: CacheReader, *, n: int = 64, seed: int = 0, per_class: int | None = None,
           classes: str | None = None, indices: str | None = None) -> Selection:
    """The samples to show: ``indices`` (a spec such as ``3,7,100-120``), else ``per_class`` samples of each
    class in ``classes`` (a spec such as ``0-15``; default: the first 16 classes), else ``n`` at random."""
    m = reader.manifest
    if indices is not None:
        if per_class is not None or classes is not None:
            raise OptionError("--indices names the samples itself: drop --per-class/--classes")
        return Selection(np.asarray(parse_index_spec(indices, m.count), dtype=np.int64))
    if classes is not None or per_class is not None:
        if not m.classes:
            raise OptionError(f"{reader.location.describe()} has no class names: select with --indices or --n")
        ids = parse_class_spec(classes, m.classes) if classes is not None else list(range(min(16, len(m.classes))))
        k = per_class if per_class is not None else 8
        if k < 1:
            raise OptionError(f"--per-class must be at least 1, got {k}")
        picked = pick_per_class(reader.labels, ids, k, seed)
        return Selection(np.concatenate(picked) if picked else np.zeros(0, np.int64), columns=k)
    if n < 1:
        raise OptionError(f"--n must be at least 1, got {n}")
    return Selection(pick_random(m.count, n, seed))


def class_label(classes: Sequence[str], descriptions: object, label: int) -> str:
    """``n01440764 tench`` where the manifest has class descriptions (ImageNet), else the class name."""
    name = classes[label] if 0 <= label < len(classes) else f"class {label}"
    words = None
    if isinstance(descriptions, list | tuple) and 0 <= label < len(descriptions):
        words = descriptions[label]
    return f"{name} {words}" if isinstance(words, str) and words else name


def source_paths(reader: CacheReader) -> list[str]:
    """Every sample's source path, relative to the source root (``?`` for a cache that records none)."""
    return reader.paths() if "paths" in reader.manifest.arrays else ["?"] * reader.manifest.count


def show(reader: CacheReader, selection: Selection, *, augment: Augment | None = None,
         columns: int | None = None, paths: Sequence[str] | None = None) -> Sheet:
    """Read the selected samples and lay them out, captioned; with ``augment``, its output beside each.
    ``paths``: :func:`source_paths`, when the caller shows many selections of one cache."""
    m = reader.manifest
    idx = selection.indices
    if not len(idx):
        raise OptionError(f"nothing to show: the selection from {reader.location.describe()} is empty")
    order = np.argsort(idx, kind="stable")  # read in storage order, show in the order asked
    stored = np.empty((len(idx), *m.shape), dtype=np.uint8)
    stored[order] = reader.gather(idx[order])
    labels = reader.labels[idx]
    names = [class_label(m.classes, m.extra.get("class_descriptions"), int(c)) for c in labels]
    every = paths if paths is not None else source_paths(reader)
    names_of = [every[i] for i in idx.tolist()]
    augmented = None
    if augment is not None:
        boxes = reader.boxes[idx] if reader.boxes is not None else None
        augmented = augment(stored, boxes)
    return compose_sheet(stored, idx.tolist(), labels.tolist(), names, names_of, augmented=augmented,
                         columns=columns or selection.columns)
