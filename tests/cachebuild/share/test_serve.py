"""``cachebuild serve``: a folder of caches read over HTTP with a bearer token. Refused, each a test: no token, a
wrong one, a path out of the folder (``..``, encoded, symbolic links), a range that cannot be read, a write. Read
by ``ls``, ``pull``, ``verify``, ``--store`` and ``CachedImageDataset`` with the token of
``CACHEBUILD_HTTP_TOKEN``, which nothing prints or logs; 16 readers at once get the local cache's bytes with the
server's memory bounded; a server killed and restarted mid-epoch costs readers a retry or a clear error, never
other pixels."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheChangedError
from cachebuild.share import serve as serve_module
from cachebuild.share.serve import CacheServer
from cachebuild.storage.cache import open_cache
from loaders.dataset import CachedImageDataset
from tests.loaders_fixtures import make_cache
from tests.repo import REPO
from tests.trees import tree_bytes

TOKEN = "s3cr3t-" + "a1" * 16


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _store(root: Path) -> dict[str, np.ndarray]:
    """A store of two caches (npy and zarr), its mark, and a secret file beside it."""
    caches = {}
    for name, storage, n in (("c-npy", "npy", 300), ("c-zarr", "zarr", 120)):
        _, images, _ = make_cache(root / "store" / name, n=n, storage=storage, shard_size=32, h=24, w=20)
        caches[name] = images
    (root / "store" / ".store").mkdir()
    (root / "store" / ".store" / "store.json").write_text('{"format": "cachebuild-store", "version": 1}\n')
    (root / "secret.txt").write_text("the secret next door\n")
    return caches


def _token_file(root: Path) -> Path:
    f = root / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    return f


@pytest.fixture
def server(tmp_path: Path, _http_loop: Any) -> Iterator[CacheServer]:
    """``cachebuild serve``'s server of ``tmp_path/store``, in this process (its loop in a thread)."""
    _store(tmp_path)
    s = CacheServer(tmp_path / "store", TOKEN, max_requests=4)
    _http_loop.run(s.start())
    yield s
    _http_loop.run(s.stop())


def _raw(url: str, path: str, token: str | None = TOKEN, method: str = "GET",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with ``path`` sent exactly as written (no client normalises it)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


# ---------------------------------------------------------------- the token

def test_no_token_is_401(server):
    status, headers, body = _raw(server.url, "/c-npy/manifest.json", token=None)
    assert status == 401 and headers["www-authenticate"].startswith("Bearer") and b"cachebuild" not in body


@pytest.mark.parametrize("given", [TOKEN[:-1] + "0", "x" + TOKEN[1:], TOKEN + "x", "", "Bearer"])
def test_a_wrong_token_is_401(server, given):
    status, _, body = _raw(server.url, "/c-npy/manifest.json", token=given)
    assert status == 401 and TOKEN.encode() not in body


def test_another_scheme_is_401_and_the_right_token_reads(server):
    assert _raw(server.url, "/c-npy/manifest.json", token=None, headers={"Authorization": f"Basic {TOKEN}"})[0] == 401
    status, _, body = _raw(server.url, "/c-npy/manifest.json")
    assert status == 200 and body == (server.root / "c-npy" / "manifest.json").read_bytes()


def test_the_token_is_compared_in_constant_time(server, monkeypatch):
    """Every request's token goes through hmac.compare_digest (of digests: a length is not told either)."""
    seen: list[tuple[bytes, bytes]] = []
    real = serve_module.hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(serve_module.hmac, "compare_digest", spy)
    _raw(server.url, "/", token="nope")
    _raw(server.url, "/")
    assert len(seen) == 2 and all(len(a) == len(b) == 32 for a, b in seen)
    assert seen[1] == (hashlib.sha256(TOKEN.encode()).digest(),) * 2


def test_a_token_file_must_hold_one_word(tmp_path):
    from cachebuild.errors import OptionError
    from cachebuild.share.serve import read_token

    (tmp_path / "t").write_text("two words\n")
    with pytest.raises(OptionError, match="one word"):
        read_token(tmp_path / "t")
    (tmp_path / "t").write_text("\n")
    with pytest.raises(OptionError, match="one word"):
        read_token(tmp_path / "t")


# ---------------------------------------------------------------- nothing outside the folder

@pytest.mark.parametrize("path", [
    "/../secret.txt", "/%2e%2e/secret.txt", "/%2E%2E/secret.txt", "/c-npy/../../secret.txt",
    "/c-npy/..%2f..%2fsecret.txt", "/c-npy/%2e%2e%2f%2e%2e%2fsecret.txt", "/.%2e/secret.txt", "//secret.txt",
    "/c-npy/.%2E/.%2E/secret.txt", "/..%5csecret.txt", "/c-npy%00/manifest.json", "/%2fetc%2fpasswd",
])
def test_traversal_paths_are_refused(server, path):
    status, _, body = _raw(server.url, path)
    assert 400 <= status < 500 and b"secret next door" not in body and b"root:" not in body


def test_symbolic_links_are_refused_wherever_they_point(server, tmp_path):
    root = server.root
    (root / "out-file").symlink_to(tmp_path / "secret.txt")
    (root / "out-dir").symlink_to(tmp_path)
    (root / "c-npy" / "in-file").symlink_to(root / "c-npy" / "manifest.json")
    for path in ("/out-file", "/out-dir/secret.txt", "/out-dir/", "/c-npy/in-file"):
        status, _, body = _raw(server.url, path)
        assert status == 404 and b"secret next door" not in body, path
    _, _, page = _raw(server.url, "/")
    assert b"out-file" not in page and b"out-dir" not in page  # not listed either


def test_folders_are_pages_of_links_that_ls_reads(server):
    _, _, root = _raw(server.url, "/")
    assert b'href="/c-npy/"' in root and b'href="/.store/"' in root and b"secret" not in root
    _, _, records = _raw(server.url, "/.store/")
    assert b'href="/.store/store.json"' in records
    _, _, cache = _raw(server.url, "/c-npy")
    assert b'href="/c-npy/manifest.json"' in cache


def test_writes_are_refused(server):
    before = tree_bytes(server.root)
    for method in ("PUT", "POST", "DELETE", "PATCH"):
        assert _raw(server.url, "/c-npy/manifest.json", method=method)[0] == 405
    assert tree_bytes(server.root) == before


# ---------------------------------------------------------------- ranges, versions

def test_ranges_etag_and_last_modified(server):
    data = (server.root / "c-npy" / "labels.npy").read_bytes()
    status, h, body = _raw(server.url, "/c-npy/labels.npy", headers={"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20] and h["content-range"] == f"bytes 10-19/{len(data)}"
    assert h["etag"].startswith('"') and "last-modified" in h  # a strong tag: readers pin it
    assert _raw(server.url, "/c-npy/labels.npy", headers={"Range": "bytes=-7"})[2] == data[-7:]
    ok = _raw(server.url, "/c-npy/labels.npy", headers={"Range": "bytes=0-3", "If-Match": h["etag"]})
    assert ok[0] == 206 and ok[2] == data[:4]
    assert _raw(server.url, "/c-npy/labels.npy", headers={"If-Match": '"other"'})[0] == 412
    head = _raw(server.url, "/c-npy/labels.npy", method="HEAD")
    assert head[0] == 200 and int(head[1]["content-length"]) == len(data) and head[2] == b""


@pytest.mark.parametrize("rng", ["bytes=abc", "bytes=5-2", "bytes=0-1,4-5", "bytes=999999999-", "items=0-5",
                                 "bytes=--1", "bytes=-"])
def test_a_malformed_range_is_refused(server, rng):
    status, h, body = _raw(server.url, "/c-npy/labels.npy", headers={"Range": rng})
    assert status == 416 and body == b"" and h["content-range"].startswith("bytes */")


def test_a_gzip_client_gets_the_file_itself(server):
    (server.root / "c-npy" / "labels.npy.gz").write_bytes(b"not these bytes")
    status, h, body = _raw(server.url, "/c-npy/labels.npy", headers={"Accept-Encoding": "gzip"})
    assert status == 200 and "content-encoding" not in h and body == (server.root / "c-npy" / "labels.npy").read_bytes()


# ---------------------------------------------------------------- a bound on concurrent requests

def test_at_most_max_requests_answers_at_once_and_503_beyond_the_queue(server, monkeypatch):
    real = CacheServer._handle

    async def slow(self: CacheServer, request: Any) -> Any:
        import asyncio

        await asyncio.sleep(0.2)
        return await real(self, request)

    monkeypatch.setattr(CacheServer, "_handle", slow)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda _: _raw(server.url, "/c-npy/labels.npy")[0], range(16)))
    assert got == [200] * 16 and server.peak == 4  # max_requests=4
    server.max_waiting = 4
    server.peak = 0
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda _: _raw(server.url, "/c-npy/labels.npy"), range(16)))
    busy = [h for s, h, _ in got if s == 503]
    assert busy and all(h["retry-after"] == "1" for h in busy) and server.peak <= 4
    assert sorted({s for s, _, _ in got}) == [200, 503]


# ---------------------------------------------------------------- the real command, and its readers

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(root: Path, token_file: Path, port: int = 0, *extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``cachebuild serve ROOT`` in its own process; yields (its base URL, the process)."""
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild", "serve", str(root), "--token-file", str(token_file),
                             "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("serving "), line + proc.stdout.read()
        url = line.split(" at ", 1)[1].split("/ ", 1)[0]
        said: list[str] = []  # read as it comes: a full pipe would stop the server
        threading.Thread(target=lambda: said.extend(proc.stdout or ()), daemon=True).start()
        proc.said = said  # type: ignore[attr-defined]
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)
        if proc.stdout is not None:
            proc.stdout.close()


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_ls_pull_verify_and_a_dataset_read_it_with_the_token_never_shown(tmp_path, monkeypatch, caplog):
    caches = _store(tmp_path)
    with serving(tmp_path / "store", _token_file(tmp_path)) as (url, proc):
        caplog.set_level(logging.DEBUG)  # every logger, aiohttp's and fsspec's too
        monkeypatch.delenv("CACHEBUILD_HTTP_TOKEN", raising=False)
        denied = _cli("ls", url)
        assert denied.exit_code != 0 and "CACHEBUILD_HTTP_TOKEN" in denied.output, denied.output
        monkeypatch.setenv("CACHEBUILD_HTTP_TOKEN", TOKEN)
        outputs = []
        ls = _cli("ls", url)
        assert ls.exit_code == 0 and "c-npy" in ls.output and "c-zarr" in ls.output and "LAST USED" in ls.output
        pulled = _cli("pull", f"{url}/c-npy", tmp_path / "pulled", "--no-progress")
        assert pulled.exit_code == 0, pulled.output
        assert tree_bytes(tmp_path / "pulled") == tree_bytes(tmp_path / "store" / "c-npy")
        for name in caches:
            v = _cli("verify", f"{url}/{name}")
            assert v.exit_code == 0 and "ok" in v.output, v.output
            outputs.append(v.output)
        ds = CachedImageDataset(f"{url}/c-zarr")
        assert np.array_equal(ds.gather(np.arange(len(ds))), caches["c-zarr"])
        monkeypatch.setenv("CACHEBUILD_HTTP_TOKEN", "wrong")
        wrong = _cli("verify", f"{url}/c-npy")
        assert wrong.exit_code != 0 and "HTTP 401" in wrong.output and "Bearer" not in wrong.output
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        served = "".join(proc.said)
    everything = "\n".join([denied.output, ls.output, pulled.output, wrong.output, *outputs, caplog.text, served])
    assert TOKEN not in everything and TOKEN[:12] not in everything


def _readers(url: str, local: np.ndarray, n: int, seconds: float, seed: int = 0) -> dict[str, Any]:
    """``n`` threads, each with its own dataset of ``url``, reading random batches for ``seconds`` and comparing
    each with the local cache's pixels. Counts: batches equal, unequal (must stay 0), errors by kind."""
    out: dict[str, Any] = {"equal": 0, "unequal": 0, "errors": {}}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def one(k: int) -> None:
        rng = np.random.default_rng(seed + k)
        ds = CachedImageDataset(url)
        while time.monotonic() < stop:
            idx = np.sort(rng.choice(len(local), 24, replace=False))
            try:
                got = ds.gather(idx)
            except Exception as e:  # told apart below: what a reader may see is the test's question
                with lock:
                    out["errors"][type(e).__name__] = out["errors"].get(type(e).__name__, 0) + 1
                if isinstance(e, CacheChangedError):
                    return  # that reader is done: it stops rather than read another cache
                continue
            with lock:
                out["equal" if np.array_equal(got, local[idx]) else "unequal"] += 1

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))
    return out


def _sixteen_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    caches = _store(tmp_path)
    monkeypatch.setenv("CACHEBUILD_HTTP_TOKEN", TOKEN)
    with serving(tmp_path / "store", _token_file(tmp_path), 0, "--max-requests", "8") as (url, proc):
        _readers(f"{url}/c-npy", caches["c-npy"], 2, 0.5)  # warm: the server's own start-up memory
        before = _rss_kb(proc.pid)
        peak = [before]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.1):
                peak.append(_rss_kb(proc.pid))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        got = _readers(f"{url}/c-npy", caches["c-npy"], 16, seconds)
        done.set()
        watcher.join()
    print(f"16 readers, {seconds:.0f} s: {got['equal']} batches equal; server RSS {before / 1024:.0f} MB -> "
          f"peak {max(peak) / 1024:.0f} MB")
    assert got["unequal"] == 0 and got["errors"] == {} and got["equal"] >= 16
    assert max(peak) - before < 64 * 1024, (before, max(peak))  # bounded: files go by sendfile, 8 at once


def test_sixteen_readers_get_the_local_bytes_with_memory_bounded(tmp_path, monkeypatch):
    _sixteen_readers(tmp_path, monkeypatch, 4.0)


@pytest.mark.slow  # the 60 s soak
def test_sixteen_readers_for_a_minute(tmp_path, monkeypatch):
    _sixteen_readers(tmp_path, monkeypatch, 60.0)


def test_a_server_killed_and_restarted_mid_epoch(tmp_path, monkeypatch):
    """Killed and back on the same port: readers retry and go on with the same bytes. Killed, the cache's shard
    rewritten with other pixels, back: readers stop with CacheChangedError, never reading the new pixels."""
    caches = _store(tmp_path)
    monkeypatch.setenv("CACHEBUILD_HTTP_TOKEN", TOKEN)
    monkeypatch.setenv("CACHEBUILD_RETRIES", "40")  # enough tries to span a restart on a loaded machine
    local = caches["c-npy"]
    port = _free_port()
    token = _token_file(tmp_path)
    results: dict[str, Any] = {}

    def read(seconds: float) -> threading.Thread:
        t = threading.Thread(target=lambda: results.update(_readers(url, local, 4, seconds)))
        t.start()
        return t

    url = f"http://127.0.0.1:{port}/c-npy"
    with serving(tmp_path / "store", token, port) as (_, proc):
        readers = read(6.0)
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(1.0)
    with serving(tmp_path / "store", token, port):
        readers.join()
    assert results["unequal"] == 0 and results["errors"] == {} and results["equal"] > 4, results

    with serving(tmp_path / "store", token, port) as (_, proc):
        readers = read(8.0)
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for shard in sorted((tmp_path / "store" / "c-npy").glob("images-*.npy")):
        data = bytearray(shard.read_bytes())
        data[128:] = bytes(255 - b for b in data[128:])  # other pixels, same size, same header
        shard.write_bytes(bytes(data))
    with serving(tmp_path / "store", token, port):
        readers.join()
    assert results["unequal"] == 0, results  # never the new pixels
    assert results["errors"].get("CacheChangedError", 0) >= 1, results
    assert set(results["errors"]) <= {"CacheChangedError"}, results


def test_serve_leases_the_caches_it_serves(tmp_path, _http_loop, monkeypatch):
    """A cache read through the server is leased in the store while requests come (gc then keeps it), and its last
    use recorded when they stop."""
    from cachebuild.share.store import Store

    _store(tmp_path)
    s = CacheServer(tmp_path / "store", TOKEN, lease_s=2.0)
    _http_loop.run(s.start())
    try:
        _raw(s.url, "/c-npy/labels.npy")
        _raw(s.url, "/.store/store.json")  # the store's records are no cache
        s.leases.flush()
        usage = Store(tmp_path / "store").usage("c-npy")
        assert [r.what for r in usage.leases] == ["serve"] and Store(tmp_path / "store").usage("c-zarr").leases == []
        time.sleep(2.2)
        s.leases.flush()
        usage = Store(tmp_path / "store").usage("c-npy")
        assert usage.leases == [] and usage.last_used is not None
    finally:
        _http_loop.run(s.stop())
    assert open_cache(tmp_path / "store" / "c-npy").manifest.count == 300
