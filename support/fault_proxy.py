"""A fault-injecting HTTP proxy on 127.0.0.1, in front of the range server (:mod:`support.http_server`) or moto's S3
(:mod:`support.s3_server`).

Each request is forwarded to ``upstream`` as it came (method, path, query, headers, body), unless a seeded draw
picks a fault for it (``rate``: the share of requests that get one; ``every=N``: every Nth request instead):

- ``"500"``: an ``InternalError`` answer (S3's XML error body; HTTP clients read the status);
- ``"503"``: a ``SlowDown`` answer with ``Retry-After`` (``retry_after`` seconds);
- ``"reset"``: the upstream answer's headers and half its body, then the connection is reset (RST);
- ``"short"``: the headers with the full ``Content-Length``, half the body, then a clean close (FIN);
- ``"stall"``: nothing for ``stall_s`` seconds (the client's read timeout must end it), then a 503.

A request without a body to cut (HEAD, a PUT's answer) that draws reset or short loses its connection before
any answer, after the upstream got it (a PUT that reached the store but whose answer did not come back).
``.faults`` counts what was injected, ``.requests`` every request: tests check the faults happened.
Started on an :class:`~support.loopback.EventLoopThread`: ``loop.run(proxy.start())``, ``loop.run(proxy.stop())``.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from support.loopback import HOST

__all__ = ["KINDS", "FaultProxy"]

KINDS = ("500", "503", "reset", "short", "stall")
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "upgrade"}
_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by the test '
              'proxy</Message><RequestId>0</RequestId></Error>\n')


@dataclass
class FaultProxy:
    upstream: str
    rate: float = 0.0
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    every: int | None = None
    retry_after: float = 1.0
    only: Callable[[str, str], bool] | None = None  # (method, path): faults only where true; others pass
    limit: int | None = None  # at most this many faults in all
    stall_s: float = 20.0
    url: str = ""
    requests: int = 0
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    _rng: random.Random = field(default_factory=random.Random)
    _runner: Any = None
    _session: Any = None

    def __post_init__(self) -> None:
        bad = set(self.kinds) - set(KINDS)
        if bad:
            raise ValueError(f"fault kinds must be among {KINDS}, not {sorted(bad)}")
        self._rng.seed(self.seed)

    def _draw(self, method: str, path: str) -> str | None:
        self.requests += 1  # one loop thread: no lock needed
        if self.only is not None and not self.only(method, path):
            return None
        if self.limit is not None and sum(self.faults.values()) >= self.limit:
            return None
        if self.every is not None:
            hit = self.requests % self.every == 0
        else:
            hit = self.rate > 0 and self._rng.random() < self.rate
        if not hit:
            return None
        kind = self.kinds[0] if self.every is not None else self._rng.choice(self.kinds)
        self.faults[kind] += 1
        return kind

    def _error(self, status: int) -> Any:
        from aiohttp import web

        headers = {"Content-Type": "application/xml"}
        if status == 503:
            headers["Retry-After"] = f"{self.retry_after:g}"
        code = "SlowDown" if status == 503 else "InternalError"
        return web.Response(status=status, body=_ERROR_XML.format(code=code).encode(), headers=headers)

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        kind = self._draw(request.method, request.path)
        if kind in ("500", "503"):
            return self._error(int(kind))
        if kind == "stall":
            await asyncio.sleep(self.stall_s)
            return self._error(503)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=body if body else None, allow_redirects=False) as up:
            data = await up.read()
            status = up.status
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
        if request.method == "HEAD" and "Content-Length" in up.headers:
            out["Content-Length"] = up.headers["Content-Length"]
        if kind is None:
            return web.Response(status=status, body=data if request.method != "HEAD" else None, headers=out)
        transport = request.transport
        if request.method == "HEAD" or len(data) < 2:  # nothing to cut: the connection goes, no answer
            if transport is not None:
                transport.abort()
            return web.Response(status=status)
        resp = web.StreamResponse(status=status, headers={**out, "Content-Length": str(len(data))})
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        while transport is not None and transport.get_write_buffer_size() > 0:
            await asyncio.sleep(0.001)
        if transport is not None:
            transport.abort() if kind == "reset" else transport.close()
        return resp

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1 (then ``.url`` names it); run it on the loop thread."""
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=120))
        app = web.Application(client_max_size=1 << 34)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        self.url = f"http://{HOST}:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()
