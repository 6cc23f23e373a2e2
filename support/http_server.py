"""A folder served over HTTP on 127.0.0.1 (aiohttp), with the faults a remote store can have.

``HttpServer(root, writable=False, etags=True)``, started on an :class:`~support.loopback.EventLoopThread` with
``loop.run(server.start())``, serves ``root`` at ``.url`` until ``loop.run(server.stop())``. GET/HEAD with one
``Range`` (206 + ``Content-Range``, 416 past the end), ``Content-Length``, ``ETag`` (not with ``etags=False``) and
``Last-Modified``, ``If-Match`` (412 when the file's ETag is another); a folder URL answers an HTML page of links
that fsspec's ``HTTPFileSystem.ls`` reads. Every request is logged in ``.log`` (method, path, Range, status, body
bytes sent); ``.fail(path, kind, times)`` injects faults: ``"drop"`` (headers and half the body, then the
connection is cut), ``"stall"`` (no answer until ``.clear()``, then a 503), or a status code such as 403, 500,
503. With ``writable=True`` a PUT stores the body under ``root``.
"""

from __future__ import annotations

import asyncio
import email.utils
import html
import os
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.loopback import HOST, LoggedRequest, RequestLog

__all__ = ["HttpServer"]

Answer = Callable[..., Any]  # (status, body=None, headers=None) -> a logged aiohttp response


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
    log: RequestLog = field(default_factory=RequestLog)
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

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1 (then ``.url`` names it); run it on the server's loop thread."""
        from aiohttp import web

        app = web.Application(client_max_size=1 << 34)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{HOST}:{port}"

    async def stop(self) -> None:
        await self._runner.cleanup()

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
            return await self._put(request, target, answer)
        if method not in ("GET", "HEAD"):
            return answer(405)
        if target.is_dir():
            page = self._listing(target, path).encode()
            return answer(200, page if method == "GET" else None,
                          {"Content-Type": "text/html; charset=utf-8", "Content-Length": str(len(page))})
        if not target.is_file():
            return answer(404, b"not found\n")
        return await self._file(request, target, fault is not None and fault.kind == "drop", answer)

    async def _put(self, request: Any, target: Path, answer: Answer) -> Any:
        if not self.writable:
            return answer(405, b"read-only server\n")
        body = await request.read()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(body)
        return answer(201)

    async def _file(self, request: Any, target: Path, drop: bool, answer: Answer) -> Any:
        """A GET or HEAD of a file: its range, conditions and headers; ``drop``: half the body, then the cut."""
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
        if request.headers.get("Range") is not None:
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
        if request.method == "HEAD":
            return answer(status, None, headers)
        with open(target, "rb") as f:
            f.seek(lo)
            body = f.read(hi - lo)
        if not drop:
            return answer(status, body, headers)
        return await self._drop(request, status, headers, body)

    async def _drop(self, request: Any, status: int, headers: dict[str, str], body: bytes) -> Any:
        """The headers and half of ``body``, then the connection is cut."""
        from aiohttp import web

        half = body[: len(body) // 2]
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        self.log.append(LoggedRequest(request.method, request.path, request.headers.get("Range"), status, len(half)))
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
