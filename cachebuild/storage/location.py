"""Where a cache lives, apart from how its pixels are laid out: a local folder or any fsspec URL.

A :class:`Location` hands out the bytes of the files a manifest names, and nothing else: every name goes
through :func:`~cachebuild.storage.names.check_name` first. A local folder is read through plain files and
memory maps (zero copy); ``s3://``, ``gs://``, ``http(s)://`` and every other fsspec protocol go through
fsspec, with range reads, retries with backoff for transient failures (connection reset, 5xx, timeouts),
and one-line errors that name the URL without its credentials. Credentials come from each store's own
standard environment and config files (``AWS_*``, ``~/.aws``, ``GOOGLE_APPLICATION_CREDENTIALS``...), or
``storage_options``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from cachebuild.errors import CacheChangedError, CacheCorruptError, RemoteError, RemoteNotFoundError
from cachebuild.storage.names import check_name, is_url, redact
from cachebuild.storage.pinning import (
    PINNABLE_PROTOCOLS,
    Pins,
    etag_of,
    install_s3_hook,
    precondition_failed,
    version_of,
)

__all__ = ["FsspecLocation", "LocalLocation", "Location", "is_transient", "open_location"]

T = TypeVar("T")

RETRY_ATTEMPTS = int(os.environ.get("CACHEBUILD_RETRIES", "5"))
# "0" reads URLs unpinned: only for a server that sends strong ETags but answers If-Match wrongly (412 for
# a file that did not change); such a reader is not protected against a replaced cache.
PIN_VERSIONS = os.environ.get("CACHEBUILD_PIN_VERSIONS", "1") != "0"
HTTP_READ_TIMEOUT_S = float(os.environ.get("CACHEBUILD_HTTP_TIMEOUT", "60"))


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


class LocalLocation(Location):
    """A local (or NFS-mounted) folder.

    :meth:`pinned` ties the location to the folder it names now, by identity: if the folder is later
    renamed aside by a rebuild (``cachebuild.storage.replacement``), every file is still opened from it.
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
        from cachebuild.storage.replacement import folder_identity

        return LocalLocation(self.root, folder_identity(self.root))

    def folder(self) -> Path:
        """The folder to open files in: ``root``, or where a rebuild moved the pinned folder."""
        if self.identity is None:
            return self.root
        from cachebuild.storage.replacement import find_pinned, folder_identity

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
        from cachebuild.storage.replacement import folder_identity

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


# ---------------------------------------------------------------- fsspec

def is_transient(exc: BaseException) -> bool:
    """Worth another try: dropped connections, timeouts, 5xx/429. Not: 404, 403, bad requests."""
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - only without the http extra
        aiohttp = None  # type: ignore[assignment]
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status in (408, 429) or exc.status >= 500
        if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            return True
    from fsspec.exceptions import FSTimeoutError

    return isinstance(exc, (TimeoutError, ConnectionError, FSTimeoutError, _ShortRead))


class _ShortRead(OSError):
    """A range read that came back shorter than asked (a connection that closed early)."""


class _RangeIgnored(OSError):
    """A range read that came back longer than asked: the server sent the whole file (200, not 206). Not
    transient: asking again fetches the whole file again."""


def _status(exc: BaseException) -> int | None:
    return getattr(exc, "status", None) or getattr(exc, "code", None)


class FsspecLocation(Location):
    """A folder behind any fsspec URL. The filesystem object is made lazily in each process (so the
    location pickles into DataLoader workers, fork or spawn, without an event loop or sockets).

    :meth:`pinned` ties its reads to the versions of the files it holds now (``cachebuild.storage.pinning``).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, pins: Pins | None = None) -> None:
        self.url = url.rstrip("/")
        self.protocol = url.split("://", 1)[0].lower()
        self.storage_options = dict(storage_options or {})
        self.pins = pins
        self._fs: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}

    def fs_options(self) -> dict[str, Any]:
        """``storage_options`` plus our defaults (an HTTP read timeout) for fsspec filesystems of this URL."""
        opts = dict(self.storage_options)
        if self.protocol in ("http", "https"):
            import aiohttp

            # aiohttp's default is a 5-minute total timeout: a stalled server would hang a worker.
            opts["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=HTTP_READ_TIMEOUT_S), **opts.get("client_kwargs", {})}
        return opts

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            opts = self.fs_options()
            if self.pins is not None and self.protocol in ("s3", "s3a"):
                import aiobotocore.session

                opts.setdefault("session", aiobotocore.session.AioSession())
                install_s3_hook(opts["session"], self.pins)
            try:
                self._fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **opts)
            except ImportError as e:
                raise RemoteError(f"reading {self.protocol}:// URLs needs an extra package ({e}); "
                                  f"pip install 'cachebuild[remote]'") from None
            self._pid = os.getpid()
        return self._fs

    def _path(self, name: str) -> str:
        return f"{self.url}/{check_name(name)}" if name else self.url

    def _call(self, name: str, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries for transient failures; turn the final failure into a named error."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

        try:
            for attempt in Retrying(stop=stop_after_attempt(max(1, RETRY_ATTEMPTS)),
                                    wait=wait_exponential(multiplier=0.1, max=2.0),
                                    retry=retry_if_exception(is_transient), reraise=True):
                with attempt:
                    return fn()
        except Exception as e:
            if self.pins is not None and precondition_failed(e):
                raise self._changed(name) from None
            raise self._error(name, what, e) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _changed(self, name: str) -> CacheChangedError:
        return CacheChangedError(
            f"{self.describe(name)} changed since this job opened the cache at {self.describe()} (replaced by "
            f"`cachebuild push --force`, or rewritten): this reader stops rather than serve bytes of another "
            f"cache; restart the job to read what is there now")

    def _error(self, name: str, what: str, exc: BaseException) -> RemoteError:
        where = self.describe(name)
        status = _status(exc)
        missing = getattr(exc, "filename", None) or (exc.args[0] if exc.args else None)
        if isinstance(exc, FileNotFoundError) and isinstance(missing, str) and is_url(missing):
            where = redact(missing)  # the file of a multi-file call that was not there
        if isinstance(exc, FileNotFoundError) or status == 404:
            return RemoteNotFoundError(f"{where}: not found (cannot {what})")
        if isinstance(exc, PermissionError) or status in (401, 403):
            return RemoteError(f"{where}: access denied{f' (HTTP {status})' if status else ''}; check the "
                               f"credentials for this store (its standard environment variables or config files)")
        if isinstance(exc, _RangeIgnored):
            return RemoteError(f"{where}: the server ignores HTTP Range requests ({exc}); serve the cache from one "
                               f"that answers them with 206 (nginx, Apache, object stores), or `cachebuild pull` it")
        kind = type(exc).__name__
        detail = str(exc).replace(self.url, redact(self.url))
        if len(detail) > 200:
            detail = detail[:200] + "..."
        if is_transient(exc):
            return RemoteError(f"{where}: cannot {what} after {RETRY_ATTEMPTS} attempts: {kind}: {detail}")
        return RemoteError(f"{where}: cannot {what}: {kind}: {detail}")

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
        raises :class:`RemoteNotFoundError` when there is no anchor."""
        if self.pins is not None or not anchor or self.protocol not in PINNABLE_PROTOCOLS or not PIN_VERSIONS:
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
            first = next(n for k, n in zip(keys, names, strict=True) if k in todo)
            self._take_tags({k: self._path(n) for k, n in zip(keys, names, strict=True) if k in todo}, first)
        if self.protocol not in ("http", "https"):
            return [{} for _ in names]
        tags = [self.pins.tag(k) for k in keys]
        return [{"headers": {"If-Match": t}} if t is not None else {} for t in tags]

    def _take_tags(self, paths: dict[str, str], first: str) -> None:
        """Pin ``paths`` (key -> path) to their tags now, vouched for by the anchor; ``first`` names one of
        them in errors."""
        assert self.pins is not None
        fs = self.fs
        if getattr(fs, "async_impl", False):
            from fsspec.asyn import sync

            def heads() -> list[Any]:
                got = sync(fs.loop, _bounded, [lambda p=p: fs._info(p, **self._fresh()) for p in paths.values()])
                for info in got:
                    if isinstance(info, BaseException):
                        raise info
                return got

            infos = self._call(first if len(paths) == 1 else "", f"get the version of {len(paths)} file(s)", heads)
        else:
            def info_of(path: str) -> Callable[[], Any]:
                return lambda: fs.info(path, **self._fresh())

            infos = [self._call(first, "get its version", info_of(p)) for p in paths.values()]
        anchor = self.pins.anchor_url
        try:
            now = etag_of(self._call("", "check its manifest", lambda: fs.info(anchor, **self._fresh())))
        except RemoteNotFoundError:  # taken down by a push in progress
            now = None
        if now != self.pins.anchor_tag:
            raise self._changed(first)
        self.pins.add({k: etag_of(info) for k, info in zip(paths, infos, strict=True)},
                      {k: version_of(info) for k, info in zip(paths, infos, strict=True)})

    def exists(self, name: str) -> bool:
        path = self._path(name)
        return self._call(name, "check it", lambda: bool(self.fs.exists(path)))

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
        if not ranges:
            return []
        path = self._path(name)
        (kw,) = self._pinned_reads([name])

        def fetch() -> list[bytes]:
            got = self.fs.cat_ranges([path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges],
                                     on_error="return", **kw)
            out = []
            for (start, end), data in zip(ranges, got, strict=True):
                if isinstance(data, BaseException):
                    raise data
                if len(data) > end - start:
                    raise _RangeIgnored(f"bytes [{start}, {end}) came back as {len(data)} bytes")
                if len(data) != end - start:
                    raise _ShortRead(f"bytes [{start}, {end}) came back as {len(data)} bytes")
                out.append(bytes(data))
            return out

        try:
            return self._call(name, "read byte ranges of it", fetch)
        except RemoteError as e:
            if "_ShortRead" in str(e):
                raise CacheCorruptError(f"{self.describe(name)} is shorter than its manifest says (truncated "
                                        f"upload?): {str(e).split(': ', 2)[-1]}") from None
            raise

    def read_heads(self, names: Sequence[str], nbytes: int) -> list[bytes]:
        if not names:
            return []
        paths = [self._path(n) for n in names]
        matches = self._pinned_reads(names)

        def fetch() -> list[bytes]:
            if any(matches):  # a header per file: one conditional read each, concurrently
                from fsspec.asyn import sync

                fs = self.fs
                got = sync(fs.loop, _bounded, [lambda p=p, kw=kw: fs._cat_file(p, start=0, end=nbytes, **kw)
                                               for p, kw in zip(paths, matches, strict=True)])
            else:
                got = self.fs.cat_ranges(paths, [0] * len(paths), [nbytes] * len(paths), on_error="return")
            for data in got:
                if isinstance(data, BaseException):
                    raise data
            return [bytes(d) for d in got]

        return self._call(names[0] if len(names) == 1 else "", f"read the headers of {len(names)} file(s)", fetch)

    def list_files(self) -> dict[str, int]:
        def find() -> dict[str, Any]:
            return self.fs.find(self.url, detail=True)

        found = self._call("", "list it", find)
        base = self.fs._strip_protocol(self.url).rstrip("/")
        out: dict[str, int] = {}
        for full, info in found.items():
            rel = self.fs._strip_protocol(full)[len(base):].lstrip("/")
            if rel and info.get("type", "file") == "file":
                size = info.get("size")
                out[rel] = -1 if size is None else int(size)  # -1: a listing without sizes (HTTP index pages)
        return out


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

    def _write_options(self) -> dict[str, Any]:
        # fsspec's HTTP filesystem POSTs by default; a writable HTTP store (WebDAV, our test server) takes PUT.
        return {"method": "put"} if self.protocol in ("http", "https") else {}

    def put_file(self, name: str, local: str | os.PathLike[str]) -> None:
        path = self._path(name)
        self._call(name, "upload it", lambda: self.fs.put_file(os.fspath(local), path, **self._write_options()))

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._call(name, "write it", lambda: self.fs.pipe_file(path, bytes(data)))

    def remove(self, *names: str) -> None:
        if not names:
            return
        paths = [self._path(n) for n in names]

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(paths if len(paths) > 1 else paths[0])  # s3fs/gcsfs: bulk deletes

        self._call(names[0] if len(names) == 1 else "", f"delete {len(names)} file(s)", rm)


async def _bounded(calls: Sequence[Callable[[], Awaitable[Any]]], limit: int = 32) -> list[Any]:
    """Await every call, at most ``limit`` at a time; exceptions are returned in place."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)


def open_location(where: str | os.PathLike[str] | Location,
                  storage_options: dict[str, Any] | None = None) -> Location:
    """A local path (or ``file://`` URL: memory maps, zero copy) or any other fsspec URL."""
    if isinstance(where, Location):
        return where
    s = os.fspath(where)
    if s.startswith("file://"):
        return LocalLocation(s[len("file://"):])
    if is_url(s):
        return FsspecLocation(s, storage_options)
    return LocalLocation(s)
