"""``cachebuild ls``: the caches under a folder or URL prefix, one line each.

Folders are walked one level at a time (``Location.list_dir``: a delimiter listing on object stores) and
never below a cache, so a zarr cache's thousands of chunk objects are not listed. Unfinished builds or
pulls (``<name>.partial``) and caches replaced under running jobs (``<name>.replaced-*``) are shown, marked.
"""

from __future__ import annotations

import os
import posixpath
from collections import deque
from dataclasses import dataclass
from typing import Any

from cachebuild.errors import CacheBuildError, RemoteError
from cachebuild.format.manifest import MANIFEST_NAME, Manifest
from cachebuild.storage import Location, open_location
from cachebuild.storage.cache import parse_manifest
from cachebuild.storage.locations import REPLACED_MARK

__all__ = ["Found", "cache_bytes", "cache_summary", "find_caches", "format_table", "list_caches"]

MAX_DEPTH = 4


@dataclass(frozen=True)
class Found:
    path: str  # relative to the listed folder, "/"-separated; "" is the folder itself
    state: str  # "complete" | "unfinished" | "replaced"


def _state(name: str) -> str:
    if name.endswith(".partial"):
        return "unfinished"
    if REPLACED_MARK in name:
        return "replaced"
    return "complete"


def find_caches(location: Location, max_depth: int = MAX_DEPTH) -> list[Found]:
    """Caches (folders holding a manifest) and unfinished staging folders at most ``max_depth`` levels
    below ``location``, sorted by path."""
    found: list[Found] = []
    queue: deque[tuple[str, int]] = deque([("", 0)])
    while queue:
        rel, depth = queue.popleft()
        try:
            entries = location.list_dir(rel)
        except (OSError, RemoteError):
            if not rel:
                raise
            continue  # a sub-folder we may not read: not ours to report on
        base = posixpath.basename(rel)
        if any(name == MANIFEST_NAME and not is_dir for name, is_dir, _ in entries):
            found.append(Found(rel, _state(base)))
            continue
        if base.endswith(".partial"):
            found.append(Found(rel, "unfinished"))
            continue
        if depth < max_depth:
            for name, is_dir, _ in entries:
                if is_dir and not name.startswith("."):
                    queue.append((posixpath.join(rel, name) if rel else name, depth + 1))
    return sorted(found, key=lambda f: f.path)


def cache_bytes(location: Location, manifest: Manifest) -> int | None:
    """The bytes of a cache's data: its file table's total and its columns, else what the folder lists (None
    when a server lists no sizes)."""
    if manifest.files:  # columns are outside the file table (docs/FORMAT.md)
        return int(manifest.files["bytes"]) + sum(c.size for c in manifest.columns.values())
    try:
        sizes = location.list_files().values()
    except (OSError, RemoteError):
        return None
    return None if any(v < 0 for v in sizes) else sum(sizes)


def cache_summary(location: Location, found: Found) -> dict[str, Any]:
    """One ``ls`` row: what the manifest says (nothing decoded, nothing re-hashed)."""
    row: dict[str, Any] = {"path": found.path or ".", "where": location.describe(), "state": found.state}
    if found.state == "unfinished" and not location.exists(MANIFEST_NAME):
        return row
    try:
        manifest = parse_manifest(location.read_bytes(MANIFEST_NAME), location.describe(MANIFEST_NAME))
    except (CacheBuildError, OSError, ValueError) as e:
        row["error"] = str(e).splitlines()[0]
        return row
    m = manifest
    row.update({
        "dataset": m.dataset, "split": m.split, "shape": list(m.shape), "fit": m.fit, "storage": m.storage,
        "count": m.count, "bytes": cache_bytes(location, m), "created": m.created,
        "version": m.tool.get("version"), "fingerprint": m.build_key[:12], "build_key": m.build_key,
        "source_fingerprint": m.source.get("fingerprint"), "built_by": m.built_by or None,
        "columns": {n: {"dtype": c.dtype, "shape": list(c.shape)} for n, c in sorted(m.columns.items())},
    })
    return row


def list_caches(where: str | os.PathLike[str] | Location, max_depth: int = MAX_DEPTH) -> list[dict[str, Any]]:
    location = open_location(where)
    rows = []
    for found in find_caches(location, max_depth):
        loc = location.child(found.path) if found.path else location
        rows.append(cache_summary(loc, found))
    return rows


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return "?"  # pragma: no cover


def format_table(rows: list[dict[str, Any]]) -> str:
    """Aligned text, one line per cache."""
    head = ["PATH", "DATASET/SPLIT", "SHAPE", "FIT", "STORAGE", "COUNT", "SIZE", "BUILT", "VERSION", "FINGERPRINT"]
    lines = [head]
    for r in rows:
        path = r["path"] + ("" if r["state"] == "complete" else f" ({r['state']})")
        if "dataset" not in r:
            lines.append([path, r.get("error", "no manifest yet"), *[""] * 8])
            continue
        h, w, c = r["shape"]
        lines.append([path, f"{r['dataset']}/{r['split']}", f"{h}x{w}x{c}", r["fit"], r["storage"], str(r["count"]),
                      _size(r["bytes"]), r["created"].replace("+00:00", "Z"), str(r["version"]), r["fingerprint"]])
    if any("last_used" in r for r in rows):  # the caches of a store: their last use, their live leases
        head += ["LAST USED", "READERS"]
        for line, r in zip(lines[1:], rows, strict=True):
            used = r.get("last_used")
            line += [used.replace("+00:00", "Z") if used else ("never" if "last_used" in r else ""),
                     str(r["readers"]) if "readers" in r else ""]
    if any(r.get("columns") for r in rows):  # caches with columns (format version 3): their names
        head.append("COLUMNS")
        for line, r in zip(lines[1:], rows, strict=True):
            line.append(",".join(r.get("columns") or ()))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(wd) for cell, wd in zip(line, widths, strict=True)).rstrip()
                     for line in lines)
