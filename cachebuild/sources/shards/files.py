"""Where shard files live: local paths or any fsspec URL (http(s), s3, gs...), listed once at planning and
read by byte range in the workers.

A source names its shards in one of four ways: a brace pattern (``x-{0000..1023}.tar``, as webdataset
writes them), a glob (``data/train-*.parquet``), a folder or prefix (every shard file under it, recursively),
or one file. Shards are sorted by their name relative to the common root, so the order never depends on a
listing. Each :class:`Shard` records its size and a version (mtime for local files; ETag or Last-Modified
for URLs), which the plan's source digest covers.

Workers read ranges through :func:`read_range`: each thread keeps its shard handles open (a few, LRU), so a
block of samples costs one open per shard and, for URLs, a few large readahead requests, not one request or
one listing per sample. URLs are listed, opened and read through the storage layer
(:mod:`cachebuild.storage.locations.url_files`: its socket timeout, its retries, its S3 session): a read that
fails in a transient way (a dropped connection, a 5xx, a stalled answer) is retried on a fresh handle; one that
keeps failing stops the build with a :class:`SourceError`; finished blocks are kept. This module words those
failures for a source.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import posixpath
import threading
import urllib.parse
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from cachebuild.errors import DecodeError, SourceError
from cachebuild.storage.locations import is_url, is_web_url, redact
from cachebuild.storage.locations.url_files import FileInfo, UrlFiles, close_url_handles, read_url_range, url_files
from cachebuild.storage.remote import retry

__all__ = ["Shard", "close_handles", "forget_handle", "is_url", "list_shards", "open_shard", "read_range", "retrying",
           "thread_handle"]

T = TypeVar("T")

READ_BLOCK = 8 << 20  # readahead of a worker's URL handle: a block's samples sit together in a shard
INDEX_BLOCK = 16 << 10  # readahead while indexing: headers and small members, not the images between
_OPEN_HANDLES = 8  # per thread: shard descriptors and Parquet files together


@dataclass(frozen=True)
class Shard:
    name: str  # relative to the source root, '/'-separated: what provenance strings start with
    url: str  # absolute local path or full URL
    size: int
    version: str  # local: mtime in ns; URL: ETag, else Last-Modified, else "" (then size alone)


def _brace_expand(pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern]
    try:
        import braceexpand
    except ImportError:
        raise SourceError(f"{redact(pattern)}: a brace pattern needs braceexpand: pip install 'cachebuild[wds]' "
                          f"(or name the shards by a folder, a prefix or a glob)") from None
    return list(braceexpand.braceexpand(pattern))


def _has_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _root(src: str, files: list[str], folder: bool, join: Any) -> str:
    """The folder that shard names are relative to: ``src`` itself when it names a folder, else the deepest
    folder holding every file."""
    if folder or not files:
        return src.rstrip("/") or src
    return join.commonpath([join.dirname(f) for f in files])


def _local_shards(src: str, suffixes: tuple[str, ...]) -> tuple[str, list[str]]:
    paths: list[str] = []
    expanded = _brace_expand(src)
    folder = len(expanded) == 1 and not _has_glob(src) and os.path.isdir(src)
    for pattern in expanded:
        if _has_glob(pattern):
            paths += [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        elif folder:
            for dirpath, _, files in os.walk(pattern, followlinks=True):
                paths += [os.path.join(dirpath, f) for f in files if f.lower().endswith(suffixes)]
        elif os.path.isfile(pattern):
            paths.append(pattern)
        else:
            raise SourceError(f"{pattern} does not exist" + (f" (from {src})" if pattern != src else ""))
    paths = sorted({os.path.abspath(p) for p in paths})
    return _root(os.path.abspath(src), paths, folder, os.path), paths


def _listing_error(src: str, protocol: str, e: BaseException) -> SourceError:
    """A listing that failed for good, named by what the failure was (its type and status)."""
    if isinstance(e, retry.Exhausted):
        last = f"HTTP {e.status}" if e.status is not None else type(e.last).__name__
        return SourceError(f"{redact(src)} cannot be listed: still failing after {e.attempts} attempts in "
                           f"{e.elapsed:.1f} s (last answer: {last}); run the command again later")
    status = retry.classify(e).status
    if isinstance(e, FileNotFoundError) or status == 404:  # fsspec's HTTP info() says so for a 403 as well
        missing = getattr(e, "filename", None) or next((a for a in e.args if isinstance(a, str)), src)
        return SourceError(f"{missing} does not exist (or cannot be listed)")
    if isinstance(e, PermissionError) or status in (401, 403):
        return SourceError(f"{src}: access denied ({e}); check the credentials for {protocol}://")
    first = str(e).splitlines()[0] if str(e) else ""
    return SourceError(f"{src} cannot be listed ({type(e).__name__}: {first})")


def _url_shards(src: str, suffixes: tuple[str, ...]) -> tuple[str, list[FileInfo]]:
    files = UrlFiles(src)  # a filesystem of its own: listed afresh, whatever this process listed before
    protocol = src.split("://", 1)[0]
    found: dict[str, FileInfo] = {}
    expanded = _brace_expand(src)
    folder = False
    budget = retry.Budget()
    try:
        named = []
        for pattern in expanded:
            if _has_glob(pattern):
                found.update((f.path, f) for f in files.glob(pattern, budget))
            elif len(expanded) == 1 and (pattern.endswith("/") or files.is_folder(pattern, budget)):
                folder = True  # a prefix ends in '/'; s3 and friends also say "directory"
                found.update((f.path, f) for f in files.find(pattern, budget) if f.path.lower().endswith(suffixes))
            else:
                named.append(pattern)
        found.update((f.path, f) for f in files.infos(named))
        found = {p: f for p, f in found.items() if not f.is_dir}
        unsized = [f.url for f in found.values() if f.size is None]  # HTTP index pages give no sizes
        found.update((f.path, f) for f in files.infos(unsized))
    except Exception as e:  # aiohttp / botocore / OSError types: told apart by type and status
        raise _listing_error(src, protocol, e) from None
    listed = [found[p] for p in sorted(found)]
    root = _root(src.split("://", 1)[1], [f.url.split("://", 1)[1] for f in listed], folder, posixpath)
    return f"{protocol}://{root}", listed


def list_shards(src: str | os.PathLike[str], suffixes: tuple[str, ...], what: str) -> tuple[str, list[Shard]]:
    """(root, shards sorted by name) for a pattern, folder, prefix or file, local or URL. ``suffixes`` pick the
    shard files when ``src`` is a folder or prefix; ``what`` names them in errors ("WebDataset .tar shards")."""
    src = os.fspath(src)
    shards: list[Shard] = []
    if is_url(src):
        root, listed = _url_shards(src, suffixes)
        for f in listed:
            if f.size is None:
                raise SourceError(f"{f.url}: the server does not tell its size (no Content-Length), so it cannot "
                                  f"be read by range")
            name = f.url[len(root):].lstrip("/")
            if is_web_url(src):  # index pages link names percent-encoded:
                name = urllib.parse.unquote(name)  # decoded, they sort (and read in provenance) as the local copy's
            shards.append(Shard(name, f.url, int(f.size), f.version))
    else:
        root, paths = _local_shards(src, suffixes)
        for p in paths:
            st = os.stat(p)
            shards.append(Shard(Path(os.path.relpath(p, root)).as_posix(), p, st.st_size, str(st.st_mtime_ns)))
    shards.sort(key=lambda s: s.name)
    if not shards:
        raise SourceError(f"{src} holds no {what} (looked for names ending in {', '.join(suffixes)})")
    return root, shards


# ---------------------------------------------------------------- reading

@contextmanager
def open_shard(shard: Shard, block_size: int = INDEX_BLOCK) -> Iterator[BinaryIO]:
    """A seekable binary file of the shard (one pass: planning). URLs read ahead ``block_size`` bytes."""
    if not is_url(shard.url):
        with open(shard.url, "rb") as f:
            yield f
        return
    with url_files(shard.url).open(shard.url, shard.size, block_size) as f:
        yield f


class _Handles(threading.local):
    def __init__(self) -> None:
        self.open: collections.OrderedDict[Hashable, tuple[Any, Callable[[Any], None]]] = collections.OrderedDict()


_handles = _Handles()


def thread_handle(key: Hashable, opener: Callable[[], T], close: Callable[[T], None]) -> T:
    """This thread's open handle of ``key`` (a shard's descriptor, a Parquet file), opened by ``opener`` on first
    use and kept: a block of samples costs one open per file, not one per sample. Past a few, the least recently
    used is closed."""
    got = _handles.open.get(key)
    if got is not None:
        _handles.open.move_to_end(key)
        return got[0]
    handle = opener()
    _handles.open[key] = (handle, close)
    while len(_handles.open) > _OPEN_HANDLES:
        forget_handle(next(iter(_handles.open)))
    return handle


def forget_handle(key: Hashable) -> None:
    """Close this thread's handle of ``key``, if it has one (a fresh one is opened on the next use)."""
    handle, close = _handles.open.pop(key, (None, None))
    if close is not None:
        with contextlib.suppress(Exception):  # a connection may be gone already
            close(handle)


def close_handles() -> None:
    """Close this thread's handles, local and URL (they otherwise live as long as the worker)."""
    while _handles.open:
        forget_handle(next(iter(_handles.open)))
    close_url_handles()


def _open_local(shard: Shard) -> int:
    """A descriptor of the local ``shard``, refused when the file's size is not the planned one."""
    fd = os.open(shard.url, os.O_RDONLY | os.O_CLOEXEC)
    size = os.fstat(fd).st_size
    if size != shard.size:
        os.close(fd)
        raise SourceError(f"{shard.url} changed since it was planned ({shard.size} -> {size} bytes); "
                          f"run the command again to plan it afresh")
    return fd


_EXPECTED = (FileNotFoundError, PermissionError, SourceError, DecodeError)


def _read_failed(shard: Shard, e: Exception) -> Exception:
    """A URL read that failed for good (as the remote layer raises it), as one line naming the shard; a missing
    or forbidden file (its sample is listed as unreadable) and the source's own errors as they are."""
    if isinstance(e, _EXPECTED):
        return e
    if isinstance(e, retry.Exhausted):
        last = f"HTTP {e.status}" if e.status is not None else type(e.last).__name__
        return SourceError(f"{redact(shard.url)}: reading failed {e.attempts} times in {e.elapsed:.1f} s (last "
                           f"answer: {last}: {e.last}); run the same command again to resume (finished blocks "
                           f"are kept)")
    status = retry.classify(e).status
    if status in (401, 403):  # not retried: asking again is refused again
        return SourceError(f"{redact(shard.url)}: access denied (HTTP {status}); check the credentials for "
                           f"this store, then run the same command again to resume")
    return SourceError(f"{redact(shard.url)}: reading failed ({type(e).__name__}: {e}); run the same "
                       f"command again to resume (finished blocks are kept)")


def retrying(shard: Shard, read: Callable[[], T], forget: Callable[[], None]) -> T:
    """``read()`` of a URL shard, tried again on a fresh handle (``forget`` drops the old one) after a network
    fault. A missing or forbidden file is not retried (the sample is listed as unreadable); a read that keeps
    failing raises SourceError, which stops the build: finished blocks are kept and a rerun resumes. Local
    shards are read once, as they are."""
    if not is_url(shard.url):
        return read()

    def dropped(e: BaseException) -> None:
        forget()  # whatever happened, the next attempt (or the next sample) opens a fresh handle

    try:
        return retry.call(read, on_failure=dropped)
    except Exception as e:
        err = _read_failed(shard, e)
        if err is e:
            raise
        raise err from None


def read_range(shard: Shard, offset: int, size: int) -> bytes:
    """``size`` bytes of ``shard`` at ``offset``, through this thread's open handle of the shard (for a URL, the
    storage layer's: reading ahead :data:`READ_BLOCK`, retried on a fresh handle)."""
    if not is_url(shard.url):  # kept per shard version: a shard rewritten since is opened afresh
        fd = thread_handle((shard.url, shard.size, shard.version), lambda: _open_local(shard), os.close)
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise SourceError(f"{shard.url} is shorter than when it was planned (byte {offset + len(data)} of "
                              f"{offset + size}); run the command again to plan it afresh")
        return data
    try:
        return read_url_range(shard.url, shard.size, shard.version, offset, size, READ_BLOCK)
    except Exception as e:
        err = _read_failed(shard, e)
        if err is e:
            raise
        raise err from None
