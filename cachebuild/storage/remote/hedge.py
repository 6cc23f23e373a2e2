"""Hedged range reads: a read that has not answered when most reads of its size have gets a second, identical
request; the first good answer wins and the other is cancelled ("The Tail at Scale", Dean & Barroso 2013).

A stalled answer (a store's overloaded node, a dropped packet on a keep-alive connection) otherwise costs a
whole socket-read timeout, and a batch waits for its slowest request. Only idempotent reads are hedged (range
reads and file heads, never writes), and each answer is still checked by its caller (lengths), so a hedge can
cost bytes, never correctness.

- A read is late when it has not answered after ``CACHEBUILD_HEDGE_FACTOR`` (default 3) times the running
  median of the reads of its size class (sizes within a factor of 4) in this process, never under
  ``CACHEBUILD_HEDGE_AFTER`` seconds (default 0.05), *and* it is not queued behind other reads: reads that
  started after it have answered, or none that started before it is still waiting. A store slow for every
  request (many reads queued at once) answers them in about the order they were sent; a stalled answer is
  overtaken. Any read is late after a quarter of the HTTP timeout, and no delay is longer than that.
- A read still unanswered a delay after its hedge is hedged again (both stalled), then after twice that...
- Hedges are at most a fifth of the reads (plus a burst of 10), so a store slow for everyone is not asked
  twice for everything; a hedge is one try of its request in the retry policy (``CACHEBUILD_RETRIES``).
- Reads over 16 MiB are not hedged (``MAX_HEDGED_BYTES``: a transfer's time, not a stall's).
- ``CACHEBUILD_HEDGE=0`` turns it off.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["LATENCIES", "MAX_HEDGED_BYTES", "Latencies", "hedged"]

T = TypeVar("T")

_WINDOW = 64  # recent reads per size class: the median follows the store within a batch or two
_OVERTAKEN = 4  # later reads answered before a late one: it is stalled
# Larger reads are not hedged: their time is the transfer's (a slow link is not a stall, which the socket
# timeout between bytes catches), and a second request would double their bytes.
MAX_HEDGED_BYTES = 16 << 20
_MIN_SEEN = 8
_HEDGE_SHARE, _HEDGE_BURST = 0.2, 10


class Latencies:
    """Durations of recent successful reads per size class, which reads finished, and the hedge allowance, of
    one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # fsspec loops run in their own threads; several may share this
        self._recent: dict[int, collections.deque[float]] = {}
        self._finished: collections.deque[int] = collections.deque(maxlen=_WINDOW * 4)  # their start numbers
        self._waiting: set[int] = set()  # start numbers of reads under way and not hedged
        self.reads = 0
        self.hedges = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(0, int(nbytes).bit_length() - 1) // 2

    def begin(self) -> int:
        """A read starts: its start number."""
        with self._lock:
            self.reads += 1
            self._waiting.add(self.reads)
            return self.reads

    def settle(self, started: int) -> None:
        """Read number ``started`` answered, failed or was hedged: no longer in line."""
        with self._lock:
            self._waiting.discard(started)

    def first_in_line(self, started: int) -> bool:
        """No read that started before read number ``started`` is still waiting unhedged: if it is late, it is
        not queued behind others."""
        with self._lock:
            return min(self._waiting, default=started) == started

    def record(self, nbytes: int, seconds: float, started: int = 0) -> None:
        with self._lock:
            self._recent.setdefault(self.size_class(nbytes), collections.deque(maxlen=_WINDOW)).append(seconds)
            self._finished.append(started)

    def overtaken(self, started: int) -> int:
        """How many reads that started after read number ``started`` have finished: a read stuck while later
        ones answer is stalled, not queued behind the others (those finish in about the order they began)."""
        with self._lock:
            return sum(1 for k in self._finished if k > started)

    def delay(self, nbytes: int, floor: float, factor: float, fallback: float) -> float:
        """Seconds to wait for a read of ``nbytes`` before hedging it, never past ``fallback`` (a store whose
        every read queues must not push the hedge past the socket timeout it is there to beat)."""
        with self._lock:
            seen = list(self._recent.get(self.size_class(nbytes), ()))
        if len(seen) < _MIN_SEEN:
            return max(floor, fallback)
        return max(floor, min(fallback, factor * statistics.median(seen)))

    def allow_hedge(self) -> bool:
        with self._lock:
            if self.hedges >= _HEDGE_SHARE * self.reads + _HEDGE_BURST:
                return False
            self.hedges += 1
            return True


LATENCIES = Latencies()  # per process: a forked DataLoader worker starts with its parent's history


async def _quietly(tasks: set[asyncio.Future[Any]]) -> None:
    for t in tasks:
        t.cancel()
    if tasks:  # their CancelledError (or a late failure) collected, never "exception was never retrieved"
        await asyncio.gather(*tasks, return_exceptions=True)


async def hedged(fn: Callable[[], Awaitable[T]], nbytes: int, delay: float, patience: float,
                 may_hedge: Callable[[], bool], transient: Callable[[BaseException], bool],
                 latencies: Latencies | None = None) -> T:
    """``fn()``, and another ``fn()`` (if ``may_hedge()``) once it is late: no answer after ``delay`` seconds
    while reads that started after it have answered (``_OVERTAKEN``) or none that started before it waits
    unhedged, or none after ``patience`` seconds; then another after ``delay``, twice that, ... while none
    answers (a refused hedge is asked for again at the next of these times). Returns
    the first good answer (the other requests cancelled). A permanent failure of any ends it at once; a
    transient one waits for the others; all failing raises the last one."""
    lat = latencies or LATENCIES
    number = lat.begin()
    t0 = time.monotonic()
    started: dict[asyncio.Future[Any], float] = {asyncio.ensure_future(fn()): t0}
    pending: set[asyncio.Future[Any]] = set(started)
    last: BaseException | None = None
    sent = False
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            for t in done:  # each failure retrieved, also one finishing beside the answer returned below
                t.exception()
            for t in done:
                exc = t.exception()
                if exc is None:
                    lat.record(nbytes, time.monotonic() - started[t], number)
                    return t.result()
                if not transient(exc):
                    raise exc
                last = exc
            if done:
                continue
            late = sent or time.monotonic() - t0 >= patience or lat.overtaken(number) >= _OVERTAKEN \
                or lat.first_in_line(number)
            if late and may_hedge():  # refused (the allowance spent, no try left): asked again next time
                extra = asyncio.ensure_future(fn())
                started[extra] = time.monotonic()
                pending.add(extra)
                if sent:
                    delay *= 2  # both stalled: the store may be slow for everyone now
                else:
                    lat.settle(number)
                sent = True
        assert last is not None
        raise last
    finally:
        lat.settle(number)
        await _quietly(pending)
