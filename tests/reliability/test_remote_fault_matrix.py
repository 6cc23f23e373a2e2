"""Every remote operation through a flaky store: the fault proxy (tests/fault_proxy.py) in front of the range
server and of moto's S3, at 1%, 10% and 33% of requests (seeded), every fault kind mixed (500, 503 with
Retry-After, a reset mid-body, a body cut short under its full Content-Length, a stalled answer), and each kind
alone at 33%. Each operation is one trial: a shuffled epoch through a DataLoader with 2 workers (without and
with the block cache), pull, push (S3), ls, info, verify; it survives when it completes with bytes equal to
the local cache within its time limit (tests/fault_scenarios.py). The fast share is in tests/test_remote_faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.fault_proxy import KINDS
from tests.fault_scenarios import OPS, Served, run_op, set_fault_env
from tests.loaders_fixtures import make_cache

RATES = (0.01, 0.10, 0.33)
N = 96  # 6 shards of 16


def _http(tmp_path: Path, http_server, fault_proxy, **faults) -> tuple[Served, object]:
    root, images, _ = make_cache(tmp_path / "site" / "c", n=N, shard_size=16, h=16, w=12)
    server = http_server(tmp_path / "site")
    proxy = fault_proxy(server.url, **faults)
    return Served(root, f"{proxy.url}/c", images, proxy.url), proxy


def _s3(tmp_path: Path, s3, fault_proxy, monkeypatch, **faults) -> tuple[Served, object]:
    root, images, _ = make_cache(tmp_path / "local" / "c", n=N, shard_size=16, h=16, w=12)
    s3.fs.put(str(root), s3.url("caches/c"), recursive=True)
    proxy = fault_proxy(s3.endpoint_url, **faults)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # every client of the test goes through the proxy
        monkeypatch.setenv(name, proxy.url)

    def read_back(name: str) -> bytes:
        return bytes(s3.fs.cat_file(f"{s3.name}/pushed/c/{name}"))  # around the proxy

    return Served(root, s3.url("caches/c"), images, s3.url("caches"), s3.url("pushed/c"), read_back), proxy


def _trials(ledger, row: str, served: Served, proxy, tmp_path: Path, ops: list[str]) -> None:
    lost = []
    for op in ops:
        try:
            with ledger.trial(f"{row}: {op}", note=f"seed {proxy.seed}"):
                run_op(op, served, tmp_path / op.replace(" ", "_").replace("+", "_"))
        except (AssertionError, OSError, RuntimeError, ValueError) as e:  # counted lost; the test fails below
            lost.append(f"{op}: {type(e).__name__}: {str(e)[:300]}")
    ledger.note(f"{row}: {ops[0]}",
                f"all its operations: {proxy.requests} requests, faults injected {dict(proxy.faults)}")
    assert not lost, lost


@pytest.mark.slow
@pytest.mark.parametrize("rate", RATES)
def test_http_operations_under_mixed_faults(tmp_path, http_server, fault_proxy, monkeypatch, ledger, rate):
    set_fault_env(monkeypatch)
    served, proxy = _http(tmp_path, http_server, fault_proxy, rate=rate, seed=int(rate * 100))
    _trials(ledger, f"remote faults, http, {rate:.0%} mixed", served, proxy, tmp_path,
            [op for op in OPS if op != "push"])


@pytest.mark.slow
@pytest.mark.parametrize("rate", RATES)
def test_s3_operations_under_mixed_faults(tmp_path, s3, fault_proxy, monkeypatch, ledger, rate):
    set_fault_env(monkeypatch)
    served, proxy = _s3(tmp_path, s3, fault_proxy, monkeypatch, rate=rate, seed=int(rate * 100))
    _trials(ledger, f"remote faults, s3, {rate:.0%} mixed", served, proxy, tmp_path, list(OPS))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_http_operations_under_one_fault_kind_at_33_percent(tmp_path, http_server, fault_proxy, monkeypatch, ledger,
                                                            kind):
    set_fault_env(monkeypatch)
    served, proxy = _http(tmp_path, http_server, fault_proxy, rate=0.33, kinds=(kind,), seed=33,
                          retry_after=0.2)
    _trials(ledger, f"remote faults, http, 33% {kind}", served, proxy, tmp_path,
            [op for op in OPS if op != "push"])
