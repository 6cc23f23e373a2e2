"""The one remote layer's policy: which failures are worth another try, how tries are spaced, when to give up,
and when a late read gets a second request. Every request to a URL goes through :func:`call` (one request, in a
thread) or :func:`each` (a group on an fsspec event loop, each retried on its own: one failing request never
makes the others run again).

- Failures are told apart by type and HTTP status (:func:`classify`), never by message text: 408, 429 and 5xx,
  dropped connections, bodies cut short and timeouts are transient; 404, 403, 412 and the unrecognised are not.
- Tries are spaced by exponential backoff with full jitter, never shorter than a ``Retry-After`` the server sent
  (capped), and stop after ``CACHEBUILD_RETRIES`` tries or ``CACHEBUILD_RETRY_BUDGET`` seconds for the whole
  call; then :class:`Exhausted` carries the last failure for the caller to name its URL.
- A range read that has not answered when most reads of its size have is hedged (:func:`hedged`): a second,
  identical request, the first good answer wins ("The Tail at Scale", Dean & Barroso 2013).
- The knobs are read when a call starts (:class:`Budget`), never at import.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import random
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cachebuild.settings import Settings, settings

__all__ = ["LATENCIES", "MAX_HEDGED_BYTES", "Budget", "Exhausted", "Failure", "Latencies", "RangeIgnored",
           "ShortRead", "acall", "call", "classify", "each", "first_error", "hedged", "is_transient",
           "parse_retry_after"]

T = TypeVar("T")


BACKOFF_S = 0.05  # the first wait between tries is up to this, doubling each try
BACKOFF_MAX_S = 5.0
RETRY_AFTER_MAX_S = 30.0  # a server asking for a longer wait gets this much


class ShortRead(OSError):
    """A range read whose answer came back whole (as long as its Content-Length) but shorter than asked: the
    file is shorter than the reader was told. Not transient (a connection cut early is a payload error)."""


class RangeIgnored(OSError):
    """A range read that came back longer than asked: the server sent the whole file (200, not 206). Not
    transient: asking again fetches the whole file again."""


# ---------------------------------------------------------------- classification

@dataclass(frozen=True)
class Failure:
    transient: bool
    status: int | None = None  # the HTTP status of the answer, when there was one
    retry_after: float | None = None  # seconds the server asked to wait


_TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                              "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps (fsspec turns a 500 on ``info`` into FileNotFoundError *from* it)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def parse_retry_after(value: object) -> float | None:
    """Seconds from a ``Retry-After`` header: a number of seconds or an HTTP date (RFC 9110 10.2.3)."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _transient_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _answer(e: BaseException) -> Failure | None:
    """What an exception carrying a server's answer says (aiohttp's or botocore's), or None."""
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - only without the http extra
        aiohttp = None  # type: ignore[assignment]
    if aiohttp is not None and isinstance(e, aiohttp.ClientResponseError):
        headers: Any = e.headers or {}
        return Failure(_transient_status(e.status), e.status, parse_retry_after(headers.get("Retry-After")))
    response = getattr(e, "response", None)  # botocore.exceptions.ClientError
    if isinstance(response, dict) and "ResponseMetadata" in response:
        meta = response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        code = (response.get("Error") or {}).get("Code")
        headers = meta.get("HTTPHeaders") or {}
        transient = code in _TRANSIENT_CODES or (isinstance(status, int) and _transient_status(status))
        return Failure(transient, status if isinstance(status, int) else None,
                       parse_retry_after(headers.get("retry-after")))
    return None


def _network_types() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [TimeoutError, ConnectionError]
    try:  # the remote extra's packages, where installed (a local zarr read's failures are classified too)
        from fsspec.exceptions import FSTimeoutError

        found.append(FSTimeoutError)
    except ImportError:  # pragma: no cover - only without the remote extra
        pass
    try:
        import aiohttp

        found += [aiohttp.ClientPayloadError, aiohttp.ClientConnectionError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import http.client

        from botocore import exceptions as bx  # type: ignore[import-untyped]
        from botocore.parsers import ResponseParserError  # type: ignore[import-untyped]  # rate-limit answers, broken XML

        found += [bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, ResponseParserError,
                  http.client.IncompleteRead]
    except ImportError:  # pragma: no cover - only without the s3 extra
        pass
    return tuple(found)


def classify(exc: BaseException) -> Failure:
    """Transient or not, with the status and ``Retry-After`` of the answer, from the exception's type."""
    chain = list(_chain(exc))
    if any(isinstance(e, RangeIgnored) for e in chain):
        return Failure(False)
    for e in chain:
        got = _answer(e)
        if got is not None:
            return got
    network = _network_types()
    if any(isinstance(e, network) for e in chain):
        return Failure(True)
    return Failure(False)


def is_transient(exc: BaseException) -> bool:
    """Worth another try: dropped connections, timeouts, 5xx/429/408. Not: 404, 403, 412, bad requests."""
    return classify(exc).transient


# ---------------------------------------------------------------- retries

class Exhausted(Exception):
    """A transient failure that lasted past the tries or the time budget of a call."""

    def __init__(self, last: BaseException, attempts: int, elapsed: float, budget: Budget) -> None:
        super().__init__(f"{type(last).__name__} after {attempts} attempts in {elapsed:.1f} s")
        self.last, self.attempts, self.elapsed = last, attempts, elapsed
        self.status = classify(last).status
        self.budget_s = budget.settings.retry_budget_s
        self.out_of_time = budget.remaining() <= 0


class Budget:
    """The tries and the wall time of one call, shared by every request of a group."""

    def __init__(self, s: Settings | None = None) -> None:
        self.settings = s or settings()  # the knobs as they are when the call starts
        self.deadline = time.monotonic() + self.settings.retry_budget_s

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait(self, attempt: int, failure: Failure) -> float:
        """Seconds before try ``attempt + 1``: full-jitter exponential backoff, at least the server's
        ``Retry-After`` (capped), never past the deadline. A first failure without an answer (a connection
        reset, a body cut short, a timeout) is tried again at once, on a fresh connection: it says nothing
        about the server's load, and a batch waits for its slowest request."""
        if attempt == 1 and failure.status is None:
            return 0.0
        w = random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1)))
        if failure.retry_after is not None:
            w = max(w, min(failure.retry_after, RETRY_AFTER_MAX_S))
        return max(0.0, min(w, self.remaining()))

    def gives_up(self, attempt: int, failure: Failure) -> bool:
        return not failure.transient or attempt >= self.settings.retries or self.remaining() <= 0


def call(fn: Callable[[], T], budget: Budget | None = None,
         on_failure: Callable[[BaseException], None] | None = None) -> T:
    """``fn()`` tried again after each transient failure. A permanent failure is raised as it is; a transient
    one that outlasts the tries or the budget raises :class:`Exhausted`. ``on_failure`` sees every failure
    (e.g. to drop a handle that failed)."""
    b = budget or Budget()
    t0 = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:
            if on_failure is not None:
                on_failure(e)
            failure = classify(e)
            if not failure.transient:
                raise
            if b.gives_up(attempt, failure):
                raise Exhausted(e, attempt, time.monotonic() - t0, b) from e
            time.sleep(b.wait(attempt, failure))


async def acall(fn: Callable[[], Awaitable[T]], budget: Budget, hedge_bytes: int | None = None,
                gate: asyncio.Semaphore | None = None) -> T:
    """The async :func:`call` of one request on an event loop, under a shared ``budget``. ``hedge_bytes``: the
    request is an idempotent read of that many bytes, hedged when late (:func:`hedged`); a hedge is one of its
    tries. ``gate``: held while a try runs, not while it waits for the next (a request
    told to come back in a second must not keep the others of its group from the server meanwhile)."""
    t0 = time.monotonic()
    held: contextlib.AbstractAsyncContextManager[Any] = gate if gate is not None else contextlib.nullcontext()
    s = budget.settings
    attempt = 0

    def may_hedge() -> bool:  # a hedge is a try: it needs one left
        nonlocal attempt
        if attempt >= s.retries or not LATENCIES.allow_hedge():
            return False
        attempt += 1
        return True

    while True:
        attempt += 1
        try:
            async with held:
                if hedge_bytes is None or hedge_bytes > MAX_HEDGED_BYTES or not s.hedge or attempt >= s.retries:
                    return await fn()
                patience = max(s.hedge_after_s, s.http_timeout_s / 4)
                delay = LATENCIES.delay(hedge_bytes, s.hedge_after_s, s.hedge_factor, patience)
                return await hedged(fn, hedge_bytes, delay, patience, may_hedge, is_transient)
        except Exception as e:
            failure = classify(e)
            if not failure.transient:
                raise
            if budget.gives_up(attempt, failure):
                raise Exhausted(e, attempt, time.monotonic() - t0, budget) from e
            await asyncio.sleep(budget.wait(attempt, failure))


async def _each(calls: Sequence[Callable[[], Awaitable[Any]]], budget: Budget, limit: int,
                hedge_bytes: Sequence[int] | None) -> list[Any]:
    gate = asyncio.Semaphore(limit)
    sizes: Sequence[int | None] = hedge_bytes if hedge_bytes is not None else [None] * len(calls)
    return await asyncio.gather(*(acall(c, budget, n, gate) for c, n in zip(calls, sizes, strict=True)),
                                return_exceptions=True)


def each(loop: Any, calls: Sequence[Callable[[], Awaitable[Any]]], budget: Budget | None = None,
         limit: int = 32, hedge_bytes: Sequence[int] | None = None) -> list[Any]:
    """Run every request of a group on ``loop`` (an fsspec filesystem's), at most ``limit`` tries at a time (one
    waiting to be tried again does not count), each retried on its own under one budget. Returns each result,
    or the exception that ended that request, in order: one request that fails keeps the others' results.
    ``hedge_bytes``: the requests are idempotent reads of these sizes, hedged when late."""
    from fsspec.asyn import sync

    return sync(loop, _each, calls, budget or Budget(), limit, hedge_bytes)


def first_error(results: Sequence[Any]) -> BaseException | None:
    """The error to raise for a group: a permanent one before an exhausted one (it says more)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    permanent = [e for e in errors if not isinstance(e, Exhausted)]
    return (permanent or errors)[0] if errors else None


# ---------------------------------------------------------------- hedged reads
#
# Only idempotent reads are hedged (range reads and file heads, never writes), and each answer is still checked by
# its caller (lengths, version pins), so a hedge can cost bytes, never correctness.
# - A read is late when it has not answered after CACHEBUILD_HEDGE_FACTOR times the running median of the reads
#   of its size class (sizes within a factor of 4) in this process, never under CACHEBUILD_HEDGE_AFTER seconds,
#   and it is not queued behind other reads: reads that started after it have answered, or none that started
#   before it is still waiting. A store slow for every request answers them in about the order they were sent;
#   a stalled answer is overtaken. Any read is late after a quarter of the HTTP timeout.
# - A read still unanswered a delay after its hedge is hedged again (both stalled), then after twice that...
# - Hedges are at most a fifth of the reads (plus a burst of 10), so a store slow for everyone is not asked
#   twice for everything; a hedge is one try of its request in the retry policy.
# - Reads over MAX_HEDGED_BYTES are not hedged: their time is the transfer's (a slow link is not a stall, which
#   the socket timeout between bytes catches), and a second request would double their bytes.

_WINDOW = 64  # recent reads per size class: the median follows the store within a batch or two
_OVERTAKEN = 4  # later reads answered before a late one: it is stalled
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
        """No read that started before read number ``started`` is still waiting unhedged."""
        with self._lock:
            return min(self._waiting, default=started) == started

    def record(self, nbytes: int, seconds: float, started: int = 0) -> None:
        with self._lock:
            self._recent.setdefault(self.size_class(nbytes), collections.deque(maxlen=_WINDOW)).append(seconds)
            self._finished.append(started)

    def overtaken(self, started: int) -> int:
        """How many reads that started after read number ``started`` have finished."""
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
    """``fn()``, and another ``fn()`` (if ``may_hedge()``) each time it is late by the rules above (``delay`` and
    ``patience`` in seconds). The first good answer wins (the others cancelled); a permanent failure ends it at
    once; all failing raises the last one."""
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
