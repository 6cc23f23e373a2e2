"""The fixture of the fault-injecting proxy (``support/fault_proxy.py``: what each fault kind does), registered
for every module by tests/conftest.py next to the server fixtures (tests/servers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.fault_proxy import FaultProxy
from support.loopback import EventLoopThread

__all__ = ["fault_proxy"]


@pytest.fixture
def fault_proxy(_http_loop: EventLoopThread) -> Iterator[Callable[..., FaultProxy]]:
    """Factory: ``fault_proxy(upstream_url, rate=0.1, kinds=KINDS, seed=0, every=None, retry_after=1.0)`` starts
    a proxy of ``upstream_url`` (scheme and host, no path); it stops when the test ends."""
    started: list[FaultProxy] = []

    def start(upstream: str, **kw: Any) -> FaultProxy:
        proxy = FaultProxy(upstream.rstrip("/"), **kw)
        _http_loop.run(proxy.start())
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        _http_loop.run(proxy.stop())
