"""Where a cache lives, apart from how its pixels are laid out: a local folder or any fsspec URL.

A :class:`Location` hands out the bytes of the files a manifest names, and nothing else: every name goes
through :func:`~cachebuild.storage.locations.names.check_name` first. A local folder is read through plain files and
memory maps (zero copy, :mod:`cachebuild.storage.locations.local`); ``s3://``, ``gs://``, ``http(s)://`` and
every other fsspec protocol go through fsspec (:mod:`cachebuild.storage.locations.url`), with range reads
and each request retried by the one remote layer (:mod:`cachebuild.storage.remote.retry`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cachebuild.storage.locations.base import Location
from cachebuild.storage.locations.local import LocalLocation
from cachebuild.storage.locations.names import is_url

if TYPE_CHECKING:
    from cachebuild.storage.locations.url import FsspecLocation
    from cachebuild.storage.remote.retry import is_transient

__all__ = ["FsspecLocation", "LocalLocation", "Location", "is_transient", "open_location"]


def __getattr__(name: str) -> Any:
    """The fsspec side (asyncio, ssl, the retry layer: ~50 ms of imports) comes in where a URL is opened,
    not in every local build worker and parent (issue 36)."""
    if name == "FsspecLocation":
        from cachebuild.storage.locations.url import FsspecLocation

        return FsspecLocation
    if name == "is_transient":
        from cachebuild.storage.remote.retry import is_transient

        return is_transient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
