"""A cache (or a source's files) behind any fsspec URL (``s3://``, ``gs://``, ``http(s)://``...): range reads,
each request retried by the remote layer (:mod:`cachebuild.storage.remote.retry`), reads pinned to the versions
the cache had when opened (:mod:`cachebuild.storage.remote.pinning`), and one-line errors naming the URL without
its credentials (which come from each store's own environment and config files, or ``storage_options``). fsspec
is the ``remote`` extra: imported here, when a URL is opened.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from cachebuild.errors import (
    CacheChangedError,
    CacheCorruptError,
    MissingExtraError,
    NoSuchBucketError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    require_extra,
)
from cachebuild.settings import settings
from cachebuild.storage.locations import Location, check_name, is_url, is_web_url, redact
from cachebuild.storage.remote import retry
from cachebuild.storage.remote.lease import (
    STORE_MARK,
    Lease,
    LeaseRecord,
    lease_name,
    new_token,
    renew_every,
    used_name,
)
from cachebuild.storage.remote.pinning import (
    PINNABLE_PROTOCOLS,
    Pins,
    etag_of,
    install_s3_hook,
    precondition_failed,
    version_of,
)
from cachebuild.storage.remote.retry import Budget, Exhausted, RangeIgnored, ShortRead

__all__ = ["FsspecLocation", "new_s3_session"]

log = logging.getLogger("cachebuild")

CONDITIONAL_WRITE_PROTOCOLS = frozenset({"s3", "s3a"})  # writes conditional on a version: If-Match, If-None-Match: *

T = TypeVar("T")


class FsspecLocation(Location):
    """A folder behind any fsspec URL; its filesystem is made lazily in each process (the location pickles into
    DataLoader workers without an event loop or sockets). :meth:`pinned` ties its reads to its files' versions."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, pins: Pins | None = None) -> None:
        self.url = url.rstrip("/")
        self.protocol = url.split("://", 1)[0].lower()
        require_extra("fsspec", "remote", f"reading {self.protocol}:// URLs")
        self.storage_options = dict(storage_options or {})
        self.pins = pins
        self.lease: Lease | None = None  # a reader's lease on a store's cache (:meth:`pinned`), this process's
        self._fs: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        # the lease stays with the process that opened the cache (its DataLoader workers end before it does)
        return {**self.__dict__, "_fs": None, "_pid": -1, "lease": None}

    def fs_options(self) -> dict[str, Any]:
        """``storage_options`` plus our defaults for this URL's filesystem (:func:`fs_options`)."""
        return fs_options(self.protocol, self.storage_options)

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            with _MAKING:  # threads sharing a location (a source's readers) make one, not one each
                if self._fs is None or self._pid != os.getpid():
                    self._fs = make_fs(self.protocol, self.fs_options(), self.pins, self.describe())
                    self._pid = os.getpid()
                    weakref.finalize(self, _note_dropped)
        return self._fs

    @property
    def _async(self) -> bool:
        return bool(getattr(self.fs, "async_impl", False))

    def _path(self, name: str) -> str:
        return f"{self.url}/{check_name(name)}" if name else self.url

    # ---------------------------------------------------------------- retries and errors
    def _call(self, name: str, what: str, fn: Callable[[], T], budget: Budget | None = None) -> T:
        """One request, retried by the remote layer; the final failure becomes a named error."""
        try:
            return retry.call(fn, budget)
        except Exception as e:
            raise self._failed(name, what, e) from None

    def _group(self, names: Sequence[str], what: str, calls: Sequence[Callable[[], Awaitable[Any]]],
               hedge_bytes: Sequence[int] | None = None) -> list[Any]:
        """A group of requests on the filesystem's loop, each retried on its own under one budget; the first
        that failed for good (a permanent failure before an exhausted one) names its file in the error.
        ``hedge_bytes``: the calls are range reads of these sizes, hedged when late (reads only)."""
        results = retry.each(self.fs.loop, calls, hedge_bytes=hedge_bytes)
        err = retry.first_error(results)
        if err is not None:
            raise self._failed(names[results.index(err)], what, err) from None
        return results

    def _failed(self, name: str, what: str, exc: BaseException) -> Exception:
        last = exc.last if isinstance(exc, Exhausted) else exc
        if self.pins is not None and precondition_failed(last):
            return self._changed(name)
        return self._error(name, what, exc)

    def _changed(self, name: str) -> CacheChangedError:
        return _changed_error(self.describe(name), self.describe())

    def _error(self, name: str, what: str, exc: BaseException) -> Exception:
        return _named_error(self.describe(name), what, exc, self.url)

    def child(self, name: str) -> FsspecLocation:
        return FsspecLocation(self._path(name), self.storage_options, self.pins)

    @property
    def is_pinned(self) -> bool:
        return self.pins is not None

    # ---------------------------------------------------------------- pinning
    def pinned(self, anchor: str = "") -> FsspecLocation:
        """This location with every read tied by ``If-Match`` to the file versions it holds now; the
        anchor's tag (taken here) vouches for each other file's tag, taken on its first read. Returns the
        location unpinned where the protocol or the server cannot do it (no strong ETag on the anchor);
        raises :class:`RemoteNotFoundError` when there is no anchor.

        A cache of a team store is also leased (:mod:`cachebuild.storage.remote.lease`) for as long as the
        location returned lives in this process, the lease taken before the anchor is read: ``gc`` either sees
        it or has already taken the cache down, which this reader then finds."""
        if self.pins is not None or not anchor:
            return self
        lease = _reader_lease(self.url, self.storage_options, anchor)
        try:
            loc = self._pin(anchor)
        except BaseException:
            if lease is not None:
                lease.close()
            raise
        if lease is not None:
            if loc is self:  # not pinnable: a reader of its own all the same, holding the lease
                loc = FsspecLocation(self.url, self.storage_options, None)
            loc.lease = lease
            weakref.finalize(loc, lease.close)
        return loc

    def _pin(self, anchor: str) -> FsspecLocation:
        if self.protocol not in PINNABLE_PROTOCOLS or not settings().pin_versions:
            return self
        path = self._path(anchor)
        # The pinned location asks for the anchor's version with its own filesystem (the S3 hook installed
        # from the start), so an open makes one filesystem, not a second one thrown away at once.
        pins = Pins(path)
        loc = FsspecLocation(self.url, self.storage_options, pins)
        # No anchor raises RemoteNotFoundError: returning a location unpinned instead would let a reader
        # whose manifest appears a moment later (a push finishing) read unpinned for good.
        info = loc._call(anchor, "get its version", lambda: loc.fs.info(path, **loc._fresh()))
        tag = etag_of(info)
        if tag is None:
            loc.pins = None  # the hook (if any) stays, with nothing to add: reads go unconditional
            return loc
        pins.set_anchor(loc._key(path), tag, version_of(info))
        return loc

    def _fresh(self) -> dict[str, Any]:
        # s3fs answers info() from listings it cached; a version check must ask the store
        return {"refresh": True} if self.protocol in ("s3", "s3a") else {}

    def _key(self, path: str) -> str:
        return str(self.fs._strip_protocol(path))

    def _pinned_reads(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """Keyword arguments for an fsspec read of each of ``names`` that make it conditional on the file's
        pinned tag (HTTP: an ``If-Match`` header; S3: none, the session's hook adds ``IfMatch``).

        Files not pinned yet get their tags first, and then the anchor must still have its opening tag: if
        it does, those tags are of the cache this reader opened."""
        if self.pins is None:
            return [{} for _ in names]
        keys = [self._key(self._path(n)) for n in names]
        todo = set(self.pins.missing(keys))
        if todo:
            self._take_tags({k: n for k, n in zip(keys, names, strict=True) if k in todo})
        if self.protocol not in ("http", "https"):
            return [{} for _ in names]
        tags = [self.pins.tag(k) for k in keys]
        return [{"headers": {"If-Match": t}} if t is not None else {} for t in tags]

    def _take_tags(self, names: dict[str, str]) -> None:
        """Pin the files ``names`` (key -> name) to their tags now, vouched for by the anchor."""
        assert self.pins is not None
        fs, fresh = self.fs, self._fresh()
        listed = list(names.values())
        paths = [self._path(n) for n in listed]
        what = f"get the version of {len(listed)} file(s)"
        if self._async:
            infos = self._group(listed, what, [functools.partial(fs._info, p, **fresh) for p in paths])
        else:
            infos = [self._call(n, what, functools.partial(fs.info, p, **fresh))
                     for n, p in zip(listed, paths, strict=True)]
        anchor = self.pins.anchor_url
        try:
            now = etag_of(self._call("", "check its manifest", lambda: fs.info(anchor, **fresh)))
        except RemoteNotFoundError:  # taken down by a push in progress
            now = None
        if now != self.pins.anchor_tag:
            raise self._changed(listed[0])
        self.pins.add({k: etag_of(info) for k, info in zip(names, infos, strict=True)},
                      {k: version_of(info) for k, info in zip(names, infos, strict=True)})

    # ---------------------------------------------------------------- reads
    def exists(self, name: str) -> bool:
        path = self._path(name)

        def probe() -> bool:  # fsspec's HTTP exists() answers False for a 500: info() tells them apart
            try:
                self.fs.info(path)
            except FileNotFoundError as e:
                if retry.is_transient(e):
                    raise
                return False
            return True

        return self._call(name, "check it", probe)

    def size(self, name: str) -> int:
        path = self._path(name)
        info = self._call(name, "get its size", lambda: self.fs.info(path))
        if info.get("size") is None:
            raise RemoteError(f"{self.describe(name)}: the server does not report the size")
        return int(info["size"])

    def read_bytes(self, name: str) -> bytes:
        path = self._path(name)
        (kw,) = self._pinned_reads([name])
        return self._call(name, "read it", lambda: bytes(self.fs.cat_file(path, **kw)))

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.read_many([(name, ranges)])[0]

    def read_many(self, wanted: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> list[list[bytes]]:
        return self._ranges(wanted, "read byte ranges of it", exact=True)

    def read_heads(self, names: Sequence[str], nbytes: int) -> list[bytes]:
        got = self._ranges([(n, [(0, nbytes)]) for n in names], f"read the headers of {len(names)} file(s)")
        return [g[0] for g in got]

    def _ranges(self, wanted: Sequence[tuple[str, Sequence[tuple[int, int]]]], what: str,
                exact: bool = False) -> list[list[bytes]]:
        """Every range of every file, pinned, each request retried on its own (one group on an async filesystem,
        hedged when late). ``exact``: an answer of another length than asked is an error (a head may be short,
        and a server that ignores ranges still answers it)."""
        if not any(ranges for _, ranges in wanted):
            return [[] for _ in wanted]
        kws = self._pinned_reads([name for name, _ in wanted])
        fs = self.fs

        def check(start: int, end: int, data: bytes) -> bytes:
            if exact and len(data) > end - start:
                raise RangeIgnored(f"bytes [{start}, {end}) came back as {len(data)} bytes")
            if exact and len(data) != end - start:  # a whole answer (its Content-Length), short: the file is shorter
                raise ShortRead(f"bytes [{start}, {end}) came back as {len(data)} bytes")
            return bytes(data)

        def one_sync(path: str, kw: dict[str, Any], start: int, end: int) -> bytes:
            return check(start, end, fs.cat_file(path, start=start, end=end, **kw))

        async def one(path: str, kw: dict[str, Any], start: int, end: int) -> bytes:
            return check(start, end, await fs._cat_file(path, start=start, end=end, **kw))

        flat = [(name, self._path(name), kw, s, e) for (name, ranges), kw in zip(wanted, kws, strict=True)
                for s, e in ranges]
        if self._async:
            got = self._group([f[0] for f in flat], what, [functools.partial(one, *f[1:]) for f in flat],
                              hedge_bytes=[e - s for *_, s, e in flat])
        else:
            got = [self._call(f[0], what, functools.partial(one_sync, *f[1:])) for f in flat]
        out, i = [], 0
        for _, ranges in wanted:
            out.append(got[i : i + len(ranges)])
            i += len(ranges)
        return out

    # ---------------------------------------------------------------- listings
    def list_files(self) -> dict[str, int]:
        fs = self.fs
        if self.protocol in ("http", "https") and self._async:
            found = self._walk()
        else:  # one listing request (S3 and friends list a prefix flat, page by page)
            found = self._call("", "list it", lambda: fs.find(self.url, detail=True))
        base = fs._strip_protocol(self.url).rstrip("/")
        out: dict[str, int] = {}
        for full, info in found.items():
            rel = fs._strip_protocol(full)[len(base):].lstrip("/")
            if rel and info.get("type", "file") == "file":
                size = info.get("size")
                out[rel] = -1 if size is None else int(size)  # -1: a listing without sizes (HTTP index pages)
        return out

    def _walk(self) -> dict[str, Any]:
        """Every file below this URL from its index pages, one page per request, each retried on its own:
        a failed page never makes the pages already read be asked again."""
        fs = self.fs
        found: dict[str, Any] = {}
        seen = {self.url.rstrip("/")}
        todo = [self.url]
        while todo:
            pages = self._group([""] * len(todo), "list it", [functools.partial(fs._ls, p, detail=True) for p in todo])
            todo = []
            for page in pages:
                for info in page:
                    name = info["name"]
                    if info.get("type") == "directory":
                        if name.rstrip("/") not in seen and name.rstrip("/").startswith(self.url):
                            seen.add(name.rstrip("/"))
                            todo.append(name)
                    else:
                        found[name] = info
        return found

    def list_dir(self, name: str = "") -> list[tuple[str, bool, int]]:
        path = self._path(name)
        found = self._call(name, "list it", lambda: self.fs.ls(path, detail=True))
        base = self.fs._strip_protocol(path).rstrip("/")
        out = []
        for info in found:
            rel = self.fs._strip_protocol(info["name"])[len(base):].strip("/")
            if not rel or "/" in rel:
                continue  # the folder itself (some stores list it), or a deeper name
            size = info.get("size")
            out.append((rel, info.get("type") == "directory", -1 if size is None else int(size)))
        return sorted(set(out))

    # ---------------------------------------------------------------- writes (push)
    def _write_options(self) -> dict[str, Any]:
        # fsspec's HTTP filesystem POSTs by default; a writable HTTP store (WebDAV, our test server) takes PUT.
        return {"method": "put"} if self.protocol in ("http", "https") else {}

    def put_file(self, name: str, local: str | os.PathLike[str]) -> None:
        path = self._path(name)
        self._call(name, "upload it", lambda: self.fs.put_file(os.fspath(local), path, **self._write_options()))

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._call(name, "write it", lambda: self.fs.pipe_file(path, bytes(data)))

    @property
    def conditional_writes(self) -> bool:
        return self.protocol in CONDITIONAL_WRITE_PROTOCOLS

    def stat(self, name: str, fresh: bool = False) -> dict[str, Any]:
        path = self._path(name)
        kw = self._fresh() if fresh else {}
        return dict(self._call(name, "check it", lambda: self.fs.info(path, **kw)))

    def write_if(self, name: str, data: bytes, match: str | None) -> str | None:
        if not self.conditional_writes:
            raise TypeError(f"{self.describe()} offers no conditional writes")
        path = self._path(name)
        kw: dict[str, Any] = {"IfMatch": match} if match is not None else {"mode": "create"}  # s3fs: IfNoneMatch="*"
        lost = object()

        def put() -> Any:
            try:
                return self.fs.pipe_file(path, bytes(data), **kw)
            except Exception as e:
                if isinstance(e, FileExistsError) or precondition_failed(e):
                    return lost
                raise

        got = self._call(name, "write it", put)
        return None if got is lost else str((got or {}).get("ETag") or "")

    def forget_listing(self, name: str = "") -> None:
        invalidate = getattr(self.fs, "invalidate_cache", None)  # s3fs sizes whole reads from its listings
        if invalidate is not None:
            invalidate(self._path(name))

    def remove(self, *names: str) -> None:
        if not names:
            return
        paths = [self._path(n) for n in names]

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(paths if len(paths) > 1 else paths[0])  # s3fs/gcsfs: bulk deletes

        self._call(names[0] if len(names) == 1 else "", f"delete {len(names)} file(s)", rm)


# ---------------------------------------------------------------- one-line errors

def _changed_error(file: str, cache: str) -> CacheChangedError:
    """``file`` (as shown) no longer holds the version a pinned reader of the cache at ``cache`` opened."""
    return CacheChangedError(
        f"{file} changed since this job opened the cache at {cache} (replaced by `cachebuild push --force`, or "
        f"rewritten): this reader stops rather than serve bytes of another cache; restart the job to read what "
        f"is there now")


def _detail(exc: BaseException, url: str) -> str:
    detail = str(exc).replace(url, redact(url))
    return detail[:200] + "..." if len(detail) > 200 else detail


def _unavailable(where: str, what: str, exc: Exhausted, url: str) -> RemoteUnavailableError:
    last = f"HTTP {exc.status}" if exc.status is not None else type(exc.last).__name__
    why = (f"the time budget of {exc.budget_s:g} s (CACHEBUILD_RETRY_BUDGET) ran out" if exc.out_of_time
           else "CACHEBUILD_RETRIES tries")
    return RemoteUnavailableError(
        f"{where}: cannot {what} after {exc.attempts} attempts in {exc.elapsed:.1f} s ({why}); last answer: "
        f"{last}: {_detail(exc.last, url)}; the store is failing or overloaded: run the command again later",
        where, exc.status, exc.attempts)


def _missing_bucket(exc: BaseException) -> bool:
    """Whether the store answered that the bucket itself does not exist (S3's ``NoSuchBucket``; GCS and
    s3fs say it in words), not merely the file asked for."""
    e: BaseException | None = exc
    for _ in range(8):  # exc and what it wraps
        if e is None:
            return False
        response = getattr(e, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "NoSuchBucket":
            return True
        if "specified bucket does not exist" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _bucket_url(url: str) -> str:
    """``s3://bucket`` of ``s3://bucket/some/prefix`` (credentials left out)."""
    shown = redact(url)
    scheme, sep, rest = shown.partition("://")
    return f"{scheme}{sep}{rest.split('/', 1)[0]}" if sep else shown


def _named_error(where: str, what: str, exc: BaseException, url: str) -> Exception:
    """The error to raise for ``exc``, a request for the file shown as ``where`` (to ``what`` it) that failed
    for good; ``url`` (the location's) is shown without its credentials wherever the failure's text holds it."""
    if isinstance(exc, Exhausted):
        return _unavailable(where, what, exc, url)
    status = retry.classify(exc).status
    missing = getattr(exc, "filename", None) or (exc.args[0] if exc.args else None)
    if isinstance(exc, FileNotFoundError) and isinstance(missing, str) and is_url(missing):
        where = redact(missing)  # the file of a multi-file call that was not there
    if _missing_bucket(exc):
        bucket = _bucket_url(url)
        return NoSuchBucketError(f"{bucket}: the bucket does not exist ({where}: cannot {what}); check the URL's "
                                 f"spelling and the endpoint it goes to, or create the bucket first")
    if status == 404 or (isinstance(exc, FileNotFoundError) and status is None):
        return RemoteNotFoundError(f"{where}: not found (cannot {what})")
    if status == 401 and is_web_url(url):
        return RemoteError(f"{where}: the server asks for a token (HTTP 401): set CACHEBUILD_HTTP_TOKEN to the token "
                           f"it was started with (`cachebuild serve --token-file`), or check it")
    if status in (401, 403) or (isinstance(exc, PermissionError) and status is None):
        return RemoteError(f"{where}: access denied{f' (HTTP {status})' if status else ''}; check the "
                           f"credentials for this store (its standard environment variables or config files)")
    if isinstance(exc, RangeIgnored):
        return RemoteError(f"{where}: the server ignores HTTP Range requests ({exc}); serve the cache from one "
                           f"that answers them with 206 (nginx, Apache, object stores), or `cachebuild pull` it")
    if isinstance(exc, ShortRead):
        return CacheCorruptError(f"{where} is shorter than its manifest says (truncated upload?): {exc}")
    return RemoteError(f"{where}: cannot {what}: {type(exc).__name__}: {_detail(exc, url)}")


# ---------------------------------------------------------------- a reader's lease on a store's cache

def _reader_lease(url: str, storage_options: dict[str, Any], anchor: str) -> Lease | None:
    """The lease of a reader of the cache at ``url`` if it is a cache of a team store (its parent holds the
    store's mark): a record the reader writes into the store and renews. Over http(s), which a reader cannot
    write, a ``HEAD`` of ``anchor`` now and then instead: a ``cachebuild serve`` server records it. None for a
    cache outside a store."""
    every = renew_every(settings().lease_s)
    shown = redact(url)
    if is_web_url(url):
        cache = FsspecLocation(url, storage_options)  # of its own: the lease's thread holds no reader

        def head() -> None:
            cache.stat(anchor)

        return Lease(head, lambda: None, every, shown, now=False)
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or "://" not in parent or parent.endswith(":/"):
        return None  # at the root of a bucket: no folder to be a store
    records = FsspecLocation(parent, storage_options)
    try:
        records.read_heads([STORE_MARK], 16)  # one range read: s3fs's `exists` lists a missing object's prefix
    except RemoteNotFoundError:
        return None
    except Exception as e:  # the reader's own open says what is wrong with the store
        log.info("could not tell whether %s is a store (%s): reading it without a lease", redact(parent), e)
        return None
    token, ttl = new_token(), settings().lease_s

    def renew() -> None:
        records.write_bytes(lease_name(name, token), LeaseRecord.now(ttl).to_bytes())

    def release() -> None:
        records.write_bytes(used_name(name), LeaseRecord.now(0, "use").to_bytes())
        records.remove(lease_name(name, token))

    return Lease(renew, release, every, shown)


# ---------------------------------------------------------------- the filesystem, one per location and process

_MAKING = threading.Lock()


def _unlock_in_child() -> None:
    global _MAKING
    _MAKING = threading.Lock()  # a fork while another thread held it (DataLoader workers) must not inherit it


os.register_at_fork(after_in_child=_unlock_in_child)


# fsspec's filesystems are reference cycles (their mirrored sync methods hold them), each with a finalizer
# that closes its session through the loop it was made on. One dropped in this process but not collected yet
# is inherited by a forked child (a DataLoader worker), whose collector then runs that finalizer against the
# parent's loop, which no thread runs there: a 1 s wait (fsspec's sync, then its fallback) per filesystem, on
# whatever thread collects, the child's own I/O loop included (seconds of a cold epoch once a few datasets were
# dropped). So a fork after a location with a filesystem was dropped first collects here, where their loop runs
# and each session closes at once.
_dropped = [0]  # locations with a filesystem dropped since the last collection before a fork


def _note_dropped() -> None:
    """Called when a location that made a filesystem is dropped."""
    _dropped[0] += 1


def _collect_before_fork() -> None:
    if _dropped[0]:
        _dropped[0] = 0
        gc.collect()


os.register_at_fork(before=_collect_before_fork)


def fs_options(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` plus our defaults for fsspec filesystems of this protocol: a socket read timeout (a
    stalled server must not hang a worker), for S3 no retries of botocore's or s3fs's own (the remote layer's one
    policy retries each request), and for http(s) the bearer token of ``CACHEBUILD_HTTP_TOKEN`` in every
    request's headers, unless ``storage_options`` names an ``Authorization`` header itself."""
    opts = dict(storage_options)
    s = settings()
    timeout = s.http_timeout_s
    if protocol in ("http", "https"):
        import aiohttp

        # aiohttp's default is a 5-minute total timeout: a stalled server would hang a worker.
        client = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout),
                  **opts.get("client_kwargs", {})}
        given = {k.lower() for k in (*client.get("headers", {}), *opts.get("headers", {}))}
        if s.http_token is not None and "authorization" not in given:
            # in the session's headers: never in a URL, a message or a log line
            client["headers"] = {**client.get("headers", {}), "Authorization": f"Bearer {s.http_token}"}
        opts["client_kwargs"] = client
    elif protocol in ("s3", "s3a"):
        opts["config_kwargs"] = {"read_timeout": timeout, "connect_timeout": 10,
                                 "retries": {"total_max_attempts": 1}, **opts.get("config_kwargs", {})}
    return opts


def make_fs(protocol: str, opts: dict[str, Any], pins: Pins | None, described: str) -> Any:
    """A new filesystem (never fsspec's shared instance: each process and location owns its own); S3 reads
    carry ``If-Match`` for ``pins``. ``described`` names the URL in errors, without credentials."""
    import fsspec

    opts = dict(opts)
    if protocol in ("s3", "s3a"):
        opts.setdefault("session", new_s3_session())
        if pins is not None:
            install_s3_hook(opts["session"], pins)
    try:
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **opts)
    except ImportError as e:  # the protocol's own package (s3fs, aiohttp...)
        raise MissingExtraError(f"reading {protocol}:// URLs needs an optional package ({e}); install it with "
                                f"pip install 'cachebuild[remote]'") from None
    except ValueError as e:  # "Protocol not known"
        raise RemoteError(f"{described}: cannot open this URL ({e})") from None
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute): one try, ours retry it
    return fs


@functools.cache
def _botocore_loader() -> Any:
    """botocore's data loader (the parsed JSON of its endpoints and of S3's API), one per process: a new session
    would parse them again for each filesystem made (every location, every DataLoader worker): a CPU cost paid
    at every open. Taken from a first session, so ``AWS_DATA_PATH`` still applies."""
    import aiobotocore.session

    return aiobotocore.session.AioSession().get_component("data_loader")


def new_s3_session() -> Any:
    """A session of its own for one location (its event hooks are that location's pins), with the shared loader."""
    import aiobotocore.session

    session = aiobotocore.session.AioSession()
    session.register_component("data_loader", _botocore_loader())
    return session
