"""``cachebuild status CACHE --source SRC``: is the cache up to date with its source? Nothing is decoded.

The source is planned again exactly as the build plans it (same listing, same labels, same ``stat`` of
every file) and its source digest compared with the one in the manifest: equal is up to date, anything else
stale. For a stale cache built with per-file inputs (``source_files.json``), the two tables are compared
file by file: added, removed, modified (size, mtime or label). A file whose size and label are the same but
whose mtime is not (a copied tree, a ``touch``) is read and its bytes' digest compared with the one the build
recorded: the same bytes are *touched*, not modified (``--update`` reuses them without decoding). CIFAR sources
are digested over their pixels, so a stale CIFAR cache says only that it is stale.

The source is planned again from the recipe the build recorded (``source.recipe``: the kind of source,
what was named, the options), through the registry of source kinds (``cachebuild.sources.registry``).
Caches built before recipes were recorded are planned by the manifest's ``dataset`` (``imagenet``,
``cifar10``, ``cifar100``; any other name is a class-folder tree).

A recipe names its source as an absolute path (or a URL), so ``status`` plans the same tree from any folder.
Earlier releases recorded the path as it was typed (``ds``): that is read from the absolute root the manifest
records (``source.root``), never from the folder ``status`` runs in (:func:`recorded_source`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import CacheNotFoundError, SourceError
from cachebuild.format import FORMAT_VERSION
from cachebuild.sources.plan import Plan, digest_contents
from cachebuild.sources.registry import recipe_of_old_cache, replan
from cachebuild.storage import Location, is_url, open_location
from cachebuild.storage.cache import SourceInputs, load_source_inputs, read_manifest

__all__ = ["EXIT_CODES", "SourceStatus", "cache_status", "recorded_source"]

EXIT_CODES = {"up to date": 0, "stale": 1, "not a cache": 2}
EXAMPLES = 5

@dataclass(frozen=True)
class SourceStatus:
    cache: str
    source: str
    status: str  # "up to date" | "stale" | "not a cache"
    added: int | None = None  # None: not known (no per-file inputs in the cache)
    removed: int | None = None
    modified: int | None = None
    touched: int | None = None  # another mtime, the same bytes (None: not known)
    classes_changed: bool = False
    examples: dict[str, list[str]] = field(default_factory=dict)
    source_digest: dict[str, str] = field(default_factory=dict)  # {"cache": ..., "source": ...}
    message: str = ""
    # the manifest's format version: a cache up to date with its source but written by an older release reads,
    # yet a build at its --out asks for --update (staging.existing_cache); say so here too
    format_version: int | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.status == "not a cache":
            return f"{self.cache}: not a cache ({self.message})"
        if self.status == "up to date":
            line = f"{self.cache}: up to date with {self.source} (source digest {self.source_digest['source'][:12]})"
            return line + self._older_format()
        parts = []
        if self.added is None:
            parts.append("the source changed (this cache records no per-file inputs to say which files)")
        else:
            parts.append(f"{self.added} added, {self.removed} removed, {self.modified} modified")
        if self.touched:
            parts.append(f"{self.touched} touched (new mtimes, the same bytes: --update reuses them without "
                         f"decoding)")
        if self.classes_changed:
            parts.append("the class list changed")
        lines = [f"{self.cache}: stale: " + "; ".join(parts) + f" (source {self.source})"]
        for kind, names in self.examples.items():
            lines += [f"  {kind}: {n}" for n in names]
        return "\n".join(lines) + self._older_format()

    def _older_format(self) -> str:
        if self.format_version is None or self.format_version >= FORMAT_VERSION:
            return ""
        return (f"\n  written in format version {self.format_version} (this release writes {FORMAT_VERSION}): it reads "
                f"as it is; a build with --update at its --out rewrites it in this format, reusing its samples")


SameBytes = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (plan positions, recorded digests) -> unchanged?


def _compare(old: SourceInputs, plan: Plan, stats: np.ndarray, same_bytes: SameBytes | None = None
             ) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Files added, removed, modified (label, size or mtime) and touched (another mtime, the same bytes, as
    ``same_bytes`` finds), by arrays: no per-file Python object beyond the keys themselves (1.28M files)."""
    keys = list(plan.keys)
    new = np.column_stack([np.asarray(plan.labels, dtype=np.int64), stats.astype(np.int64)])
    if old.keys == keys:  # the same files in the same order (files rewritten or touched): row by row
        added: list[str] = []
        removed: list[str] = []
        present, at = np.arange(len(keys)), np.arange(len(keys))
    else:
        index = {k: i for i, k in enumerate(old.keys)}
        at = np.fromiter((index.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        present = np.flatnonzero(at >= 0)
        kept = np.zeros(len(old.keys), dtype=bool)
        kept[at[present]] = True
        added = sorted(keys[i] for i in np.flatnonzero(at < 0).tolist())
        removed = sorted(old.keys[i] for i in np.flatnonzero(~kept).tolist())
        at = at[present]
    was = old.rows[at]
    changed = (was != new[present]).any(axis=1)
    same = np.zeros(len(present), dtype=bool)
    if same_bytes is not None and old.digests is not None:  # label and size equal: maybe the same bytes
        maybe = np.flatnonzero(changed & (was[:, :2] == new[present, :2]).all(axis=1) & (old.digests[at] != b""))
        if len(maybe):
            same[maybe] = same_bytes(present[maybe], old.digests[at[maybe]])
    modified = sorted(keys[i] for i in present[changed & ~same].tolist())
    touched = sorted(keys[i] for i in present[same].tolist())
    counts = {"added": len(added), "removed": len(removed), "modified": len(modified), "touched": len(touched)}
    examples = {kind: names[:EXAMPLES] for kind, names in
                (("added", added), ("removed", removed), ("modified", modified), ("touched", touched)) if names}
    return counts, examples


_PATTERN = frozenset("*?[{")


def recorded_source(src: str, root: str) -> str:
    """The source a recipe's ``src`` names, as an absolute path (or URL). A relative one (earlier releases
    recorded it as typed) is placed by ``root``, the absolute root of the plan the build recorded: the build
    ran in a folder C where C/``src`` was that root, the folder holding it (a shard file or pattern), or a
    folder above it (a dataset root whose split folder is the plan's root). Of the folders C at or above
    ``root``, the first that gives an existing path, in that order of fit, is taken."""
    if is_url(src) or os.path.isabs(src):
        return src
    top = Path(root)
    if not top.is_absolute():
        raise SourceError(f"the cache records its source as {src!r}, relative to the folder it was built in, "
                          f"which it does not record: pass --source to name it")
    lead: list[str] = []  # src's folders before any pattern (x-{0000..0099}.tar, *.parquet)
    for part in Path(os.path.normpath(src)).parts:
        if _PATTERN & set(part):
            break
        lead.append(part)
    fits = (lambda p: p == top, lambda p: p.parent == top, lambda p: p in top.parents)
    for fit in fits:
        for c in (top, *top.parents):
            named = Path(os.path.normpath(c.joinpath(src)))
            literal = Path(os.path.normpath(c.joinpath(*lead)))
            if fit(named) and (literal.exists() if len(lead) == len(Path(src).parts) else literal.is_dir()):
                return str(named)
    raise SourceError(f"the cache records its source as {src!r}, relative to the folder it was built in, and no "
                      f"such path leads to the root it records ({root}): pass --source to name the source")


def cache_status(cache: str | os.PathLike[str] | Location, source: str | os.PathLike[str] | None = None
                 ) -> SourceStatus:
    """Compare the cache at ``cache`` with the source at ``source`` (default: the root the manifest records)."""
    location = open_location(cache)
    shown = location.describe()
    try:
        m = read_manifest(location)
    except CacheNotFoundError as e:
        return SourceStatus(shown, str(source or ""), "not a cache", message=str(e))
    recipe = m.source.get("recipe")
    if isinstance(recipe, dict) and recipe.get("kind"):  # built by a release that records how it planned
        if source is None:
            source = recorded_source(str(recipe.get("src", "")), str(m.source.get("root", "")))
        shown_src = str(source)
        plan = replan(recipe, source, list(m.classes))  # SourceError for a missing or foreign source
    else:  # built before recipes were recorded: planned by the manifest's dataset name
        src = Path(source) if source is not None else Path(str(m.source.get("root", "")))
        shown_src = str(src)
        plan = replan(recipe_of_old_cache(m.dataset, m.split), src, list(m.classes))
    digests = {"cache": str(m.source.get("fingerprint", "")), "source": plan.source_digest}
    if plan.source_digest == digests["cache"]:
        return SourceStatus(shown, shown_src, "up to date", 0, 0, 0, 0, source_digest=digests,
                            format_version=m.format_version)
    classes_changed = tuple(plan.classes) != tuple(m.classes)
    old = load_source_inputs(location, m)
    if old is None or plan.file_stats is None:
        return SourceStatus(shown, shown_src, "stale", classes_changed=classes_changed, source_digest=digests,
                            format_version=m.format_version)
    counts, examples = _compare(old, plan, plan.file_stats,
                                lambda at, recorded: digest_contents(plan, at, -1) == recorded)
    return SourceStatus(shown, shown_src, "stale", counts["added"], counts["removed"], counts["modified"],
                        counts["touched"], classes_changed=classes_changed, examples=examples,
                        source_digest=digests, format_version=m.format_version)
