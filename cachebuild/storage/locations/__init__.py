"""Where a cache lives, apart from how its pixels are laid out: a local folder (:class:`LocalLocation`: plain
files and memory maps, zero copy) or any fsspec URL (:class:`~cachebuild.storage.locations.url.FsspecLocation`,
imported where a URL is opened). A :class:`Location` hands out the bytes of the files a manifest names, and
nothing else: every name goes through :func:`~cachebuild.format.manifest.check_name` first.

Replacing a local cache while jobs read it: ``--force`` (or a pull over a different cache) renames the old folder
to ``<name>.replaced-<time>-<pid>`` beside the new one (:func:`set_aside`). A reader pins the folder it opened by
identity (device, inode), so every file it opens later, in any process, comes from that folder, found again among
the ``.replaced-*`` siblings after a rename; each reader process holds a shared ``flock`` on its
``manifest.json`` (:class:`ReaderLock`), and a replaced folder is deleted only once an exclusive lock on it
succeeds (:func:`sweep_replaced`: the next build or pull of that output). NFS: Linux emulates ``flock`` with POSIX
locks the server sees; on a filesystem without working locks, a reader whose folder was deleted fails by name.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import glob
import logging
import os
import re
import secrets
import shutil
import stat
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit, urlunsplit

from cachebuild.atomic import AtomicFile, write_bytes_atomic
from cachebuild.errors import CacheChangedError, CacheCorruptError
from cachebuild.format.manifest import MANIFEST_NAME, URL_SCHEME, check_name

__all__ = ["REPLACED_MARK", "LocalLocation", "Location", "ReaderLock", "check_name", "find_pinned", "folder_identity",
           "is_locked", "is_url", "is_web_url", "open_location", "redact", "replaced_folders", "set_aside",
           "sweep_replaced"]

log = logging.getLogger("cachebuild")


def open_location(where: str | os.PathLike[str] | Location,
                  storage_options: dict[str, Any] | None = None) -> Location:
    """A local path (or ``file://`` URL: memory maps, zero copy) or any other fsspec URL."""
    if isinstance(where, Location):
        return where
    s = os.fspath(where)
    if s.startswith("file://"):
        return LocalLocation(s[len("file://"):])
    if is_url(s):
        from cachebuild.storage.locations.url import FsspecLocation

        return FsspecLocation(s, storage_options)
    return LocalLocation(s)


# ---------------------------------------------------------------- URLs

def is_url(where: str) -> bool:
    """True for ``scheme://...`` (s3, gs, http(s), file, memory...)."""
    return bool(URL_SCHEME.match(where))


def is_web_url(where: str) -> bool:
    """True for ``http://`` and ``https://`` URLs, whose index pages link names percent-encoded."""
    return is_url(where) and where.split("://", 1)[0].lower() in ("http", "https")


def redact(url: str) -> str:
    """``url`` without user, password and query string (presigned URLs carry their credentials there)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


# ---------------------------------------------------------------- the interface

class Location(ABC):
    """A folder of files, local or remote, addressed by plain relative names."""

    url: str

    @property
    def is_local(self) -> bool:
        return False

    @property
    def is_pinned(self) -> bool:
        """Reads come from the cache this location held when :meth:`pinned` made it, whatever replaced it."""
        return False

    def describe(self, name: str = "") -> str:
        """How this location (or one of its files) is shown in messages: never with credentials."""
        return redact(self.url + ("/" + name if name else ""))

    @abstractmethod
    def child(self, name: str) -> Location: ...

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def read_bytes(self, name: str) -> bytes: ...

    @abstractmethod
    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes ``[start, end)`` of each range; a range past the end of the file is an error."""

    def read_many(self, wanted: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> list[list[bytes]]:
        """:meth:`read_ranges` of several files, one list per ``(name, ranges)``; a remote location sends
        every request together (a batch's slowest request then delays it once, not once per file)."""
        return [self.read_ranges(name, ranges) for name, ranges in wanted]

    @abstractmethod
    def read_heads(self, names: Sequence[str], nbytes: int) -> list[bytes]:
        """The first (up to) ``nbytes`` of each file, fetched concurrently where that helps."""

    @abstractmethod
    def list_files(self) -> dict[str, int]:
        """Every file below this location, recursively: relative name -> size in bytes (-1: not listed)."""

    @abstractmethod
    def list_dir(self, name: str = "") -> list[tuple[str, bool, int]]:
        """The entries directly in folder ``name``: (name, is a folder, size in bytes or -1)."""

    # ---------------------------------------------------------------- write side (push, pull)
    @abstractmethod
    def put_file(self, name: str, local: str | os.PathLike[str]) -> None:
        """Copy the local file ``local`` to ``name``, whole (replacing what was there)."""

    @abstractmethod
    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (replacing what was there)."""

    @abstractmethod
    def remove(self, *names: str) -> None:
        """Delete the files ``names`` (in bulk where the store can); files already gone are fine."""

    # ---------------------------------------------------------------- versions (a push's claim)
    @property
    def conditional_writes(self) -> bool:
        """Whether :meth:`write_if` can make a write conditional on a file's version (S3 here)."""
        return False

    def stat(self, name: str, fresh: bool = False) -> dict[str, Any]:
        """The store's description of ``name`` (``size``, ``ETag``, ``LastModified``...); ``fresh``: asked of the
        store, not from a listing cached. A missing file raises :class:`~cachebuild.errors.RemoteNotFoundError`."""
        raise TypeError(f"{self.describe()} is not a remote location")

    def write_if(self, name: str, data: bytes, match: str | None) -> str | None:
        """Write ``name`` whole only if it is at version ``match`` (its ETag), or, with ``match`` None, only if
        there is none; the new ETag ("" when the store did not say), or None when the condition failed."""
        raise TypeError(f"{self.describe()} offers no conditional writes")

    def forget_listing(self, name: str = "") -> None:
        """Drop what this process cached of listings of ``name``: a read sized from one would miss a file
        written since. Nothing to drop by default."""
        return None

    def local_path(self, name: str = "") -> Path:
        raise TypeError(f"{self.describe()} is not a local folder")

    def open_file(self, name: str) -> BinaryIO:
        raise TypeError(f"{self.describe()} is not a local folder")

    def pinned(self, anchor: str = "") -> Location:
        """This location with its reads tied to the cache it holds now (see the subclasses); ``anchor`` is
        the file a writer removes first and writes last (the manifest)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


# ---------------------------------------------------------------- a local folder

class LocalLocation(Location):
    """A local (or NFS-mounted) folder. :meth:`pinned` ties it to the folder it names now, by identity: renamed
    aside by a rebuild (:func:`set_aside`), every file is still opened from it."""

    def __init__(self, root: str | os.PathLike[str], identity: tuple[int, int] | None = None) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.identity = identity
        self._folder = self.root

    @property
    def is_local(self) -> bool:
        return True

    @property
    def is_pinned(self) -> bool:
        return self.identity is not None

    def pinned(self, anchor: str = "") -> LocalLocation:
        return LocalLocation(self.root, folder_identity(self.root))

    def folder(self) -> Path:
        """The folder to open files in: ``root``, or where a rebuild moved the pinned folder."""
        if self.identity is None:
            return self.root
        try:
            if folder_identity(self._folder) == self.identity:
                return self._folder
        except OSError:
            pass
        found = find_pinned(self.root, self.identity)
        if found is None:
            raise CacheChangedError(
                f"the cache at {self.root} was replaced while this job read it, and the copy it was reading is "
                f"gone (a filesystem without working locks, or deleted by hand); restart the job to read the new cache"
            )
        self._folder = found
        return found

    def describe(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def local_path(self, name: str = "") -> Path:
        return self.folder() / check_name(name) if name else self.folder()

    def open_file(self, name: str) -> BinaryIO:
        """``name`` opened for reading from the pinned folder. Resolving the folder and opening the file are
        two steps, and a rebuild may rename the folder aside in between, when ``root`` already holds the
        new cache: so the folder at the path used is checked again after the open, and a swap opens the file
        again from where the pinned folder went. Raises FileNotFoundError for a file the folder lacks."""
        for _ in range(5):
            folder = self.folder()
            try:
                f = open(folder / check_name(name), "rb")  # noqa: SIM115 (returned to the caller)
            except FileNotFoundError:
                f = None
            try:
                same = self.identity is None or folder_identity(folder) == self.identity
            except OSError:
                same = False
            if same:
                if f is None:
                    raise FileNotFoundError(errno.ENOENT, "No such file", str(folder / name))
                return f
            if f is not None:
                f.close()
        raise CacheChangedError(f"the cache at {self.root} keeps being replaced while this job opens "
                                f"{name}; restart the job")

    def child(self, name: str) -> LocalLocation:
        return LocalLocation(self.local_path(name))

    def exists(self, name: str) -> bool:
        return self.local_path(name).exists()

    def size(self, name: str) -> int:
        return self.local_path(name).stat().st_size

    def read_bytes(self, name: str) -> bytes:
        with self.open_file(name) as f:
            return f.read()

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        out = []
        with self.open_file(name) as f:
            for start, end in ranges:
                data = os.pread(f.fileno(), end - start, start)
                if len(data) != end - start:
                    raise CacheCorruptError(f"{self.describe(name)} is truncated: bytes [{start}, {end}) "
                                            f"requested, the file ends at {os.fstat(f.fileno()).st_size}")
                out.append(data)
        return out

    def read_heads(self, names: Sequence[str], nbytes: int) -> list[bytes]:
        heads = []
        for name in names:
            with self.open_file(name) as f:
                heads.append(f.read(nbytes))
        return heads

    def list_dir(self, name: str = "") -> list[tuple[str, bool, int]]:
        out = []
        with os.scandir(self.local_path(name)) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    out.append((e.name, True, -1))
                elif e.is_file(follow_symlinks=False):
                    out.append((e.name, False, e.stat().st_size))
        return sorted(out)

    def put_file(self, name: str, local: str | os.PathLike[str]) -> None:
        target = self.local_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "rb") as src, AtomicFile(target, durable=True) as dst:
            shutil.copyfileobj(src, dst.file, 8 << 20)

    def write_bytes(self, name: str, data: bytes) -> None:
        target = self.local_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(target, data)

    def remove(self, *names: str) -> None:
        for name in names:
            self.local_path(name).unlink(missing_ok=True)

    def list_files(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for dirpath, _, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for fname in files:
                st = os.stat(os.path.join(dirpath, fname))
                if stat.S_ISREG(st.st_mode):
                    found[fname if rel == "." else f"{rel}/{fname}"] = st.st_size
        return found


# ---------------------------------------------------------------- replacing a local cache under its readers

REPLACED_MARK = ".replaced-"


def folder_identity(folder: Path) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_dev, st.st_ino


def replaced_folders(out: Path) -> list[Path]:
    """The replaced versions of the cache at ``out`` still on disk: exactly the names :func:`set_aside`
    gives (a user's ``train.replaced-2024`` is not one of them)."""
    exact = re.compile(re.escape(out.name) + re.escape(REPLACED_MARK) + r"\d{8}T\d{6}-\d+-[0-9a-f]{6}")
    try:
        return sorted(p for p in out.parent.glob(f"{glob.escape(out.name)}{REPLACED_MARK}*")
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
            fd = os.open(folder / MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC)
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
    aside = out.with_name(f"{out.name}{REPLACED_MARK}{stamp}-{os.getpid()}-{secrets.token_hex(3)}")
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
        manifest = folder / MANIFEST_NAME
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
