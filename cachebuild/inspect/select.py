"""Which samples to look at: index and class specs (``3,7,100-120``, ``0-15``, class names), a seeded random
pick, or a seeded pick per class. Each reads at most the label array the reader already holds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachebuild.errors import OptionError

__all__ = ["parse_class_spec", "parse_index_spec", "pick_per_class", "pick_random"]


def _ranges(spec: str, what: str) -> list[tuple[str, str | None]]:
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise OptionError(f"{what} {spec!r}: expected a comma-separated list such as 3,7,100-120 (no empty items)")
    out: list[tuple[str, str | None]] = []
    for p in parts:
        lo, sep, hi = p.partition("-")
        out.append((lo.strip(), hi.strip() if sep else None))
    return out


def _int(text: str, what: str, spec: str) -> int:
    if not text.isdigit():
        raise OptionError(f"{what} {spec!r}: {text!r} is not a non-negative integer (write ranges as 100-120)")
    return int(text)


def parse_index_spec(spec: str, count: int, what: str = "--indices") -> list[int]:
    """``"3,7,100-120"`` (ranges inclusive) as a list of sample indices, each checked to be in ``[0, count)``."""
    out: list[int] = []
    for lo, hi in _ranges(spec, what):
        a = _int(lo, what, spec)
        b = a if hi is None else _int(hi, what, spec)
        if b < a:
            raise OptionError(f"{what} {spec!r}: range {a}-{b} runs backwards")
        if b >= count:
            raise OptionError(f"{what} {spec!r}: {b} is out of range: the cache holds {count} samples (0-{count - 1})")
        out.extend(range(a, b + 1))
    return out


def parse_class_spec(spec: str, classes: Sequence[str]) -> list[int]:
    """``"0-15"``, ``"3,7"`` or class names (``"n01440764,n01443537"``) as a list of class indices."""
    by_name = {name: i for i, name in enumerate(classes)}
    out: list[int] = []
    for lo, hi in _ranges(spec, "--classes"):
        whole = lo if hi is None else f"{lo}-{hi}"
        if whole in by_name and not whole.isdigit():  # a class name (which may hold a dash)
            out.append(by_name[whole])
            continue
        if not lo.isdigit() or (hi is not None and not hi.isdigit()):
            raise OptionError(f"--classes {spec!r}: {whole!r} is neither a class index, a range such as 0-15, nor "
                              f"a class name of this cache (e.g. {classes[0] if classes else 'none'!r})")
        out.extend(parse_index_spec(whole, len(classes), "--classes"))
    return list(dict.fromkeys(out))  # each class once, in the order given


def pick_random(count: int, n: int, seed: int) -> np.ndarray:
    """``min(n, count)`` distinct indices, seeded, in ascending order (O(n), not O(count))."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(count, size=min(n, count), replace=False)).astype(np.int64)


def pick_per_class(labels: np.ndarray, class_ids: Sequence[int], k: int, seed: int) -> list[np.ndarray]:
    """Up to ``k`` seeded indices of each class in ``class_ids`` (ascending within a class), from one stable sort
    of the labels."""
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], [(int(c), int(c) + 1) for c in class_ids]).reshape(-1, 2)
    out = []
    for members in (order[lo:hi] for lo, hi in bounds):
        take = members if len(members) <= k else np.sort(rng.choice(members, size=k, replace=False))
        out.append(take.astype(np.int64))
    return out
