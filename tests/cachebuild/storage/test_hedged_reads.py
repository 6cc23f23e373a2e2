"""Hedged range reads (cachebuild.storage.remote.retry.hedged): a read that has not answered long after its peers
did gets a second request, so a stalled answer costs a fraction of a second, not the socket-read timeout.

Through the fault proxy's stall mode (tests/fault_proxy.py: no answer for 20 s) in front of the range server.
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from cachebuild.storage import FsspecLocation
from cachebuild.storage.remote import retry as hedge

# CACHEBUILD_HTTP_TIMEOUT of these tests: what a stalled read costs without a hedge (under the proxy's 20 s
# stall). 12 s, so that a third of it (the hedged read's bound) holds on a loaded 2-core box too: at 6 s the
# bound was 2 s, and a hedged read measured 2.1-3.3 s at load 10-19 while still far below the unhedged cost.
_TIMEOUT = 12.0


@pytest.fixture
def fresh_latencies(monkeypatch):
    """A latency history of this test's own (the module's is the process's, shared by every test)."""
    latencies = hedge.Latencies()
    monkeypatch.setattr(hedge, "LATENCIES", latencies)
    monkeypatch.setenv("CACHEBUILD_HTTP_TIMEOUT", str(_TIMEOUT))
    return latencies


def _served_file(tmp_path, http_server, n_ranges: int, width: int = 4096):
    data = bytes(range(256)) * (n_ranges * width // 256)
    (tmp_path / "f.bin").write_bytes(data)
    ranges = [(i * width, (i + 1) * width) for i in range(n_ranges)]
    return http_server(tmp_path), data, ranges


def _read_through_stalls(tmp_path, http_server, fault_proxy, n: int):
    server, data, ranges = _served_file(tmp_path, http_server, n)
    clean = FsspecLocation(fault_proxy(server.url).url)  # a history of reads the same way, none failing
    assert clean.read_ranges("f.bin", ranges[:32]) == [data[a:b] for a, b in ranges[:32]]
    proxy = fault_proxy(server.url, rate=0.1, kinds=("stall",), seed=3)
    t0 = time.perf_counter()
    got = FsspecLocation(proxy.url).read_ranges("f.bin", ranges)
    return time.perf_counter() - t0, got == [data[a:b] for a, b in ranges], proxy


def test_a_read_of_64_ranges_through_stalls_takes_a_fraction_of_the_read_timeout(
        tmp_path, http_server, fault_proxy, fresh_latencies):
    elapsed, same, proxy = _read_through_stalls(tmp_path, http_server, fault_proxy, 64)
    assert same  # every answer checked for its length as before: the hedges' bytes are the file's
    assert proxy.faults["stall"] >= 3  # the draw did stall several requests (each would cost the timeout unhedged)
    assert elapsed < _TIMEOUT / 3, (f"{elapsed:.2f} s for 64 ranges with {proxy.faults['stall']} stalled, "
                                    f"{fresh_latencies.hedges} hedges of {fresh_latencies.reads} reads")
    assert fresh_latencies.hedges >= proxy.faults["stall"] - 1  # a stalled hedge is hedged again


@pytest.mark.slow
def test_without_hedges_the_same_read_waits_out_the_timeout(tmp_path, http_server, fault_proxy, fresh_latencies,
                                                            monkeypatch):
    """CACHEBUILD_HEDGE=0 turns it off, and shows what the test above measures: a stall costs the timeout."""
    monkeypatch.setenv("CACHEBUILD_HEDGE", "0")
    elapsed, same, proxy = _read_through_stalls(tmp_path, http_server, fault_proxy, 64)
    assert same and proxy.faults["stall"] >= 3
    assert elapsed >= _TIMEOUT and fresh_latencies.hedges == 0


def test_the_first_good_answer_wins_and_the_late_one_is_cancelled():
    cancelled = []
    calls = 0

    async def read() -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:  # the first request stalls
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(1)
                raise
        return b"answer"

    t0 = time.perf_counter()
    got = asyncio.run(hedge.hedged(read, 6, 0.05, 0.05, lambda: True, lambda e: True, hedge.Latencies()))
    assert got == b"answer" and calls == 2 and cancelled == [1] and time.perf_counter() - t0 < 1


def test_a_failure_finishing_beside_the_winning_answer_is_collected():
    """Both requests finish in one wake-up: the first stalled one fails as the hedge answers. The failure is
    retrieved, never logged by asyncio as "Task exception was never retrieved" (seen in a 10% fault run)."""

    async def run_once() -> bytes:
        gate = asyncio.Event()
        calls = 0

        async def read() -> bytes:
            nonlocal calls
            calls += 1
            if calls == 1:
                await gate.wait()
                raise ConnectionResetError("reset")
            gate.set()  # the stalled request fails in the same loop turn as this answer
            return b"answer"

        return await hedge.hedged(read, 6, 0.01, 0.01, lambda: True, lambda e: True, hedge.Latencies())

    async def many() -> list[dict]:
        unretrieved: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        for _ in range(40):  # which of the two finished tasks is looked at first is a set's order
            assert await run_once() == b"answer"
        gc.collect()  # an unretrieved exception is reported when its task is collected
        await asyncio.sleep(0)
        return unretrieved

    assert asyncio.run(many()) == []


def test_a_permanent_failure_of_a_hedge_ends_the_read_at_once():
    async def read() -> bytes:
        await asyncio.sleep(0.2)
        raise PermissionError("403")

    with pytest.raises(PermissionError):
        asyncio.run(hedge.hedged(read, 6, 0.01, 0.01, lambda: True, lambda e: False, hedge.Latencies()))


def test_no_hedge_is_sent_when_the_allowance_is_spent():
    calls = 0

    async def read() -> bytes:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.1)
        return b"x"

    assert asyncio.run(hedge.hedged(read, 1, 0.01, 0.01, lambda: False, lambda e: True, hedge.Latencies())) == b"x"
    assert calls == 1


def test_the_hedge_delay_follows_the_median_of_reads_of_that_size():
    lat = hedge.Latencies()
    assert lat.delay(4096, 0.05, 3.0, 1.0) == 1.0  # no history yet: the fallback
    for _ in range(20):
        lat.record(4096, 0.1)
    assert lat.delay(4096, 0.05, 3.0, 1.0) == pytest.approx(0.3)
    assert lat.delay(4096 * 64, 0.05, 3.0, 1.0) == 1.0  # another size class has its own history
    assert lat.delay(4096, 0.5, 3.0, 1.0) == 0.5  # never under the floor


def test_a_read_too_large_to_hedge_is_asked_once(tmp_path, http_server, fault_proxy, fresh_latencies, monkeypatch):
    """A read over MAX_HEDGED_BYTES is a transfer: its time says nothing of a stall, a hedge would double it."""
    monkeypatch.setattr(hedge, "MAX_HEDGED_BYTES", 4096)
    server, data, ranges = _served_file(tmp_path, http_server, 16, width=8192)
    loc = FsspecLocation(server.url)
    for _ in range(3):
        assert loc.read_ranges("f.bin", ranges) == [data[a:b] for a, b in ranges]
    assert fresh_latencies.reads == 0 and fresh_latencies.hedges == 0
