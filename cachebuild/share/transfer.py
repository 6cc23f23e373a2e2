"""Moving a cache's files between a location and a local folder: in parallel, one file per task, each file
checked whole against its expected size and digest, one progress bar for all of them (``docs/sharing.md``,
"Push, pull and what they check").

A cache with a file table (``files.json``) is checked file by file: size and digest (by the cache's own
algorithm) against the table, whose own digest is in the manifest. A download is written under a temporary
name and renamed into place (fsynced) only when both match; an upload leaves only after the local file
matched. A file that fails is named and skipped; the others go on. An older cache without a table is checked
by size where the store lists one, then verified whole by its backend before it is installed.

Downloads of files over :data:`PIECE_BYTES` go in range requests of that size, so a dropped connection costs
one range (each retried by the location) and memory stays bounded whatever the shard size.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachebuild.atomic import AtomicFile
from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import Digest
from cachebuild.storage import Location
from cachebuild.storage.kinds.base import digest_file

__all__ = ["DEFAULT_JOBS", "PIECE_BYTES", "Item", "Outcome", "download", "upload"]

PIECE_BYTES = 16 << 20
DEFAULT_JOBS = 8  # concurrent files: enough to fill a link to an object store, few enough for an NFS server


@dataclass(frozen=True)
class Item:
    """One file to move: its name in the cache, expected size (-1: unknown), expected digest (None: not
    checked per file) and the algorithm of that digest (the cache manifest's)."""

    name: str
    size: int
    digest: str | None
    algorithm: Digest


@dataclass
class Outcome:
    moved: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why
    bytes_moved: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.bytes_moved / self.seconds if self.seconds > 0 else float("nan")


class _Mismatch(CacheBuildError, ValueError):
    pass


def _check(item: Item, size: int, digest: str, what: str) -> None:
    if item.size >= 0 and size != item.size:
        raise _Mismatch(f"{what} has {size} bytes, the file table says {item.size}")
    if item.digest is not None and digest != item.digest:
        raise _Mismatch(f"{what}: {item.algorithm.name} {digest[:12]}..., the file table says {item.digest[:12]}...")


def _bar(total: int, files: int, desc: str, enabled: bool | None) -> Any:
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, disable=not enabled,
                smoothing=0.1, postfix=f"0/{files} files")


def _run(items: Sequence[Item], one: Callable[[Item, Callable[[int], None]], None], *, jobs: int,
         progress: bool | None, desc: str) -> Outcome:
    """``one(item, count_bytes)`` for every item on ``jobs`` threads; failures of single files are collected,
    anything else (Ctrl-C) stops the rest."""
    out = Outcome()
    lock = threading.Lock()
    t0 = time.perf_counter()
    total = sum(max(0, i.size) for i in items)
    with _bar(total, len(items), desc, progress) as bar:
        def count(n: int) -> None:
            with lock:
                out.bytes_moved += n
                bar.update(n)

        pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="cachebuild-transfer")
        try:
            pending: dict[Future[None], Item] = {pool.submit(one, item, count): item for item in items}
            done_files = 0
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    item = pending.pop(fut)
                    try:
                        fut.result()
                        out.moved.append(item.name)
                    except (CacheBuildError, OSError) as e:
                        out.failed[item.name] = str(e)
                    done_files += 1
                    bar.set_postfix_str(f"{done_files}/{len(items)} files", refresh=False)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    out.seconds = time.perf_counter() - t0
    return out


def _download_one(src: Location, folder: Path, item: Item, count: Callable[[int], None]) -> None:
    target = folder / item.name
    target.parent.mkdir(parents=True, exist_ok=True)
    h = item.algorithm.new()
    got = 0
    with AtomicFile(target, durable=True) as f:  # renamed into place only if no exception leaves this block
        size = item.size
        if size > PIECE_BYTES:
            actual = src.size(item.name)  # a longer remote file would pass a hash of its first `size` bytes
            if actual != size:
                raise _Mismatch(f"{src.describe(item.name)} has {actual} bytes, the file table says {size}")
            pieces = [(lo, min(lo + PIECE_BYTES, size)) for lo in range(0, size, PIECE_BYTES)]
        else:
            pieces = [None]  # type: ignore[list-item]
        for piece in pieces:
            data = src.read_bytes(item.name) if piece is None else src.read_ranges(item.name, [piece])[0]
            h.update(data)
            f.file.write(data)
            got += len(data)
            count(len(data))
        _check(item, got, h.hexdigest(), src.describe(item.name))


def download(src: Location, items: Sequence[Item], folder: Path, *, jobs: int = DEFAULT_JOBS,
             progress: bool | None = None, desc: str = "pull") -> Outcome:
    """Fetch ``items`` from ``src`` into ``folder``; a file lands under its name only whole and checked."""
    return _run(items, lambda item, count: _download_one(src, folder, item, count), jobs=jobs,
                progress=progress, desc=desc)


def _upload_one(folder: Path, dst: Location, item: Item, count: Callable[[int], None]) -> None:
    path = folder / item.name
    size = path.stat().st_size
    if item.digest is not None or item.size >= 0:
        digest = digest_file(path, item.algorithm) if item.digest is not None else ""
        try:
            _check(item, size, digest, str(path))
        except _Mismatch as e:
            raise _Mismatch(f"{e}: the local cache is damaged, not uploaded (rebuild or re-pull it)") from None
    dst.put_file(item.name, path)
    count(size)


def upload(folder: Path, items: Sequence[Item], dst: Location, *, jobs: int = DEFAULT_JOBS,
           progress: bool | None = None, desc: str = "push") -> Outcome:
    """Send ``items`` from the local ``folder`` to ``dst``; a file leaves only after it matched its entry."""
    return _run(items, lambda item, count: _upload_one(folder, dst, item, count), jobs=jobs, progress=progress,
                desc=desc)
