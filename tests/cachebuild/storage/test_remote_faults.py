"""The remote layer under a flaky store: requests retried one by one, transient and permanent failures told
apart by type and status, Retry-After honoured, a time budget per call, and a named error at the end.

Through the fault proxy (tests/fault_proxy.py) in front of the range server (tests/servers.py). The full
matrix (every fault kind, 1%, 10% and 33%, HTTP and S3) is tests/reliability/test_remote_fault_matrix.py.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from cachebuild.errors import RemoteError, RemoteUnavailableError
from cachebuild.settings import defaults
from cachebuild.storage import FsspecLocation
from cachebuild.storage.remote.retry import Budget, Failure, classify
from loaders.dataset import CachedImageDataset
from tests.fault_scenarios import Served, run_op, set_fault_env
from tests.loaders_fixtures import make_cache


def _site(tmp_path: Path, http_server, n: int = 128, storage: str = "npy"):
    root, images, _ = make_cache(tmp_path / "site" / "c", n=n, storage=storage, shard_size=16, h=16, w=12)
    return root, images, http_server(tmp_path / "site")


def test_the_headers_of_8_files_open_when_every_third_request_fails(tmp_path, http_server, fault_proxy):
    """The report of issue 27: each header is retried on its own, so a group of 8 opens."""
    _root, images, server = _site(tmp_path, http_server)
    proxy = fault_proxy(server.url, every=3, kinds=("500",))
    ds = CachedImageDataset(f"{proxy.url}/c")
    assert len(ds.manifest.shards) == 8
    assert np.array_equal(ds.gather(np.random.default_rng(0).permutation(128)),
                          images[np.random.default_rng(0).permutation(128)])
    assert proxy.faults["500"] >= 5  # every third request of the open and the reads failed


def _response_error(status: int, retry_after: str | None = None):
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://127.0.0.1/x")
    info = aiohttp.RequestInfo(url, "GET", CIMultiDictProxy(CIMultiDict()), url)
    headers = CIMultiDict({"Retry-After": retry_after} if retry_after else {})
    return aiohttp.ClientResponseError(info, (), status=status, message="m", headers=headers)


def _boto_error(status: int, code: str):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": {}}}, "GetObject")


def test_failures_are_told_apart_by_type_and_status():
    import aiohttp
    from s3fs.errors import translate_boto_error

    assert classify(_response_error(503, "7")) == Failure(True, 503, 7.0)
    assert classify(_response_error(429)).transient and classify(_response_error(408)).transient
    for status in (403, 404, 412, 400):
        assert not classify(_response_error(status)).transient
    assert classify(aiohttp.ClientPayloadError("cut")).transient
    assert classify(aiohttp.ServerDisconnectedError()).transient
    assert classify(TimeoutError()).transient
    # fsspec's HTTP info() raises FileNotFoundError *from* whatever failed: a 500 is still transient
    try:
        try:
            raise _response_error(500)
        except aiohttp.ClientResponseError as e:
            raise FileNotFoundError("http://127.0.0.1/x") from e
    except FileNotFoundError as wrapped:
        assert classify(wrapped) == Failure(True, 500, None)
    assert not classify(FileNotFoundError("x")).transient
    # s3fs turns botocore's errors into OSError subclasses with the ClientError as the cause
    assert classify(translate_boto_error(_boto_error(503, "SlowDown"))).transient
    assert classify(translate_boto_error(_boto_error(500, "InternalError"))).transient
    assert not classify(translate_boto_error(_boto_error(403, "AccessDenied"))).transient
    assert not classify(translate_boto_error(_boto_error(404, "NoSuchKey"))).transient
    assert not classify(ValueError("500 Internal Server Error")).transient  # never by the message text


def test_backoff_waits_at_least_what_retry_after_asks_and_never_past_the_budget():
    b = Budget(dataclasses.replace(defaults(), retry_budget_s=100))
    waits = [b.wait(1, Failure(True, 503, 0.7)) for _ in range(50)]
    assert min(waits) >= 0.7
    assert b.wait(1, Failure(True)) == 0  # a dropped connection: again at once, on a fresh one
    assert b.wait(2, Failure(True)) > 0 or b.wait(2, Failure(True)) > 0
    jitter = [b.wait(3, Failure(True, 500)) for _ in range(200)]
    assert 0 <= min(jitter) < max(jitter) <= 0.2 and len(set(jitter)) > 100  # full jitter, doubling per try
    short = Budget(dataclasses.replace(defaults(), retry_budget_s=0.3))
    assert short.wait(1, Failure(True, 503, 30)) <= 0.3


def test_a_503_with_retry_after_is_waited_for(tmp_path, http_server, fault_proxy):
    (tmp_path / "f.bin").write_bytes(b"x" * 1000)
    server = http_server(tmp_path)
    proxy = fault_proxy(server.url, every=2, kinds=("503",), retry_after=0.6)
    loc = FsspecLocation(f"{proxy.url}")
    assert loc.read_bytes("f.bin") == b"x" * 1000  # request 1
    t0 = time.perf_counter()
    assert loc.read_bytes("f.bin") == b"x" * 1000  # request 2 answers 503, Retry-After: 0.6; request 3 reads
    assert time.perf_counter() - t0 >= 0.6 and proxy.faults["503"] == 1


def test_a_request_told_to_wait_leaves_its_slot_to_the_others_of_its_group():
    """Two of a group's two slots answered 503 with Retry-After: 1; the other six run meanwhile (they used to
    wait the second out behind the sleeping two)."""
    import asyncio

    from fsspec.asyn import get_loop

    from cachebuild.storage.remote.retry import each

    t0, done, tries = time.monotonic(), {}, collections.Counter()

    def call(i: int):
        async def one() -> int:
            tries[i] += 1
            if i < 2 and tries[i] == 1:
                raise _response_error(503, "1")
            await asyncio.sleep(0.01)
            done[i] = time.monotonic() - t0
            return i
        return one

    assert each(get_loop(), [call(i) for i in range(8)], limit=2) == list(range(8))
    assert max(done[i] for i in range(2, 8)) < 0.5 <= 1.0 <= min(done[0], done[1])


def test_a_batch_over_40_shards_waits_once_for_their_retry_after(tmp_path, http_server):
    """The first read of each of 40 shards answers 503, Retry-After: 1. A batch's requests are one group,
    so it waits that second once (per-shard reads queued on a 16-thread pool waited it out three times)."""
    _root, images, _ = make_cache(tmp_path / "site" / "c", n=80, shard_size=2, h=4, w=4)
    server = http_server(tmp_path / "site")
    ds = CachedImageDataset(f"{server.url}/c")
    assert len(ds.manifest.shards) == 40
    for shard in ds.manifest.shards:
        server.fail(f"c/{shard.file}", 503, retry_after=1)
    idx = np.arange(0, 80, 2)  # one row of each shard
    t0 = time.monotonic()
    assert np.array_equal(ds.gather(idx), images[idx])
    assert 1.0 <= time.monotonic() - t0 < 2.0
    assert sum(r.status == 503 for r in server.log) == 40


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # more workers than cores: meant
def test_an_epoch_of_many_batches_in_flight_through_10_percent_faults_is_the_local_cache(tmp_path, http_server,
                                                                                        fault_proxy):
    """sharing.md's advice for a throttling store: more DataLoader workers than cores, each a batch in flight.
    Through 500s, 503s, resets and short bodies on 10% of requests their shuffled epoch is the cache's bytes, in
    order."""
    from torch.utils.data import DataLoader

    from loaders.collate import collate_batch
    from loaders.sampler import CacheSampler

    _root, images, server = _site(tmp_path, http_server)
    proxy = fault_proxy(server.url, rate=0.1, seed=3, kinds=("500", "503", "reset", "short"), retry_after=0.1)
    ds = CachedImageDataset(f"{proxy.url}/c")
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    order = np.fromiter(iter(sampler), dtype=np.int64)
    dl = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=8, collate_fn=collate_batch, timeout=300)
    batches = list(dl)
    assert len(batches) == 8 and np.array_equal(np.concatenate([b[0].numpy() for b in batches]), images[order])
    assert sum(proxy.faults.values()) >= 3, proxy.faults


def test_a_store_that_keeps_failing_ends_in_one_named_error_within_the_budget(tmp_path, http_server, fault_proxy,
                                                                              monkeypatch):
    _root, _images, server = _site(tmp_path, http_server, n=32)
    proxy = fault_proxy(server.url, rate=1.0, kinds=("500",))
    monkeypatch.setenv("CACHEBUILD_RETRIES", "1000")
    monkeypatch.setenv("CACHEBUILD_RETRY_BUDGET", "1.5")
    t0 = time.perf_counter()
    with pytest.raises(RemoteUnavailableError, match=r"/c/manifest\.json: cannot .* after \d+ attempts.*HTTP 500") \
            as e:
        CachedImageDataset(f"{proxy.url}/c")
    assert time.perf_counter() - t0 < 4  # the budget, plus one request's time
    assert e.value.status == 500 and e.value.attempts >= 3 and "manifest.json" in e.value.url


def test_a_stalled_store_is_given_up_by_its_read_timeout(tmp_path, http_server, fault_proxy, monkeypatch):
    _root, _images, server = _site(tmp_path, http_server, n=32)
    proxy = fault_proxy(server.url, rate=1.0, kinds=("stall",))
    monkeypatch.setenv("CACHEBUILD_HTTP_TIMEOUT", "0.3")
    monkeypatch.setenv("CACHEBUILD_RETRY_BUDGET", "1")
    t0 = time.perf_counter()
    with pytest.raises(RemoteUnavailableError, match=r"manifest\.json.*attempts"):
        CachedImageDataset(f"{proxy.url}/c")
    assert time.perf_counter() - t0 < 4 and proxy.faults["stall"] >= 2


def test_a_permanent_failure_is_asked_once(tmp_path, http_server):
    _root, _images, server = _site(tmp_path, http_server, n=32)
    ds = CachedImageDataset(server.url_for("c"))
    server.fail("c/images-00001.npy", 403, times=None)
    server.log.clear()
    with pytest.raises(RemoteError, match=r"images-00001\.npy: access denied \(HTTP 403\)"):
        ds.gather(np.arange(16, 20))
    assert len(server.log.matching("GET", "/c/images-00001.npy")) == 1


@pytest.mark.parametrize("op", ["epoch+block cache", "pull", "verify"])
def test_operations_complete_with_the_local_bytes_at_a_10_percent_fault_rate(tmp_path, http_server, fault_proxy,
                                                                             monkeypatch, op):
    """The default share of the fault matrix: one rate, every kind of fault, a small cache."""
    set_fault_env(monkeypatch)
    root, images, server = _site(tmp_path, http_server, n=64)
    proxy = fault_proxy(server.url, rate=0.1, seed=1)
    run_op(op, Served(root, f"{proxy.url}/c", images, proxy.url), tmp_path / "work", limit_s=120)
    assert sum(proxy.faults.values()) > 0


def test_a_compressed_zarr_chunk_of_a_failing_store_is_named_unavailable_not_damaged(tmp_path, s3, fault_proxy,
                                                                                      monkeypatch):
    """zarr's FsspecStore reads chunks with an s3fs filesystem of its own: one request per try of the remote
    layer's policy (s3fs's own retry loop set to one try), and a store that keeps answering SlowDown ends in
    RemoteUnavailableError. Before, that error was reported as a damaged chunk ("rebuild or re-fetch it")."""
    root, images, _ = make_cache(tmp_path / "local" / "c", n=32, storage="zarr", compression="zstd", h=16, w=12)
    s3.fs.put(str(root), s3.url("caches/c"), recursive=True)
    proxy = fault_proxy(s3.endpoint_url, retry_after=0.01)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(name, proxy.url)
    monkeypatch.setenv("CACHEBUILD_PIN_VERSIONS", "0")  # pinned chunk reads go through FsspecLocation instead
    monkeypatch.setenv("CACHEBUILD_RETRIES", "2")
    ds = CachedImageDataset(s3.url("caches/c"))
    assert np.array_equal(ds.gather(np.arange(4)), images[:4])
    proxy.rate, proxy.kinds = 1.0, ("503",)
    before = proxy.requests
    with pytest.raises(RemoteUnavailableError, match=r"after 2 attempts"):
        ds.gather(np.arange(20, 24))
    assert proxy.requests - before == 2, f"{proxy.requests - before} requests for 2 tries of one chunk"
