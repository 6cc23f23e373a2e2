"""``cachebuild pull URL DEST``: copy a cache (or a folder of splits) to a local folder, checked and atomic.

Files arrive in ``<DEST>.partial/`` (each checked whole on arrival: :mod:`cachebuild.share.transfer`), the file
table and then the manifest are written last, and the folder is renamed to ``DEST``: an interrupted pull never
looks like a cache. The staging folder records which source manifest it is filling (``pull.json``); rerun, the
same pull keeps every file already there (each was renamed into place only after it matched its checksum, and
fsynced) and fetches the rest. A ``DEST`` holding a different cache is replaced only with ``force``, as
``--force`` replaces a build (jobs reading the old one keep it); a ``DEST`` that is not a cache is never
replaced, nor one holding files its manifest does not name, nor a ``DEST.partial`` we did not make
(:mod:`cachebuild.builder.destination`). A ``DEST`` holding this cache with a file missing or of the wrong
size is not up to date: ``force`` pulls it again. The same lock as a build of ``DEST`` is held throughout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachebuild.atomic import write_bytes_atomic, write_json_atomic
from cachebuild.builder.destination import check_replaceable, is_own_staging, some_names
from cachebuild.builder.locks import exclusive_lock
from cachebuild.errors import (
    CacheBuildError,
    CacheCorruptError,
    CacheExistsError,
    OptionError,
    OutputError,
    TransferError,
)
from cachebuild.format.manifest import MANIFEST_NAME, Manifest, different_cache
from cachebuild.share.contents import CacheContents, read_contents, read_manifest_bytes, split_caches
from cachebuild.share.transfer import DEFAULT_JOBS, download
from cachebuild.storage import LocalLocation, Location, open_location
from cachebuild.storage.cache import (
    CacheReader,
    install_staged,
    local_files,
    parse_manifest,
    remove_unfinished_writes,
    staging_path,
)
from cachebuild.storage.locations import ReaderLock

__all__ = ["PULL_MARKER", "PullResult", "pull"]

log = logging.getLogger("cachebuild")

PULL_MARKER = "pull.json"  # in the staging folder: the source manifest it is being filled from


@dataclass(frozen=True)
class PullResult:
    dest: Path
    status: str  # "pulled" | "up to date"
    files: int  # files of the cache (manifest and table not counted)
    fetched: int  # fetched by this run
    kept: int  # already in the staging folder from an interrupted run
    bytes_fetched: int
    seconds: float

    def describe(self) -> str:
        if self.status == "up to date":
            return f"{self.dest}: up to date ({self.files} files)"
        rate = self.bytes_fetched / self.seconds / 1e6 if self.seconds > 0 else float("nan")
        kept = f", {self.kept} already there from an earlier run" if self.kept else ""
        return (f"{self.dest}: pulled {self.fetched} files ({self.bytes_fetched / 1e6:.1f} MB) in "
                f"{self.seconds:.1f} s, {rate:.0f} MB/s{kept}; every file checked")


def pull(src: str | os.PathLike[str] | Location, dest: str | os.PathLike[str], *, force: bool = False,
         jobs: int = DEFAULT_JOBS, progress: bool | None = None, wait: float | None = None,
         storage_options: dict[str, Any] | None = None) -> list[PullResult]:
    """Pull the cache at ``src`` into ``dest``; a folder of caches (``train/``, ``val/``...) into one
    sub-folder each. Raises :class:`~cachebuild.errors.TransferError` naming the files that failed their
    check (the others are kept for the next run)."""
    location = open_location(src, storage_options)
    dest = Path(dest)
    _check_destination_path(location, dest)
    raw = read_manifest_bytes(location)
    if raw is None:
        splits = split_caches(location)
        if not splits:
            read_contents(location)  # raises: not a cache (with the standard hints)
        log.info("%s holds %d caches: %s", location.describe(), len(splits), ", ".join(splits))
        return [_pull_one(location.child(s), dest / s, None, force, jobs, progress, wait) for s in splits]
    return [_pull_one(location, dest, raw, force, jobs, progress, wait)]


def _check_destination_path(location: Location, dest: Path) -> None:
    """Refuse, before anything is created, a ``dest`` inside a local source (the copy, its lock and staging
    folder would be written into the cache being read) or under a regular file."""
    if location.is_local:
        src = location.local_path().resolve()
        there = dest.resolve()
        if src in there.parents:
            raise OptionError(f"the destination {dest} is inside the cache being copied, {location.describe()}: "
                              f"the copy would be written into it; choose a destination outside it")
    for p in (dest, *dest.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise OutputError(f"{p} is a file, not a folder, so {dest} cannot be made there: choose another "
                                  f"destination")
            break


def _pull_one(location: Location, dest: Path, raw: bytes | None, force: bool, jobs: int, progress: bool | None,
              wait: float | None) -> PullResult:
    t0 = time.perf_counter()
    reader_lock = None
    if isinstance(location, LocalLocation) and location.local_path().is_dir():
        # A local source (a shared folder) could be rebuilt with --force while we copy: read the one we opened.
        location = location.pinned()
        reader_lock = ReaderLock(location.local_path())
        raw = None  # read again from the folder now pinned: a rebuild may have swapped it since
    try:
        contents = read_contents(location, raw)  # everything is validated before anything is written
        with exclusive_lock(dest, wait=wait, action="building or pulling"):
            if _up_to_date(dest, contents, force):
                return PullResult(dest, "up to date", len(contents.items), 0, 0, 0, time.perf_counter() - t0)
            return _fetch_and_install(location, dest, contents, force, jobs, progress, t0)
    finally:
        if reader_lock is not None:
            reader_lock.close()


def _up_to_date(dest: Path, contents: CacheContents, force: bool) -> bool:
    """True when ``dest`` already holds this cache; raises when it holds something we must not replace."""
    if not (dest.exists() or dest.is_symlink()):
        return False
    if not dest.is_symlink() and (dest / MANIFEST_NAME).is_file():
        here = (dest / MANIFEST_NAME).read_bytes()
        try:
            old: Manifest | None = parse_manifest(here, str(dest / MANIFEST_NAME))
        except CacheBuildError:
            old = None
        # The same cache: the same contents (a build key alone is not: see Manifest.content_id).
        if here == contents.raw or (old is not None and old.content_id == contents.manifest.content_id and not force):
            damaged = _damaged_files(dest, contents)  # a stat per file: a manifest alone is not the cache
            if not damaged:
                return True
            if not force:
                raise CacheExistsError(f"{dest} holds this cache, damaged: {some_names(damaged)}; pass --force to "
                                       f"pull it again (jobs reading it keep the damaged copy)")
        elif not force:
            raise CacheExistsError(f"{dest} holds {different_cache(old, contents.manifest, 'the source')}; pass "
                                   f"--force to replace it (jobs reading it keep the old one)")
        # --force replaces only a folder provably ours: it is set aside, then deleted with everything in it.
        check_replaceable(dest, None, other="another destination")
        return False
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        dest.rmdir()
        return False
    raise CacheExistsError(f"{dest} exists and is not a cachebuild cache; refusing to write there: choose another "
                           f"destination")


def _damaged_files(dest: Path, contents: CacheContents) -> list[str]:
    """The files of the cache that ``dest`` lacks or holds at another size than the cache's file list."""
    expected = [(i.name, i.size) for i in contents.items]
    if contents.table_name is not None and contents.table is not None:
        expected.append((contents.table_name, len(contents.table)))
    damaged = []
    for name, size in expected:
        try:
            st = (dest / name).stat()
        except OSError:
            damaged.append(f"{name} (missing)")
            continue
        if size >= 0 and st.st_size != size:
            damaged.append(f"{name} ({st.st_size} bytes, expected {size})")
    return damaged


def _read_marker(staging: Path) -> Any:
    """The ``pull.json`` in ``staging`` as JSON (None: none, or not JSON)."""
    try:
        return json.loads((staging / PULL_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _prepare_staging(staging: Path, marker: dict[str, Any]) -> None:
    if staging.exists() or staging.is_symlink():
        folder = staging.is_dir() and not staging.is_symlink()
        found = _read_marker(staging) if folder else None
        # Ours to discard: a pull's (its marker) or a build's (is_own_staging); anything else is left alone.
        pulls = isinstance(found, dict) and bool(found.get("manifest_sha256"))
        if not folder or not (pulls or is_own_staging(staging)):
            raise CacheExistsError(f"{staging} exists and was not made by cachebuild (a pull keeps its unfinished "
                                   f"work there); move it away or choose another destination")
        if found != marker:
            log.warning("discarding %s: it was being filled from another source or by a build", staging)
            shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    if not (staging / PULL_MARKER).is_file():
        write_json_atomic(staging / PULL_MARKER, marker)


def _fetch_and_install(location: Location, dest: Path, contents: CacheContents, force: bool, jobs: int,
                       progress: bool | None, t0: float) -> PullResult:
    staging = staging_path(dest)
    _prepare_staging(staging, {"source": location.describe(), "manifest_sha256": contents.manifest_sha256})
    wanted = {i.name: i for i in contents.items}
    remove_unfinished_writes(staging)  # a killed run's half-written files
    kept = set()
    for name, size in local_files(staging, skip=(PULL_MARKER,)).items():
        item = wanted.get(name)
        if item is not None and (item.size < 0 or item.size == size):
            kept.add(name)  # it was renamed into place only after it matched, and fsynced: keep it
        else:
            (staging / name).unlink()  # ours (staging is ours), and not part of this cache
    if kept:
        log.info("resuming the pull into %s: %d of %d files already there", dest, len(kept), len(wanted))
    todo = [i for i in contents.items if i.name not in kept]
    outcome = download(location, todo, staging, jobs=jobs, progress=progress, desc=dest.name)
    if outcome.failed:
        lines = [f"  {name}: {why}" for name, why in sorted(outcome.failed.items())]
        raise TransferError(
            f"pull of {location.describe()} into {dest} is incomplete: {len(outcome.failed)} of {len(wanted)} files "
            f"failed their check or could not be fetched, and were not kept:\n" + "\n".join(lines) +
            f"\nthe {len(wanted) - len(outcome.failed)} others are kept in {staging}: rerun the same pull to fetch "
            f"the rest (a file damaged at the source needs the source fixed: verify it, push it again)")
    if contents.table is not None:
        write_bytes_atomic(staging / contents.manifest.files["table"], contents.table)
    write_bytes_atomic(staging / MANIFEST_NAME, contents.raw)
    _check_staged(staging, contents)
    (staging / PULL_MARKER).unlink()
    install_staged(staging, dest, replace=force)
    return PullResult(dest, "pulled", len(wanted), len(outcome.moved), len(kept), outcome.bytes_moved,
                      time.perf_counter() - t0)


def _check_staged(staging: Path, contents: CacheContents) -> None:
    """Open the staged cache as a reader would (headers, sizes); a cache without a file table is verified
    whole here, its files having had no per-file check."""
    try:
        reader = CacheReader(staging)
        problems = [] if contents.table is not None else reader.verify()
        del reader
    except CacheCorruptError as e:
        problems = [str(e)]
    if problems:
        shutil.rmtree(staging)
        raise TransferError(f"the pulled copy of {contents.manifest.dataset}/{contents.manifest.split} failed "
                            f"verification and was discarded: " + "; ".join(problems[:5]) +
                            (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
