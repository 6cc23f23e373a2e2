"""Real loopback servers for URL tests: an HTTP file server (aiohttp) and moto's S3 server, both on 127.0.0.1.

Fixtures (registered for every module through ``tests/conftest.py``):

- ``http_server(root, writable=False, etags=True) -> HttpServer``: serves the folder ``root`` at ``.url``
  until the test ends. GET/HEAD with one ``Range`` (206 + ``Content-Range``, 416 past the end),
  ``Content-Length``, ``ETag`` (not with ``etags=False``) and ``Last-Modified``, ``If-Match`` (412 when the
  file's ETag is another); a folder URL answers an HTML page of links that fsspec's ``HTTPFileSystem.ls`` reads.
  Every request is logged in ``.log`` (method, path, Range, status, body bytes sent);
  ``.fail(path, kind, times)`` injects faults: ``"drop"`` (headers and half the body, then the connection is
  cut), ``"stall"`` (no answer until ``.clear()``, then a 503), or a status code such as 403, 500, 503.
  With ``writable=True`` a PUT stores the body under ``root``.
- ``s3_server`` (session): moto's ``ThreadedMotoServer`` on 127.0.0.1, every request logged in ``.log``.
- ``s3``: a fresh bucket on it, an ``s3fs.S3FileSystem`` for it, and the AWS environment that makes a plain
  ``fsspec.open`` of an ``s3`` URL (also in a subprocess) reach that server with dummy credentials. The variables
  are set with ``monkeypatch``, so they vanish when the test ends; instance metadata lookups are disabled
  and the user's ~/.aws files are hidden, so no test reaches any address but 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import email.utils
import html
import os
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["HttpServer", "LoggedRequest", "S3Bucket", "S3Server", "aws_session_env", "http_server", "s3",
           "s3_server"]

HOST = "127.0.0.1"


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str  # URL path, decoded, without the query
    range: str | None  # the Range header as sent
    status: int
    bytes_sent: int  # body bytes written (a dropped response counts what went out before the cut)


class _RequestLog(list):
    """A list of :class:`LoggedRequest` with the counts tests ask for."""

    def matching(self, method: str | None = None, path: str | None = None) -> list[LoggedRequest]:
        return [r for r in self if (method is None or r.method == method) and (path is None or r.path == path)]

    def bytes(self, path: str | None = None) -> int:
        return sum(r.bytes_sent for r in self if path is None or r.path == path)

    def paths(self, method: str = "GET") -> list[str]:
        return [r.path for r in self if r.method == method]


# ---------------------------------------------------------------- HTTP

class _Loop:
    """One asyncio loop in a daemon thread for every HTTP server of the session."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-http-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class _Fault:
    kind: str | int
    times: int | None  # None: every request
    methods: tuple[str, ...]
    retry_after: float | None = None  # a status answer's Retry-After header (seconds)


@dataclass
class HttpServer:
    """A folder served over HTTP on 127.0.0.1; see the module docstring."""

    root: Path
    writable: bool = False
    etags: bool = True  # False: a server without ETags (If-Match then never holds, as RFC 9110 says)
    url: str = ""
    log: _RequestLog = field(default_factory=_RequestLog)
    _faults: dict[str, _Fault] = field(default_factory=dict)
    _stalled: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _runner: Any = None

    def url_for(self, rel: str | os.PathLike[str]) -> str:
        """URL of ``root / rel`` (quoted)."""
        return f"{self.url}/{urllib.parse.quote(Path(rel).as_posix())}"

    def fail(self, path: str, kind: str | int, times: int | None = 1,
             methods: tuple[str, ...] = ("GET",), retry_after: float | None = None) -> None:
        """The next ``times`` (None: all) ``methods`` requests of ``path`` (URL path relative to the root, e.g.
        ``"a/b.tar"``) fail: ``"drop"`` cuts the connection after half the body; ``"stall"`` leaves every
        request of ``path`` unanswered until :meth:`clear` (at most a minute), then answers 503 (``times``
        ignored); an int is answered as that status code (with ``Retry-After: retry_after`` if given)."""
        if kind not in ("drop", "stall") and not isinstance(kind, int):
            raise ValueError(f"fault kind must be 'drop', 'stall' or an HTTP status code, not {kind!r}")
        if kind == "stall":
            with self._lock:
                self._stalled.add("/" + path.lstrip("/"))
            return
        with self._lock:
            self._faults["/" + path.lstrip("/")] = _Fault(kind, times, methods, retry_after)

    def clear(self) -> None:
        """Forget the log and every pending fault."""
        with self._lock:
            self.log.clear()
            self._faults.clear()
            self._stalled.clear()

    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            fault = self._faults.get(path)
            if fault is None or method not in fault.methods:
                return None
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del self._faults[path]
            return fault

    def _local(self, path: str) -> Path | None:
        """The file or folder under root that a URL path names; None when it would leave root."""
        target = (self.root / path.lstrip("/")).resolve()
        root = self.root.resolve()
        return target if target == root or root in target.parents else None

    # -- the handler

    async def _handle(self, request: Any) -> Any:
        """Each request is logged before its last byte goes out, so a client that has its answer finds it
        in the log."""
        from aiohttp import web

        method, path = request.method, request.path
        rng = request.headers.get("Range")

        def answer(status: int, body: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
            self.log.append(LoggedRequest(method, path, rng, status, len(body or b"")))
            return web.Response(status=status, body=body, headers=headers)

        if path in self._stalled:  # a request in flight for as long as the test needs (e.g. to kill the client)
            for _ in range(3000):
                if path not in self._stalled:
                    break
                await asyncio.sleep(0.02)
            return answer(503, b"stalled\n")
        fault = self._take_fault(method, path)
        if fault is not None and isinstance(fault.kind, int):
            wait = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else None
            return answer(fault.kind, f"injected {fault.kind}\n".encode(), wait)
        target = self._local(path)
        if target is None:
            return answer(403, b"outside the served folder\n")
        if method == "PUT":
            if not self.writable:
                return answer(405, b"read-only server\n")
            body = await request.read()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            return answer(201)
        if method not in ("GET", "HEAD"):
            return answer(405)
        if target.is_dir():
            page = self._listing(target, path).encode()
            return answer(200, page if method == "GET" else None,
                          {"Content-Type": "text/html; charset=utf-8", "Content-Length": str(len(page))})
        if not target.is_file():
            return answer(404, b"not found\n")
        st = target.stat()
        size = st.st_size
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
        }
        if self.etags:
            headers["ETag"] = etag
        else:
            etag = ""
        if_match = request.headers.get("If-Match")
        if if_match is not None and if_match.strip() != "*" and etag not in [t.strip() for t in if_match.split(",")]:
            return answer(412, b"precondition failed\n")  # RFC 9110 13.1.1, as nginx and S3 answer
        lo, hi, status = 0, size, 200
        if rng is not None:
            try:
                sl = request.http_range
            except ValueError:  # several ranges or a malformed one: the whole file, as RFC 9110 allows
                sl = slice(None, None)
            start, stop = sl.start, sl.stop
            if start is not None and start < 0:  # "bytes=-n": the last n bytes
                start = max(0, size + start)
            lo = 0 if start is None else start
            hi = size if stop is None else min(stop, size)
            if lo >= size or lo >= hi:
                return answer(416, None, {"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {lo}-{hi - 1}/{size}"
        headers["Content-Length"] = str(hi - lo)
        if method == "HEAD":
            return answer(status, None, headers)
        with open(target, "rb") as f:
            f.seek(lo)
            body = f.read(hi - lo)
        if fault is None or fault.kind != "drop":
            return answer(status, body, headers)
        half = body[: len(body) // 2]
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        self.log.append(LoggedRequest(method, path, rng, status, len(half)))
        await resp.write(half)
        transport = request.transport
        while transport is not None and transport.get_write_buffer_size() > 0:  # the half goes out, then the cut
            await asyncio.sleep(0.001)
        if transport is not None:
            transport.abort()
        return resp

    def _listing(self, folder: Path, path: str) -> str:
        base = "/" + path.strip("/")
        base = "" if base == "/" else base
        links = []
        for entry in sorted(folder.iterdir()):
            name = entry.name + ("/" if entry.is_dir() else "")
            href = html.escape(urllib.parse.quote(f"{base}/{name}"), quote=True)
            links.append(f'<li><a href="{href}">{html.escape(name)}</a></li>')
        return (f"<!DOCTYPE html><html><head><title>Index of {html.escape(base or '/')}</title></head>"
                f"<body><ul>\n" + "\n".join(links) + "\n</ul></body></html>\n")

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 34)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{HOST}:{port}"

    async def _stop(self) -> None:
        await self._runner.cleanup()


@pytest.fixture(scope="session")
def _http_loop() -> Iterator[_Loop]:
    loop = _Loop()
    yield loop
    loop.close()


@pytest.fixture
def http_server(_http_loop: _Loop) -> Iterator[Callable[..., HttpServer]]:
    """Factory: ``http_server(root, writable=False, etags=True)`` starts a server of ``root``; it stops when the
    test ends."""
    started: list[HttpServer] = []

    def start(root: str | os.PathLike[str], writable: bool = False, etags: bool = True) -> HttpServer:
        server = HttpServer(Path(root), writable, etags)
        _http_loop.run(server._start())
        started.append(server)
        return server

    yield start
    for server in started:
        _http_loop.run(server._stop())


# ---------------------------------------------------------------- S3 (moto)

class S3Server:
    """moto's ThreadedMotoServer on 127.0.0.1 (a free port), with every request logged in ``.log``."""

    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer

        log = self.log = _RequestLog()

        class LoggingMotoServer(ThreadedMotoServer):
            def _server_entry(self) -> None:
                from moto.moto_server.werkzeug_app import (
                    DomainDispatcherApplication,
                    MotoRequestHandler,
                    create_backend_app,
                )
                from werkzeug.serving import make_server

                app = _logged_wsgi(DomainDispatcherApplication(create_backend_app), log)
                self._server = make_server(self._ip_address, self._port, app, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = LoggingMotoServer(ip_address=HOST, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()


_WRITES = threading.Lock()


def _logged_wsgi(app: Callable[..., Any], log: _RequestLog) -> Callable[..., Any]:
    """WSGI middleware: one :class:`LoggedRequest` per request, appended before the body's last chunk goes
    out (so a client that has its answer finds it in the log)."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        status = [0]

        def start(st: str, headers: Any, exc_info: Any = None) -> Any:
            status[0] = int(st.split()[0])
            return start_response(st, headers, exc_info)

        if environ["REQUEST_METHOD"] in ("PUT", "POST", "DELETE"):
            # moto checks a conditional write's precondition, then writes, in the request's own thread: two
            # writes at once could both pass. S3 decides them atomically; one write at a time here does too.
            with _WRITES:
                body = app(environ, start)
        else:
            body = app(environ, start)
        chunks = iter(body)
        sent = 0
        logged = False

        def record() -> None:
            nonlocal logged
            if not logged:
                logged = True
                log.append(LoggedRequest(environ["REQUEST_METHOD"],
                                         urllib.parse.unquote(environ.get("PATH_INFO", "")),
                                         environ.get("HTTP_RANGE"), status[0], sent))

        try:
            held = next(chunks, None)
            while held is not None:
                following = next(chunks, None)
                sent += len(held)
                if following is None:
                    record()
                yield held
                held = following
            record()
        finally:
            record()
            if hasattr(body, "close"):
                body.close()

    return wrapped


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@dataclass
class S3Bucket:
    """A fresh bucket on the session's moto server."""

    name: str
    endpoint_url: str
    fs: Any  # s3fs.S3FileSystem bound to the server, no instance or listing cache
    log: _RequestLog  # the server's log, emptied when the fixture starts
    env: dict[str, str]  # the AWS variables set for the test: pass them on to a subprocess

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key.lstrip('/')}"

    def storage_options(self) -> dict[str, Any]:
        """What to pass to fsspec for this server when the environment is not enough."""
        return {"endpoint_url": self.endpoint_url, "key": _DUMMY_KEY, "secret": _DUMMY_SECRET}


_DUMMY_KEY = "testing"
_DUMMY_SECRET = "testing"  # moto accepts any credentials


def aws_test_env(endpoint_url: str, home: Path) -> dict[str, str]:
    """The environment for a test (or a subprocess of it) that talks to the loopback S3 server only."""
    return {
        "AWS_ACCESS_KEY_ID": _DUMMY_KEY,
        "AWS_SECRET_ACCESS_KEY": _DUMMY_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ENDPOINT_URL_S3": endpoint_url,
        "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254 for credentials
        "AWS_CONFIG_FILE": str(home / "aws-config"),  # absent files: the user's profiles stay out
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
    }


_AWS_CLEARED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


@pytest.fixture(scope="session")
def _aws_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aws")  # left empty: the user's profiles stay out


@pytest.fixture(scope="session", autouse=True)
def aws_session_env(s3_server: S3Server, _aws_home: Path) -> Iterator[dict[str, str]]:
    """The loopback AWS environment for the whole session, in every test (autouse, via ``tests/conftest.py``).
    loky reuses its worker processes, which keep the environment they started in, and a pool may start (or
    start again) in any test: with the environment set from the start, any pool serves ``s3`` tests too.
    Restarting the pool whenever tests went from ``s3`` to none and back started it 7 times a run, each two
    interpreters importing the build and torch. For tests without ``s3`` it names only the loopback server
    and empty config files."""
    env = aws_test_env(s3_server.endpoint_url, _aws_home)
    mp = pytest.MonkeyPatch()
    for name in _AWS_CLEARED:
        mp.delenv(name, raising=False)
    for name, value in env.items():
        mp.setenv(name, value)
    yield env
    mp.undo()


@pytest.fixture
def s3(s3_server: S3Server, aws_session_env: dict[str, str]) -> Iterator[S3Bucket]:
    """A fresh bucket and an s3fs filesystem for it; the AWS environment (the session's, pointing at the
    loopback server) comes with it for subprocesses."""
    import s3fs

    from cachebuild.storage.remote.s3_session import new_s3_session

    fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint_url, key=_DUMMY_KEY, secret=_DUMMY_SECRET,
                           skip_instance_cache=True, use_listings_cache=False, session=new_s3_session())
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    s3_server.log.clear()
    yield S3Bucket(bucket, s3_server.endpoint_url, fs, s3_server.log, aws_session_env)
