"""A cache in a local (or NFS-mounted) folder: plain files and memory maps, zero copy."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from cachebuild.errors import CacheChangedError, CacheCorruptError
from cachebuild.storage.locations.base import Location
from cachebuild.storage.locations.names import check_name

__all__ = ["LocalLocation"]


class LocalLocation(Location):
    """A local (or NFS-mounted) folder.

    :meth:`pinned` ties the location to the folder it names now, by identity: if the folder is later
    renamed aside by a rebuild (``cachebuild.storage.locations.replacement``), every file is still opened from it.
    """

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
        from cachebuild.storage.locations.replacement import folder_identity

        return LocalLocation(self.root, folder_identity(self.root))

    def folder(self) -> Path:
        """The folder to open files in: ``root``, or where a rebuild moved the pinned folder."""
        if self.identity is None:
            return self.root
        from cachebuild.storage.locations.replacement import find_pinned, folder_identity

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
        from cachebuild.storage.locations.replacement import folder_identity

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
        from cachebuild.atomic import AtomicFile

        target = self.local_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "rb") as src, AtomicFile(target, durable=True) as dst:
            shutil.copyfileobj(src, dst.file, 8 << 20)

    def write_bytes(self, name: str, data: bytes) -> None:
        from cachebuild.atomic import write_bytes_atomic

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
