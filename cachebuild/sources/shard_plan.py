"""What the shard sources (WebDataset tars, Parquet files) share when planning: which shards a split is,
class names, label checks, the fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.remote import Shard, is_url

__all__ = ["SPLIT_WORDS", "check_labels", "dataset_name", "fingerprint_shards", "read_classes", "select_split"]

log = logging.getLogger("cachebuild")

# Split names as they appear in shard names (imagenet1k-train-0000.tar, data/validation-00000-of-00014.parquet,
# default/test/0000.parquet).
SPLIT_WORDS = ("train", "validation", "val", "valid", "test", "dev")
_TOKENS = re.compile(r"[/\-_.]")


def _splits_in(name: str) -> set[str]:
    return {t for t in _TOKENS.split(name.lower()) if t in SPLIT_WORDS}


def dataset_name(src: str) -> str:
    """A dataset name from what the user typed: the shard names' stem before the split word or shard number
    (``imagenet1k-train-{0000..1023}.tar`` -> ``imagenet1k``), else the folder's name, skipping ``data`` and
    split folders (``/data/imagenet-1k/data`` -> ``imagenet-1k``)."""
    parts = [p for p in src.split("://", 1)[-1].split("/") if p]
    while parts:
        last = parts.pop()
        if last.lower() in ("data", *SPLIT_WORDS):
            continue
        if not any(c in last for c in "{*?[") and not last.lower().endswith((".tar", ".parquet")):
            return last
        kept = []
        for tok in re.split(r"[-_.]", re.sub(r"\.(tar|parquet)$", "", last, flags=re.IGNORECASE)):
            if not tok or tok.lower() in SPLIT_WORDS or tok[0].isdigit() or tok[0] in "{*?[":
                break
            kept.append(tok)
        if kept:
            return "-".join(kept)
    return "dataset"


def select_split(shards: list[Shard], split: str | None, src: str) -> tuple[str, list[Shard]]:
    """(split name, its shards). Shard names that carry split words (``train``, ``validation``...) are filtered
    by ``split``; without ``split`` they must all carry the same one. Names without any split word are all
    kept, and the split is ``split`` or ``train``."""
    found = sorted(set().union(*(_splits_in(s.name) for s in shards)))
    if not found:
        return split or "train", shards
    if split is None:
        if len(found) > 1:
            raise SourceError(f"{src} holds shards of several splits ({', '.join(found)}): pass --split")
        return found[0], shards
    chosen = [s for s in shards if split.lower() in _splits_in(s.name)]
    if not chosen:
        raise SourceError(f"{src} has no shards of split {split!r} (its shard names carry {', '.join(found)})")
    return split, chosen


def read_classes(path: str | os.PathLike[str]) -> list[str]:
    """Class names, one per line (index = line number; blank lines and surrounding spaces ignored); a local
    file or a URL."""
    path = os.fspath(path)
    try:
        if is_url(path):
            import fsspec

            with fsspec.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: cannot read the class names ({e})") from None
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise SourceError(f"{path} holds no class names: expected one name per line")
    dupes = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
    if dupes:
        raise SourceError(f"{path} names a class twice ({', '.join(dupes[:5])}): one line per class")
    return names


def check_labels(labels: np.ndarray, classes: list[str] | None, problems: dict[int, str], where: str) -> list[str]:
    """Class names for ``labels`` (int64, -1 = none) and a problem for every label outside them. Without
    names, classes are "0".."max" and a warning says how to name them."""
    ok = np.ones(len(labels), bool)
    ok[list(problems)] = False
    if classes is None:
        top = int(labels[ok].max()) if ok.any() else -1
        classes = [str(i) for i in range(top + 1)]
        if classes:
            log.warning("%s: no class names given; classes are named 0..%d (pass --classes FILE to name them)",
                        where, top)
    bad = ok & ((labels < 0) | (labels >= len(classes)))
    for i in np.flatnonzero(bad).tolist():
        problems[i] = (f"label {int(labels[i])} is not a class index: expected 0..{len(classes) - 1}"
                       if labels[i] >= 0 else "no label (a negative label means unlabelled)")
    return classes


def fingerprint_shards(shards: Sequence[Shard], keys: Sequence[str], labels: np.ndarray, extra: Any) -> str:
    """sha256 over the planning options and class names (``extra``), every shard's name, size and version
    (mtime, ETag or Last-Modified), and every planned key and label."""
    h = hashlib.sha256()
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    for s in shards:
        h.update(f"{s.name}\0{s.size}\0{s.version}\n".encode("utf-8", "surrogateescape"))
    h.update("\n".join(keys).encode("utf-8", "surrogateescape"))
    h.update(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return h.hexdigest()
