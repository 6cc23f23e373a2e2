"""What every loopback service shares: the address, one asyncio loop in a thread, and the request log."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["HOST", "EventLoopThread", "LoggedRequest", "RequestLog"]

HOST = "127.0.0.1"
T = TypeVar("T")


class EventLoopThread:
    """One asyncio loop in a daemon thread, for every server and proxy of a session (aiohttp's run there while
    the caller's thread stays synchronous). ``with EventLoopThread() as loop:`` closes it at the end."""

    def __init__(self, name: str = "loopback-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run ``coro`` on the loop and wait (at most ``timeout`` seconds) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def __enter__(self) -> EventLoopThread:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str  # URL path, decoded, without the query
    range: str | None  # the Range header as sent
    status: int
    bytes_sent: int  # body bytes written (a dropped response counts what went out before the cut)


class RequestLog(list[LoggedRequest]):
    """A list of :class:`LoggedRequest` with the counts tests ask for."""

    def matching(self, method: str | None = None, path: str | None = None) -> list[LoggedRequest]:
        return [r for r in self if (method is None or r.method == method) and (path is None or r.path == path)]

    def bytes(self, path: str | None = None) -> int:
        return sum(r.bytes_sent for r in self if path is None or r.path == path)

    def paths(self, method: str = "GET") -> list[str]:
        return [r.path for r in self if r.method == method]
