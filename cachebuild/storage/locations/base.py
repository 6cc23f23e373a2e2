"""What a location is: a folder of files, local or remote, addressed by plain relative names (the interface
that :mod:`cachebuild.storage.locations.local` and :mod:`cachebuild.storage.locations.url` implement)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from cachebuild.storage.locations.names import redact

__all__ = ["Location"]


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
