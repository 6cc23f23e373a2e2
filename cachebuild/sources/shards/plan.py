"""What the shard sources (WebDataset tars, Parquet files) share when planning: the skeleton of a plan
(:func:`plan_shards`: list the shards, pick the split, index every shard once in parallel, put their samples in
order, check labels, source digest) and its parts (split names, class names, label checks, the source digest). A
shard format brings a :class:`ShardFormat`: how to index one shard and how its reader reads the samples."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.kind import option
from cachebuild.sources.plan import Plan, SampleReader
from cachebuild.sources.sample_table import SampleTable
from cachebuild.sources.shards.files import Shard, is_url, list_shards, retrying
from cachebuild.storage.locations.url import FsspecLocation

__all__ = ["SPLIT_WORDS", "ShardFormat", "ShardPart", "check_labels", "dataset_name", "digest_shards", "plan_shards",
           "read_classes", "select_split", "split_option", "split_words"]

log = logging.getLogger("cachebuild")

# Split names as they appear in shard names (imagenet1k-train-0000.tar, data/validation-00000-of-00014.parquet,
# default/test/0000.parquet).
SPLIT_WORDS = ("train", "validation", "val", "valid", "test", "dev")
_TOKENS = re.compile(r"[/\-_.]")


def split_words(name: str) -> list[str]:
    """The split words in ``name``, in order: ``imagenet_train_400`` -> ["train"]."""
    return [t for t in _TOKENS.split(name.lower()) if t in SPLIT_WORDS]


def _splits_in(name: str) -> set[str]:
    return set(split_words(name))


def dataset_name(src: str) -> str:
    """A dataset name from what the user typed: a shard file's stem before the split word or shard number
    (``imagenet1k-train-{0000..1023}.tar`` -> ``imagenet1k``, ``imagenet_train_400.beton`` -> ``imagenet``), else
    the folder's name, skipping ``data`` and split folders (``/data/imagenet-1k/data`` -> ``imagenet-1k``)."""
    parts = [p for p in src.split("://", 1)[-1].split("/") if p]
    while parts:
        last = parts.pop()
        if last.lower() in ("data", *SPLIT_WORDS):
            continue
        if not any(c in last for c in "{*?[") and not last.lower().endswith((".tar", ".parquet", ".beton")):
            return last
        kept = []
        for tok in re.split(r"[-_.]", re.sub(r"\.(tar|parquet|beton)$", "", last, flags=re.IGNORECASE)):
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
        if is_url(path) and not path.startswith("file://"):  # through the storage layer: its timeout, retries
            text = FsspecLocation(path).read_bytes("").decode("utf-8")
        else:
            with open(path.removeprefix("file://"), encoding="utf-8") as f:
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


def digest_shards(shards: Sequence[Shard], keys: Sequence[str], labels: np.ndarray, extra: Any) -> str:
    """sha256 over the planning options and class names (``extra``), every shard's name, size and version
    (mtime, ETag or Last-Modified), and every planned key and label."""
    h = hashlib.sha256()
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    for s in shards:
        h.update(f"{s.name}\0{s.size}\0{s.version}\n".encode("utf-8", "surrogateescape"))
    h.update("\n".join(keys).encode("utf-8", "surrogateescape"))
    h.update(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return h.hexdigest()


def split_option() -> Any:
    """The ``split`` field of the shard sources' options: picked from the shard names."""
    return option(None, "Split to build: picks the shards whose names carry it (train-*, *-validation-*, test/...) "
                        "and names the output sub-folder. Default: the one split the names carry, else train.")


@dataclass
class ShardPart:
    """One shard's samples as indexed, in shard order: names within the shard, labels (-1: none), the reader's
    columns for them, problems by position in the shard, and what else the format needs of it."""

    keys: list[str]
    labels: np.ndarray
    columns: dict[str, np.ndarray]
    problems: dict[int, str] = field(default_factory=dict)
    info: Any = None


class ShardFormat(Protocol):
    """What :func:`plan_shards` needs of a shard format (picklable: shards are indexed in workers)."""

    suffix: str  # of shard files in a folder or prefix: ".tar"
    what: str  # in errors: "WebDataset .tar shards"
    source_format: str  # the plan's extra["source_format"]
    shard_column: str  # the reader's column of shard indices
    threads: bool  # index in threads (else joblib's default: processes)
    nothing: str  # "shard(s) hold no samples"

    def index(self, shard: Shard) -> ShardPart: ...

    def found_classes(self, parts: list[ShardPart], src: str) -> list[str] | None: ...

    def digest_extra(self, parts: list[ShardPart], classes: list[str]) -> dict[str, Any]: ...

    def reader(self, shards: tuple[Shard, ...], parts: list[ShardPart], table: SampleTable) -> SampleReader: ...


def _index(fmt: ShardFormat, shard: Shard) -> ShardPart:
    return retrying(shard, lambda: fmt.index(shard), lambda: None)


def _index_all(fmt: ShardFormat, shards: list[Shard], jobs: int) -> list[ShardPart]:
    """Each shard indexed once, in parallel (joblib: the caller's backend)."""
    if jobs == 1 or len(shards) == 1:
        return [_index(fmt, s) for s in shards]
    from joblib import Parallel, delayed

    return Parallel(n_jobs=jobs, prefer="threads" if fmt.threads else None)(delayed(_index)(fmt, s) for s in shards)


def plan_shards(fmt: ShardFormat, src: str | os.PathLike[str], *, split: str | None, classes: list[str] | None,
                dataset: str | None, jobs: int) -> Plan:
    """Plan the shards of ``fmt`` at ``src`` (a brace pattern, glob, folder, prefix or file; local or URL).
    Order: shards by name, then samples in shard order; provenance ``shard#key``."""
    src = os.fspath(src)
    root, shards = list_shards(src, (fmt.suffix,), fmt.what)
    split, shards = select_split(shards, split, src)
    parts = _index_all(fmt, shards, jobs)
    keys: list[str] = []
    problems: dict[int, str] = {}
    for i, (shard, part) in enumerate(zip(shards, parts, strict=True)):
        problems.update({len(keys) + p: r for p, r in part.problems.items()})
        keys += [f"{shard.name}#{k}" for k in part.keys]
        part.columns[fmt.shard_column] = np.full(len(part.keys), i, np.int32)
    if not keys:
        raise SourceError(f"{src}: its {len(shards)} {fmt.nothing}")
    if classes is None:
        classes = fmt.found_classes(parts, src)
    labels = np.concatenate([p.labels for p in parts]).astype(np.int64, copy=False)
    classes = check_labels(labels, classes, problems, src)
    table = SampleTable(0, {c: np.concatenate([p.columns[c] for p in parts]) for c in parts[0].columns}, problems)
    return Plan(
        dataset=dataset or dataset_name(src),
        split=split,
        root=root,
        keys=keys,
        labels=labels,
        classes=classes,
        source_digest=digest_shards(shards, keys, labels, fmt.digest_extra(parts, classes)),
        reader=fmt.reader(tuple(shards), parts, table),
        extra={"source_format": fmt.source_format, "shards": len(shards)},
    )
