"""Replacing a local cache while jobs read it: the old one stays whole until its last reader is gone.

``--force`` (or a pull over a different cache) renames the old folder to ``<name>.replaced-<time>-<pid>``
beside the new one instead of deleting it. A reader pins the folder it opened by its identity (device,
inode): every file it opens later, in any process (DataLoader workers, fork or spawn), comes from that
folder, found again by identity among the ``.replaced-*`` siblings after a rename. Each reader process
holds a shared ``flock`` on the folder's ``manifest.json``; a replaced folder is deleted only when an
exclusive lock on it succeeds, i.e. by the next build or pull of that output once no reader is left.

On NFS, Linux emulates ``flock`` with POSIX locks that the server sees, so the rule holds across clients
(NFSv4, or v3 with lockd); on a filesystem without working locks a replaced cache may be deleted under a
reader, which then fails with a named error when it opens a file it had not opened yet.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import glob
import logging
import os
import re
import secrets
import shutil
import weakref
from pathlib import Path

__all__ = ["ReaderLock", "find_pinned", "folder_identity", "is_locked", "replaced_folders", "set_aside",
           "sweep_replaced"]

log = logging.getLogger("cachebuild")

MARK = ".replaced-"
MANIFEST = "manifest.json"


def folder_identity(folder: Path) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_dev, st.st_ino


def replaced_folders(out: Path) -> list[Path]:
    """The replaced versions of the cache at ``out`` still on disk: exactly the names :func:`set_aside`
    gives (a user's ``train.replaced-2024`` is not one of them)."""
    exact = re.compile(re.escape(out.name) + re.escape(MARK) + r"\d{8}T\d{6}-\d+-[0-9a-f]{6}")
    try:
        return sorted(p for p in out.parent.glob(f"{glob.escape(out.name)}{MARK}*")
                      if exact.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def find_pinned(root: Path, identity: tuple[int, int]) -> Path | None:
    """Where the folder first opened at ``root`` is now: ``root`` itself or one of its replaced versions."""
    for candidate in (root, *replaced_folders(root)):
        try:
            if folder_identity(candidate) == identity:
                return candidate
        except OSError:
            continue
    return None


class ReaderLock:
    """A shared lock on a cache folder for as long as this object lives (readers keep it while open)."""

    def __init__(self, folder: Path) -> None:
        self._release: weakref.finalize | None = None
        try:
            fd = os.open(folder / MANIFEST, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no manifest: not a cache, which the reader reports
            return
        self._release = weakref.finalize(self, os.close, fd)  # also at interpreter exit
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # no locks on this filesystem
            self.close()

    def close(self) -> None:
        if self._release is not None:
            self._release()


def set_aside(out: Path) -> Path:
    """Rename the cache at ``out`` to a ``.replaced-`` name beside it (readers keep it); returns the new path."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    aside = out.with_name(f"{out.name}{MARK}{stamp}-{os.getpid()}-{secrets.token_hex(3)}")
    out.rename(aside)
    return aside


def is_locked(path: Path) -> bool:
    """True while a reader holds its shared lock on ``path`` (the check releases at once)."""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def sweep_replaced(out: Path) -> list[Path]:
    """Delete replaced versions of ``out`` that no reader holds; returns those kept (still in use)."""
    kept = []
    for folder in replaced_folders(out):
        manifest = folder / MANIFEST
        if not manifest.is_file():
            kept.append(folder)  # not something we can prove we wrote: leave it
            continue
        # readers of an older manifest of it (swapped by `columns add`) hold their lock on the inode kept there
        held = [manifest, *sorted(folder.glob("columns/held-*.json"))]
        if any(is_locked(p) for p in held):
            kept.append(folder)
            continue
        shutil.rmtree(folder)
    if kept:
        log.info("kept %d replaced version(s) of %s while jobs still read them; the next build of it removes "
                 "them once those jobs are done", len(kept), out)
    return kept
