"""``cachebuild push SRC URL``: copy a local cache (or a folder of splits) to a URL prefix, manifest last.

Object stores have no rename, so the order is the guarantee: while a push runs, the prefix holds a marker
(``push-in-progress.json``, naming the manifest being pushed; :mod:`cachebuild.share.claim`) and no
``manifest.json``; the data files go first (each checked against the file table before it leaves: a damaged
local cache is not spread), then the file table, then the manifest, then the marker is removed. A reader of
the URL sees either no cache or the complete one. Rerun after an interruption, a push trusts the files the
marker vouches for when their size matches (an object store creates an object only when its upload
completes) and sends the rest.

Replacing a different cache at the URL needs ``force``, and is done only to a cachebuild manifest. The marker
goes first, naming the old files to delete; then the old manifest (new readers see no cache until the new one
is complete), then the old files the new cache does not hold identically (same name, size and digest, by the
same algorithm); interrupted anywhere in that, the rerun finishes the deletions before it sends anything. Jobs
that opened the old cache from the URL get errors naming the files that vanished or changed (their reads are
pinned to the versions they opened), never the new bytes: to replace a cache in use, push to a new prefix.

A local destination is a pull from ``SRC`` (same checks, atomic rename).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachebuild.errors import (
    CacheBuildError,
    CacheCorruptError,
    CacheExistsError,
    NoSuchBucketError,
    RemoteError,
    RemoteNotFoundError,
    TransferError,
)
from cachebuild.format.manifest import FORMAT_NAME, MANIFEST_NAME, different_cache
from cachebuild.share.claim import ClaimRaced, PushClaim
from cachebuild.share.contents import PUSH_MARKER, CacheContents, read_contents, split_caches
from cachebuild.share.transfer import DEFAULT_JOBS, upload
from cachebuild.storage import LocalLocation, Location, open_location
from cachebuild.storage.cache import CacheReader, FileEntry, parse_manifest, read_file_table
from cachebuild.storage.locations import ReaderLock

__all__ = ["PushResult", "push"]

log = logging.getLogger("cachebuild")


@dataclass(frozen=True)
class PushResult:
    url: str  # redacted
    status: str  # "pushed" | "up to date"
    files: int
    sent: int
    kept: int  # already at the URL (an interrupted push, or unchanged files of a replaced cache)
    bytes_sent: int
    seconds: float

    def describe(self) -> str:
        if self.status == "up to date" and not self.sent:
            return f"{self.url}: up to date ({self.files} files)"
        rate = self.bytes_sent / self.seconds / 1e6 if self.seconds > 0 else float("nan")
        kept = f", {self.kept} already there" if self.kept else ""
        return (f"{self.url}: pushed {self.sent} files ({self.bytes_sent / 1e6:.1f} MB) in {self.seconds:.1f} s, "
                f"{rate:.0f} MB/s{kept}; manifest written last")


def push(src: str | os.PathLike[str], dest: str | os.PathLike[str] | Location, *, force: bool = False,
         jobs: int = DEFAULT_JOBS, progress: bool | None = None, wait: float | None = None,
         storage_options: dict[str, Any] | None = None) -> list[Any]:
    """Push the local cache at ``src`` to ``dest`` (a folder of caches: one sub-prefix each)."""
    location = open_location(dest, storage_options)
    if location.is_local:
        from cachebuild.share.pull import pull

        return pull(src, location.local_path(), force=force, jobs=jobs, progress=progress, wait=wait)
    root = Path(src)
    if (root / MANIFEST_NAME).is_file():
        return [_push_one(root, location, force, jobs, progress)]
    splits = split_caches(LocalLocation(root)) if root.is_dir() else []
    if not splits:
        read_contents(LocalLocation(root))  # raises: not a cache (with the standard hints)
    return [_push_one(root / s, location.child(s), force, jobs, progress) for s in splits]


def _remote_files(dst: Location) -> dict[str, int]:
    try:
        return dst.list_files()
    except NoSuchBucketError:
        raise  # not an empty prefix: nothing can be written there
    except RemoteNotFoundError:
        return {}


def _push_one(root: Path, dst: Location, force: bool, jobs: int, progress: bool | None) -> PushResult:
    t0 = time.perf_counter()
    local = LocalLocation(root).pinned()  # a --force rebuild of SRC meanwhile leaves us reading this one
    reader_lock = ReaderLock(local.local_path())
    try:
        contents = read_contents(local)
        if contents.table is None:
            _verify_whole(local, contents)
        return _send(local.local_path(), dst, contents, force, jobs, progress, t0)
    finally:
        reader_lock.close()


def _verify_whole(local: Location, contents: CacheContents) -> None:
    """A cache without a file table has no per-file checksums: verify it whole before spreading it."""
    problems = CacheReader(local).verify()
    if problems:
        raise CacheCorruptError(f"{local.describe()} fails verification, not pushed: " + "; ".join(problems[:5]))


def _send(folder: Path, dst: Location, contents: CacheContents, force: bool, jobs: int, progress: bool | None,
          t0: float) -> PushResult:
    for attempt in range(3):
        claim = PushClaim(dst, PUSH_MARKER)
        try:
            return _send_claimed(folder, dst, contents, force, jobs, progress, t0, claim)
        except (ClaimRaced, RemoteNotFoundError) as e:
            # Before the claim is ours, a file that vanished means another push is changing the prefix; a
            # bucket that is not there means nothing at all.
            if attempt == 2 or claim.taken or isinstance(e, NoSuchBucketError):
                claim.abandon()
                raise
            log.info("%s changed while this push looked at it (another push); looking again", dst.describe())
        except BaseException:
            claim.abandon()  # a rerun, here or elsewhere, takes it over at once
            raise
        finally:
            claim.release()
    raise AssertionError("unreachable")  # pragma: no cover


def _send_claimed(folder: Path, dst: Location, contents: CacheContents, force: bool, jobs: int,
                  progress: bool | None, t0: float, claim: PushClaim) -> PushResult:
    url = dst.describe()
    claim.watch(MANIFEST_NAME)  # before the listing: a manifest published after it is seen when claiming
    remote = _remote_files(dst)
    trusted: set[str] = set()  # remote files known to hold what the new cache needs
    if MANIFEST_NAME in remote:
        there = dst.read_bytes(MANIFEST_NAME)
        try:
            old = parse_manifest(there, dst.describe(MANIFEST_NAME))
        except CacheBuildError:
            old = None
            _check_ours(there, dst)
        if there == contents.raw or (old is not None and old.content_id == contents.manifest.content_id):
            # The same cache: send only what is missing or of the wrong size (a repair), manifest untouched.
            stray = PUSH_MARKER in remote  # a push killed after its manifest, before removing the marker
            if stray:
                claim.found()  # unless that push still runs (then refused, naming it)
            todo = [i for i in contents.items if remote.get(i.name) != i.size]
            outcome = upload(folder, todo, dst, jobs=jobs, progress=progress, desc=url.rsplit("/", 1)[-1])
            _raise_failed(outcome.failed, url, len(contents.items))
            if stray:
                dst.remove(PUSH_MARKER)
            return PushResult(url, "up to date", len(contents.items), len(outcome.moved),
                              len(contents.items) - len(todo), outcome.bytes_moved, time.perf_counter() - t0)
        if not force:
            raise CacheExistsError(f"{url} holds {different_cache(old, contents.manifest, 'this one')}; pass --force "
                                   f"to replace it (jobs reading it from the URL will then fail: see "
                                   f"`cachebuild push --help`)")
        if PUSH_MARKER in remote:  # left by a push killed after its manifest, or another push starting
            claim.found()
        kept = _clear_old_cache(dst, old, contents, remote, claim)
        trusted = kept or set()
        # Without the old table, old files of the same name and size cannot be told from ours on a rerun.
        marker = {"manifest_sha256": contents.manifest_sha256, "trust_sizes": kept is not None}
    elif PUSH_MARKER in remote:
        marker = claim.found()  # raises naming its holder unless that push is gone
        remove = marker.get("remove")
        if isinstance(remove, list):
            claim.write(marker)  # the claim first: only its holder deletes
            # A --force push stopped while it took the old cache down (nothing new is sent before the list is
            # gone from the marker, so every name still listed is an old file): finish that first. After it,
            # that push's files of the right size are its own, as after an uninterrupted replacement.
            left = sorted({n for n in remove if isinstance(n, str) and n in remote})
            dst.remove(*left)
            log.info("finishing the replacement of the cache at %s: removed %d file(s) of the old one", url,
                     len(left))
            remote = {n: size for n, size in remote.items() if n not in left}
            marker["trust_sizes"] = True
        if marker.get("manifest_sha256") == contents.manifest_sha256 and marker.get("trust_sizes"):
            trusted = {i.name for i in contents.items if remote.get(i.name) == i.size}
            log.info("resuming the push to %s: %d of %d files already there", url, len(trusted), len(contents.items))
        marker = {"manifest_sha256": contents.manifest_sha256,
                  "trust_sizes": bool(marker.get("manifest_sha256") == contents.manifest_sha256
                                      and marker.get("trust_sizes"))}
    elif remote:
        raise CacheExistsError(f"{url} holds {len(remote)} file(s) but no cachebuild cache; refusing to write "
                               f"there: choose an empty prefix")
    else:
        marker = {"manifest_sha256": contents.manifest_sha256, "trust_sizes": True}
    claim.write(marker)
    todo = [i for i in contents.items if i.name not in trusted]
    outcome = upload(folder, todo, dst, jobs=jobs, progress=progress, desc=url.rsplit("/", 1)[-1])
    _raise_failed(outcome.failed, url, len(contents.items))
    if contents.table is not None:
        claim.check()
        dst.write_bytes(contents.manifest.files["table"], contents.table)
    claim.publish(MANIFEST_NAME, contents.raw)  # last: from here the URL holds the complete cache
    claim.release()  # no renewal after this: the marker goes
    try:
        dst.remove(PUSH_MARKER)
    except RemoteError as e:  # a store that cannot delete (plain HTTP PUT): the marker is harmless
        log.warning("could not remove %s: %s", dst.describe(PUSH_MARKER), e)
    return PushResult(url, "pushed", len(contents.items), len(outcome.moved), len(trusted), outcome.bytes_moved,
                      time.perf_counter() - t0)


def _check_ours(raw: bytes, dst: Location) -> None:
    """Raise unless the unusable manifest ``raw`` at ``dst`` is at least a cachebuild one (another release's):
    ``--force`` replaces only what cachebuild wrote."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CacheExistsError(f"{dst.describe(MANIFEST_NAME)} is not a cachebuild manifest; refusing to replace "
                               f"it or write beside it, even with --force: choose another prefix")


def _clear_old_cache(dst: Location, old: Any, contents: CacheContents, remote: dict[str, int],
                     claim: PushClaim) -> set[str] | None:
    """Take down the different cache at ``dst``: marker first (naming what is to go, so an interrupted run is
    resumed), then the manifest, then the files the new cache does not hold identically. Returns the old files
    kept because the new cache has them byte for byte (None: the old cache had no file table, so nothing was
    deleted and nothing can be trusted)."""
    old_table = None
    if old is not None:
        try:
            got = read_file_table(dst, old)
            old_table = got[0] if got is not None else None
        except CacheBuildError:
            old_table = None
    if old_table is not None:  # its columns (format version 3, 4) are outside its table: the manifest lists them
        old_table.update({c.file: FileEntry(c.size, c.digest) for c in old.columns.values()})
    if old_table is None:
        # No table to tell the old cache's files from anything else: delete nothing, trust nothing.
        _unpublish(dst, contents, claim)
        log.warning("%s held a cache without a file table: its files are left in place and every file is sent",
                    dst.describe())
        return None
    new = {i.name: i for i in contents.items}
    keep = {n for n, e in old_table.items()
            if n in new and new[n].size == e.size and new[n].digest == e.digest and new[n].algorithm == old.digest
            and remote.get(n) == e.size}
    stale = sorted(n for n in old_table if n not in keep and n in remote)
    if old.files.get("table") in remote:
        stale.append(old.files["table"])
    _unpublish(dst, contents, claim, remove=stale)
    dst.remove(*stale)
    log.info("replacing the cache at %s: removed its manifest and %d file(s); %d identical file(s) kept",
             dst.describe(), len(stale), len(keep))
    return keep


def _unpublish(dst: Location, contents: CacheContents, claim: PushClaim, remove: list[str] | None = None) -> None:
    """The push marker first (with the old files still to delete, which a rerun then finishes), then the old
    manifest removed: from here new readers of ``dst`` see no cache until the new one is complete."""
    marker: dict[str, Any] = {"manifest_sha256": contents.manifest_sha256, "trust_sizes": False}
    if remove is not None:
        marker["remove"] = remove
    claim.write(marker)  # takes the claim: a second push of another cache stops here
    dst.remove(MANIFEST_NAME)


def _raise_failed(failed: dict[str, str], url: str, total: int) -> None:
    if failed:
        lines = [f"  {name}: {why}" for name, why in sorted(failed.items())]
        raise TransferError(f"push to {url} is incomplete: {len(failed)} of {total} files were not sent:\n"
                            + "\n".join(lines) + "\nno manifest was written there; rerun the same push to send "
                            "the rest")
