"""Where shard files live: local paths or any fsspec URL (http(s), s3, gs...), listed once at planning and
read by byte range in the workers.

A source names its shards in one of four ways: a brace pattern (``x-{0000..1023}.tar``, as webdataset
writes them), a glob (``data/train-*.parquet``), a folder or prefix (every shard file under it, recursively),
or one file. Shards are sorted by their name relative to the common root, so the order never depends on a
listing. Each :class:`Shard` records its size and a version (mtime for local files; ETag or Last-Modified
for URLs), which the plan's source digest covers.

Workers read ranges through :func:`read_range`: each thread keeps its shard handles open (a few, LRU), so a
block of samples costs one open per shard and, for URLs, a few large readahead requests, not one request or
one listing per sample. Retries are the storage layer's one policy (:mod:`cachebuild.storage.remote.retry`): a
URL read that fails in a transient way (a dropped connection, a 5xx) is retried on a fresh handle; one that
keeps failing stops the build with a :class:`SourceError`; finished blocks are kept. Listings and the size
of each shard are asked one request at a time, each retried on its own.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import glob
import logging
import os
import posixpath
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from cachebuild.errors import DecodeError, SourceError
from cachebuild.storage.locations.names import is_url, is_web_url, redact
from cachebuild.storage.remote import retry

__all__ = ["Shard", "close_handles", "filesystem", "is_url", "list_shards", "open_shard", "read_range", "retrying"]

log = logging.getLogger("cachebuild")
T = TypeVar("T")

READ_BLOCK = 8 << 20  # readahead of a worker's URL handle: a block's samples sit together in a shard
INDEX_BLOCK = 16 << 10  # readahead while indexing: headers and small members, not the images between
_OPEN_HANDLES = 8  # per thread


@dataclass(frozen=True)
class Shard:
    name: str  # relative to the source root, '/'-separated: what provenance strings start with
    url: str  # absolute local path or full URL
    size: int
    version: str  # local: mtime in ns; URL: ETag, else Last-Modified, else "" (then size alone)


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) of ``url``; fsspec caches the filesystem per process."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # unknown protocol or its package missing
        raise SourceError(f"{url}: cannot open this URL ({e}); URLs need fsspec and the protocol's package, "
                          f"e.g. pip install 'cachebuild[remote]'") from None


def _version(info: dict[str, Any]) -> str:
    for field in ("ETag", "etag", "LastModified", "Last-Modified", "mtime", "last_modified"):
        value = info.get(field)
        if value:
            return f"{field}={value}"
    return ""


def _brace_expand(pattern: str) -> list[str]:
    if "{" not in pattern:
        return [pattern]
    import braceexpand

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


def _infos(fs: Any, paths: list[str]) -> list[dict[str, Any]]:
    """``fs.info`` of many files at once (one HEAD each over HTTP or S3: 1024 in sequence would take minutes),
    each request retried on its own under one budget."""
    budget = retry.Budget()

    def info(p: str) -> dict[str, Any]:
        return retry.call(lambda: fs.info(p), budget)

    if len(paths) <= 1:
        return [info(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
        return list(pool.map(info, paths))


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


def _url_shards(src: str, suffixes: tuple[str, ...]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    fs, _ = filesystem(src)
    protocol = src.split("://", 1)[0]
    found: dict[str, dict[str, Any]] = {}
    expanded = _brace_expand(src)
    folder = False
    budget = retry.Budget()
    try:
        named = []
        for pattern in expanded:
            _, path = filesystem(pattern)
            if _has_glob(pattern):
                found.update(retry.call(functools.partial(fs.glob, path, detail=True), budget))
            elif len(expanded) == 1 and (pattern.endswith("/") or _is_folder(fs, path, budget)):
                folder = True  # a prefix ends in '/'; s3 and friends also say "directory"
                listed = retry.call(functools.partial(fs.find, path, detail=True), budget)
                found.update({p: i for p, i in listed.items() if p.lower().endswith(suffixes)})
            else:
                named.append(path)
        found.update(zip(named, _infos(fs, named), strict=True))
        found = {p: i for p, i in found.items() if i.get("type", "file") != "directory"}
        unsized = [p for p, i in found.items() if i.get("size") is None]  # HTTP index pages give no sizes
        found.update(zip(unsized, _infos(fs, unsized), strict=True))
    except Exception as e:  # aiohttp / botocore / OSError types: told apart by type and status
        raise _listing_error(src, protocol, e) from None
    files = sorted(found)
    urls = [p if is_url(p) else fs.unstrip_protocol(p) for p in files]
    bare = [u.split("://", 1)[1] for u in urls]
    root = _root(src.split("://", 1)[1], bare, folder, posixpath)
    return f"{protocol}://{root}", [(u, found[p]) for u, p in zip(urls, files, strict=True)]


def _is_folder(fs: Any, path: str, budget: retry.Budget) -> bool:
    return retry.call(lambda: fs.info(path), budget).get("type") == "directory"


def list_shards(src: str | os.PathLike[str], suffixes: tuple[str, ...], what: str) -> tuple[str, list[Shard]]:
    """(root, shards sorted by name) for a pattern, folder, prefix or file, local or URL. ``suffixes`` pick the
    shard files when ``src`` is a folder or prefix; ``what`` names them in errors ("WebDataset .tar shards")."""
    src = os.fspath(src)
    shards: list[Shard] = []
    if is_url(src):
        root, listed = _url_shards(src, suffixes)
        for url, info in listed:
            if info.get("size") is None:
                raise SourceError(f"{url}: the server does not tell its size (no Content-Length), so it cannot "
                                  f"be read by range")
            name = url[len(root):].lstrip("/")
            if is_web_url(src):  # index pages link names percent-encoded:
                name = urllib.parse.unquote(name)  # decoded, they sort (and read in provenance) as the local copy's
            shards.append(Shard(name, url, int(info["size"]), _version(info)))
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
    fs, path = filesystem(shard.url)
    with fs.open(path, "rb", block_size=block_size, cache_type="readahead", size=shard.size) as f:
        yield f


class _Handles(threading.local):
    def __init__(self) -> None:
        self.open: collections.OrderedDict[tuple[str, int, str], Any] = collections.OrderedDict()


_handles = _Handles()


def close_handles() -> None:
    """Close this thread's shard handles (they otherwise live as long as the worker)."""
    while _handles.open:
        _close(_handles.open.popitem()[1])


def _handle(shard: Shard) -> Any:
    """This thread's open handle of ``shard`` (an fd for local files, an fsspec file for URLs), kept per shard
    version, so a shard rewritten since is opened afresh."""
    key = (shard.url, shard.size, shard.version)
    h = _handles.open.get(key)
    if h is not None:
        _handles.open.move_to_end(key)
        return h
    if is_url(shard.url):
        fs, path = filesystem(shard.url)
        h = fs.open(path, "rb", block_size=READ_BLOCK, cache_type="readahead", size=shard.size)
    else:
        h = os.open(shard.url, os.O_RDONLY)
        size = os.fstat(h).st_size
        if size != shard.size:
            os.close(h)
            raise SourceError(f"{shard.url} changed since it was planned ({shard.size} -> {size} bytes); "
                              f"run the command again to plan it afresh")
    _handles.open[key] = h
    while len(_handles.open) > _OPEN_HANDLES:
        _close(_handles.open.popitem(last=False)[1])
    return h


def _close(h: Any) -> None:
    with contextlib.suppress(Exception):  # a handle whose connection is already gone
        if isinstance(h, int):
            os.close(h)
        else:
            h.close()


def _drop(shard: Shard) -> None:
    h = _handles.open.pop((shard.url, shard.size, shard.version), None)
    if h is not None:
        _close(h)


def retrying(shard: Shard, read: Callable[[], T], forget: Callable[[], None]) -> T:
    """``read()`` of a URL shard, tried again on a fresh handle (``forget`` drops the old one) after a network
    fault. A missing or forbidden file is not retried (the sample is listed as unreadable); a read that keeps
    failing raises SourceError, which stops the build: finished blocks are kept and a rerun resumes. Local
    shards are read once, as they are."""
    if not is_url(shard.url):
        return read()
    expected = (FileNotFoundError, PermissionError, SourceError, DecodeError)

    def dropped(e: BaseException) -> None:
        forget()  # whatever happened, the next attempt (or the next sample) opens a fresh handle

    try:
        return retry.call(read, on_failure=dropped)
    except expected:
        raise
    except retry.Exhausted as e:
        last = f"HTTP {e.status}" if e.status is not None else type(e.last).__name__
        raise SourceError(f"{redact(shard.url)}: reading failed {e.attempts} times in {e.elapsed:.1f} s (last "
                          f"answer: {last}: {e.last}); run the same command again to resume (finished blocks "
                          f"are kept)") from None
    except Exception as e:  # a permanent failure of another type: one line naming the shard
        status = retry.classify(e).status
        if status in (401, 403):  # not retried: asking again is refused again
            raise SourceError(f"{redact(shard.url)}: access denied (HTTP {status}); check the credentials for "
                              f"this store, then run the same command again to resume") from None
        raise SourceError(f"{redact(shard.url)}: reading failed ({type(e).__name__}: {e}); run the same "
                          f"command again to resume (finished blocks are kept)") from None


def read_range(shard: Shard, offset: int, size: int) -> bytes:
    """``size`` bytes of ``shard`` at ``offset``, through this thread's open handle of the shard."""
    if not is_url(shard.url):
        data = os.pread(_handle(shard), size, offset)
        if len(data) != size:
            raise SourceError(f"{shard.url} is shorter than when it was planned (byte {offset + len(data)} of "
                              f"{offset + size}); run the command again to plan it afresh")
        return data

    def read() -> bytes:
        f = _handle(shard)
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise retry.ShortRead(f"short read: {len(data)} of {size} bytes at {offset}")
        return data

    return retrying(shard, read, lambda: _drop(shard))
