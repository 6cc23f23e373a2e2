"""``cachebuild serve DIR``: a folder of caches (a team store) served read-only over HTTP, for teams without
object storage, on aiohttp's web server (its ``FileResponse``: ``Range`` requests, strong ``ETag``,
``Last-Modified``, ``If-Match``, files sent by ``sendfile``: memory does not grow with the files).

What it does, and nothing else:

- answers ``GET`` and ``HEAD`` of the regular files and folders under ``DIR`` (a folder: an HTML page of links,
  which ``cachebuild ls`` and fsspec read); anything else is 405;
- only with the bearer token of ``--token-file`` (``Authorization: Bearer <token>``, compared in constant time);
  without it, or with another, 401;
- nothing outside ``DIR``: a path with an empty, ``.`` or ``..`` segment (also percent-encoded), a backslash
  or a NUL is refused, and so is every symbolic link under ``DIR`` (a file or a folder), wherever it points;
- at most ``--max-requests`` answers at once (the bytes of a file count: a slot is held until its last byte is
  sent); up to :data:`WAITING_PER_SLOT` times as many wait for a slot, more get ``503`` with ``Retry-After``
  (readers retry it);
- a range that cannot be read (malformed, several ranges, past the end) is 416, a stale ``If-Match`` 412;
- bound to 127.0.0.1 unless ``--host`` says otherwise; no access log (no header is ever logged).

In a store (``DIR/.store/store.json``), the caches it serves are leased for as long as they are read
(``.store/leases/<cache>/``): ``cachebuild gc`` on ``DIR`` then keeps them. A reader renews its lease with a
``HEAD`` now and then; a cache without a request for ``CACHEBUILD_LEASE_S`` loses it (its last use recorded).
The server writes those records only (and needs write permission on ``DIR/.store`` for them; without it, a
warning).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import functools
import hashlib
import hmac
import html
import logging
import os
import signal
import stat
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cachebuild.atomic import write_bytes_atomic
from cachebuild.errors import OptionError, require_extra
from cachebuild.format.manifest import MANIFEST_NAME
from cachebuild.settings import settings
from cachebuild.storage.remote.lease import STORE_MARK, LeaseRecord, lease_name, new_token, renew_every, used_name

__all__ = ["DEFAULT_MAX_REQUESTS", "CacheServer", "read_token", "serve"]

log = logging.getLogger("cachebuild")

DEFAULT_MAX_REQUESTS = 64
WAITING_PER_SLOT = 16  # requests that may wait for a slot, per slot; more are answered 503
CACHE_DEPTH = 4  # how far above a file its cache's folder is looked for (as `ls` looks down)
FOLDER_MEMO_S = 10.0  # how long a folder's "is it a cache" answer is kept

Handler = Callable[[Any], Awaitable[Any]]


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in the file ``path`` (surrounding whitespace dropped). Refused: an empty file, one with a space
    or a line break inside the token. A file others may read is served with a warning."""
    p = Path(path)
    try:
        token = p.read_text(encoding="utf-8").strip()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise OptionError(f"--token-file {p}: cannot read it ({e})") from None
    if not token or any(ch.isspace() for ch in token):
        raise OptionError(f"--token-file {p}: the token must be one word on one line (e.g. made with `openssl rand "
                          f"-hex 32 > {p}`)")
    if mode & 0o077:
        log.warning("%s can be read by other users of this host (mode %o): `chmod 600 %s`", p, mode & 0o777, p)
    return token


def _uses_of(root: Path) -> Callable[[Path], str | None]:
    """A function giving the cache (its folder, relative to ``root``, ``/``-separated) a file or folder under
    ``root`` belongs to, or None; folders' answers are kept for :data:`FOLDER_MEMO_S`."""
    memo: dict[Path, tuple[float, bool]] = {}

    def is_cache(folder: Path) -> bool:
        now = time.monotonic()
        got = memo.get(folder)
        if got is None or now - got[0] > FOLDER_MEMO_S:
            got = (now, (folder / MANIFEST_NAME).is_file())
            memo[folder] = got
        return got[1]

    def cache_of(path: Path) -> str | None:
        rel = path.relative_to(root).parts
        for depth in range(1, min(len(rel), CACHE_DEPTH) + 1):
            if rel[0].startswith("."):
                return None  # the store's own records, not a cache
            if is_cache(root.joinpath(*rel[:depth])):
                return "/".join(rel[:depth])
        return None

    return cache_of


class _Leases:
    """The leases this server holds on the caches it serves: each one's last request, written to the store now
    and then (:meth:`flush`); a cache not asked for within the lease's lifetime loses it, its last use kept."""

    def __init__(self, root: Path, ttl_s: float) -> None:
        self.root, self.ttl_s = root, ttl_s
        self.token = "serve-" + new_token()
        self.seen: dict[str, float] = {}  # cache -> time of its last request (epoch seconds)
        self.written: dict[str, float] = {}
        self._warned = False

    def note(self, cache: str) -> None:
        self.seen[cache] = time.time()

    def _write(self, name: str, record: LeaseRecord) -> None:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(target, record.to_bytes())

    def flush(self, final: bool = False) -> None:
        """Write the leases of caches asked for since the last flush; give up those not asked for within the
        lease's lifetime (all of them when ``final``), recording their last use. Only in a store (its mark):
        a plain folder of caches has no gc to tell, and gets no file it did not have."""
        if not (self.root / STORE_MARK).is_file():
            self.seen.clear()
            return
        now = time.time()
        for cache, t in list(self.seen.items()):
            at = _dt.datetime.fromtimestamp(t, _dt.timezone.utc)
            try:
                if final or now - t > self.ttl_s:
                    self._write(used_name(cache), LeaseRecord.now(0, "use", at))
                    (self.root / lease_name(cache, self.token)).unlink(missing_ok=True)
                    del self.seen[cache]
                    self.written.pop(cache, None)
                elif self.written.get(cache) != t:
                    self._write(lease_name(cache, self.token), LeaseRecord.now(self.ttl_s, "serve", at))
                    self.written[cache] = t
            except OSError as e:
                if not self._warned:
                    log.warning("cannot record the use of the caches served (%s): `cachebuild gc` on %s does not see "
                                "this server's readers", e, self.root)
                    self._warned = True


class CacheServer:
    """The server of the folder ``root`` (see the module docstring): :meth:`start` it on an asyncio loop,
    :meth:`stop` it there. ``in_flight`` and ``peak`` count the answers being sent."""

    def __init__(self, root: str | os.PathLike[str], token: str, *, max_requests: int = DEFAULT_MAX_REQUESTS,
                 lease_s: float | None = None) -> None:
        require_extra("aiohttp.web", "remote", "cachebuild serve")
        self.root = Path(root).resolve(strict=True)  # DIR itself may be a link; nothing under it may
        if not self.root.is_dir():
            raise OptionError(f"{root} is not a folder: serve a folder of caches")
        if max_requests < 1:
            raise OptionError(f"--max-requests must be at least 1, got {max_requests}")
        self._token = hashlib.sha256(token.encode()).digest()
        self.max_requests = max_requests
        self.max_waiting = max_requests * WAITING_PER_SLOT
        self.in_flight = self.peak = self._waiting = 0
        self._slots: asyncio.Semaphore | None = None
        self._cache_of = _uses_of(self.root)
        self.leases = _Leases(self.root, lease_s if lease_s is not None else settings().lease_s)
        self._runner: Any = None
        self._flusher: asyncio.Task[None] | None = None
        self.url = ""

    # ---------------------------------------------------------------- the app
    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(middlewares=[self._auth, self._bounded], client_max_size=1 << 16)
        app.router.add_get("/{tail:.*}", self._handle)  # HEAD too; any other method is 405
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL."""
        from aiohttp import web

        self._slots = asyncio.Semaphore(self.max_requests)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"
        self._flusher = asyncio.get_running_loop().create_task(self._flush_now_and_then())
        return self.url

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, self.leases.flush, True)

    async def _flush_now_and_then(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(renew_every(self.leases.ttl_s))
            await loop.run_in_executor(None, self.leases.flush)

    # ---------------------------------------------------------------- middlewares: the token, then a slot
    def _authorised(self, request: Any) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(given.strip().encode()).digest()
        return hmac.compare_digest(digest, self._token) and scheme.lower() == "bearer"

    @property
    def _auth(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def auth(request: Any, handler: Handler) -> Any:
            if not self._authorised(request):
                return web.Response(status=401, text="a bearer token is needed (Authorization: Bearer ...)\n",
                                    headers={"WWW-Authenticate": 'Bearer realm="cachebuild"'})
            return await handler(request)

        return auth

    @property
    def _bounded(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def bounded(request: Any, handler: Handler) -> Any:
            assert self._slots is not None
            if self._waiting >= self.max_waiting:
                return web.Response(status=503, text="busy: try again\n", headers={"Retry-After": "1"})
            self._waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self._waiting -= 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                response = await handler(request)
                with contextlib.suppress(ConnectionError):  # a reader gone (a hedged read's loser): aiohttp says so
                    if not response.prepared:
                        await response.prepare(request)  # sent inside the slot: a file's bytes count too
                    await response.write_eof()
                return response
            finally:
                self.in_flight -= 1
                self._slots.release()

        return bounded

    # ---------------------------------------------------------------- answers
    def target(self, tail: str) -> Path | None:
        """The file or folder under the root that the (decoded) URL path ``tail`` names, or None: a segment
        that is empty, ``.`` or ``..``, holds a backslash or a NUL; or a symbolic link, or nothing, on the way."""
        parts = tail.split("/")
        if parts and parts[-1] == "":
            parts = parts[:-1]  # a folder's URL ends with "/"
        path = self.root
        for part in parts:
            if part in ("", ".", "..") or "\\" in part or "\x00" in part:
                return None
            path = path / part
            try:
                mode = os.lstat(path).st_mode
            except (OSError, ValueError):
                return None
            if stat.S_ISLNK(mode):
                return None
        return path

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        path = self.target(request.path.lstrip("/"))
        try:
            mode = os.lstat(path).st_mode if path is not None else 0
        except OSError:
            mode = 0
        if stat.S_ISDIR(mode):
            assert path is not None
            page = self._index(path).encode()
            return web.Response(body=page if request.method == "GET" else None, content_type="text/html",
                                charset="utf-8")
        if not stat.S_ISREG(mode):
            return web.Response(status=404, text="not found\n")
        assert path is not None
        cache = self._cache_of(path)
        if cache is not None:
            self.leases.note(cache)
        # a file as it is: never a compressed sibling (FileResponse serves "x.gz" for "x" to gzip clients)
        plain = request.clone(headers={k: v for k, v in request.headers.items() if k.lower() != "accept-encoding"})
        response = _file_response()(path, chunk_size=1 << 18)
        response.content_type = "application/octet-stream"
        with contextlib.suppress(ConnectionError):  # the reader went away: nothing to answer, nothing to log
            await response.prepare(plain)
        return response

    def _index(self, folder: Path) -> str:
        rel = folder.relative_to(self.root).as_posix()
        base = "" if rel == "." else "/" + rel
        links = []
        with os.scandir(folder) as entries:
            for e in sorted(entries, key=lambda e: e.name):
                if e.is_dir(follow_symlinks=False):
                    name = e.name + "/"
                elif e.is_file(follow_symlinks=False):
                    name = e.name
                else:
                    continue  # links and special files are not served
                href = html.escape(urllib.parse.quote(f"{base}/{name}"), quote=True)
                links.append(f'<li><a href="{href}">{html.escape(name)}</a></li>')
        title = html.escape(base or "/")
        return (f"<!DOCTYPE html><html><head><title>Index of {title}</title></head><body><ul>\n" + "\n".join(links)
                + "\n</ul></body></html>\n")


@functools.cache
def _file_response() -> type:
    """aiohttp's ``FileResponse``, sent once: the server sends it itself (with the request as it chose to read it,
    inside its slot), and aiohttp's own later ``prepare`` of the returned response then does nothing (the base
    class's does nothing twice; ``FileResponse``'s would send the file again)."""
    from aiohttp import web

    class SentOnce(web.FileResponse):
        async def prepare(self, request: Any) -> Any:
            if self.prepared:
                return None
            return await super().prepare(request)

    return SentOnce


def serve(root: str | os.PathLike[str], token: str, *, host: str = "127.0.0.1", port: int = 0,
          max_requests: int = DEFAULT_MAX_REQUESTS, announce: Callable[[str], None] = print) -> None:
    """Serve ``root`` until SIGINT or SIGTERM; ``announce`` is given the line that says where (flushed)."""
    server = CacheServer(root, token, max_requests=max_requests)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        url = await server.start(host, port)
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving on %s: anyone who can reach this port and holds the token reads these caches, in "
                        "clear over the network (put a TLS proxy in front of it, or an SSH tunnel)", host)
        announce(f"serving {server.root} at {url}/ (read-only, bearer token; at most {max_requests} answers at "
                 f"once); Ctrl-C stops")
        sys.stdout.flush()
        try:
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(run())
