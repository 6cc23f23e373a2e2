"""Files at URLs as a source reads them: listed (glob, a prefix's files, named files) with sizes and versions,
opened with readahead, and read by range through handles kept open per thread. Every request goes through an
:class:`~cachebuild.storage.locations.url.FsspecLocation`'s filesystem and the one remote layer's retries; a
failure is raised as :func:`~cachebuild.storage.remote.retry.call` raises it, for the source to word.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

from cachebuild.settings import settings
from cachebuild.storage.locations import is_url
from cachebuild.storage.locations.url import FsspecLocation
from cachebuild.storage.remote import retry

__all__ = ["FileInfo", "UrlFiles", "close_url_handles", "read_url_range", "url_files", "version_tag"]

_OPEN_HANDLES = 8  # per thread


@dataclass(frozen=True)
class FileInfo:
    """One listed file (or folder): its path as the filesystem names it (``bucket/key`` for s3 and friends, the
    whole URL for http), its URL, its size (None: the listing did not say) and its version."""

    path: str
    url: str
    size: int | None
    version: str  # "ETag=...", else "LastModified=..." (or another date field), else "" (then size alone)
    is_dir: bool = False


def version_tag(info: dict[str, Any]) -> str:
    """A file's version from its fsspec info: ETag, else a modification date, else "". The field's name is kept
    in the tag: source digests hold it, and caches built so far stay up to date only if it never changes."""
    for name in ("ETag", "etag", "LastModified", "Last-Modified", "mtime", "last_modified"):
        value = info.get(name)
        if value:
            return f"{name}={value}"
    return ""


class UrlFiles:
    """The files of one protocol (``s3``, ``https``...) as a source reads them. Pickles without its filesystem
    (made again in each process, as its location's)."""

    def __init__(self, url: str) -> None:
        self.location = FsspecLocation(url)
        self.protocol = self.location.protocol

    @property
    def fs(self) -> Any:
        return self.location.fs

    def path_of(self, url: str) -> str:
        """``url`` as the filesystem names it (no protocol for s3 and friends)."""
        return str(self.fs._strip_protocol(url))

    def _file(self, path: str, info: dict[str, Any]) -> FileInfo:
        url = path if is_url(path) else str(self.fs.unstrip_protocol(path))
        return FileInfo(path, url, info.get("size"), version_tag(info), info.get("type", "file") == "directory")

    def infos(self, urls: list[str], budget: retry.Budget | None = None) -> list[FileInfo]:
        """Each file's info (one HEAD each over HTTP or S3, sent together: 1,024 in sequence would take minutes),
        each request retried on its own under one budget."""
        fs, paths = self.fs, [self.path_of(u) for u in urls]
        budget = budget or retry.Budget()
        if len(paths) > 1 and getattr(fs, "async_impl", False):
            got = retry.each(fs.loop, [functools.partial(fs._info, p) for p in paths], budget)
            err = retry.first_error(got)
            if err is not None:
                raise err
        else:
            got = [retry.call(functools.partial(fs.info, p), budget) for p in paths]
        return [self._file(p, i) for p, i in zip(paths, got, strict=True)]

    def glob(self, pattern: str, budget: retry.Budget | None = None) -> list[FileInfo]:
        """The files and folders that match the glob ``pattern`` (a URL), as listed (sizes may be None)."""
        found = retry.call(functools.partial(self.fs.glob, self.path_of(pattern), detail=True), budget)
        return [self._file(p, i) for p, i in found.items()]

    def find(self, url: str, budget: retry.Budget | None = None) -> list[FileInfo]:
        """Every file below the folder or prefix ``url``, recursively, as listed (an HTTP index page gives no
        sizes: ask :meth:`infos`)."""
        found = retry.call(functools.partial(self.fs.find, self.path_of(url), detail=True), budget)
        return [self._file(p, i) for p, i in found.items()]

    def is_folder(self, url: str, budget: retry.Budget | None = None) -> bool:
        """Whether ``url`` is a folder or a prefix (s3 and friends say "directory")."""
        return bool(retry.call(functools.partial(self.fs.info, self.path_of(url)), budget).get("type") == "directory")

    def open(self, url: str, size: int, block_size: int) -> BinaryIO:
        """A seekable binary file of ``url`` (of ``size`` bytes: no request to ask it) that reads ahead
        ``block_size`` bytes per request (and a context manager). A read is one request, not retried: retry
        what reads it with :func:`~cachebuild.storage.remote.retry.call`, on a fresh file."""
        f: BinaryIO = self.fs.open(self.path_of(url), "rb", block_size=block_size, cache_type="readahead", size=size)
        return f


_lock = threading.Lock()
_shared: dict[tuple[str, float], UrlFiles] = {}


def _unlock_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a fork while another thread held it must not inherit it held


os.register_at_fork(after_in_child=_unlock_in_child)


def url_files(url: str) -> UrlFiles:
    """The :class:`UrlFiles` of ``url``'s protocol in this process, one per protocol and socket timeout (read
    now: a changed ``CACHEBUILD_HTTP_TIMEOUT`` gets a filesystem of its own), shared by its threads."""
    key = (url.split("://", 1)[0].lower(), settings().http_timeout_s)
    with _lock:
        files = _shared.get(key)
        if files is None:
            files = _shared[key] = UrlFiles(url)
        return files


# ---------------------------------------------------------------- range reads through per-thread handles

class _Handles(threading.local):
    def __init__(self) -> None:
        self.open: collections.OrderedDict[tuple[str, int, str], tuple[UrlFiles, Any]] = collections.OrderedDict()


_handles = _Handles()


def _close(h: Any) -> None:
    with contextlib.suppress(Exception):  # a handle whose connection is already gone
        h.close()


def close_url_handles() -> None:
    """Close this thread's URL handles (they otherwise live as long as the thread)."""
    while _handles.open:
        _close(_handles.open.popitem()[1][1])


def _handle(files: UrlFiles, key: tuple[str, int, str], block_size: int) -> Any:
    kept = _handles.open.get(key)
    if kept is not None and kept[0] is files:
        _handles.open.move_to_end(key)
        return kept[1]
    if kept is not None:  # opened under other settings (another timeout)
        _close(_handles.open.pop(key)[1])
    h = files.open(key[0], key[1], block_size)
    _handles.open[key] = (files, h)
    while len(_handles.open) > _OPEN_HANDLES:
        _close(_handles.open.popitem(last=False)[1][1])
    return h


def _drop(key: tuple[str, int, str]) -> None:
    kept = _handles.open.pop(key, None)
    if kept is not None:
        _close(kept[1])


def read_url_range(url: str, size: int, version: str, offset: int, nbytes: int, block_size: int) -> bytes:
    """``nbytes`` of the file ``url`` (``size`` bytes, of version ``version``) at ``offset``, through this thread's
    handle of that version of the file (opened on first use, reading ahead ``block_size`` bytes per request: the
    samples of a block sit together). A transient failure is retried on a fresh handle."""
    files = url_files(url)
    key = (url, size, version)

    def read() -> bytes:
        f = _handle(files, key, block_size)
        f.seek(offset)
        data = f.read(nbytes)
        if len(data) != nbytes:
            raise retry.ShortRead(f"short read: {len(data)} of {nbytes} bytes at {offset}")
        return bytes(data)

    return retry.call(read, on_failure=lambda e: _drop(key))
