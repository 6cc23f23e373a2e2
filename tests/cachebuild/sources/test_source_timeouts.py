"""A source read from a server that stalls obeys ``CACHEBUILD_HTTP_TIMEOUT``: sources open URLs through the
storage layer's locations (their socket read timeout, their retries), not through fsspec's defaults (aiohttp's
5-minute total timeout, botocore's 60 s read timeout). Here the timeout is 1 s and each stalled answer lasts
up to :data:`STALL_S`: a read that waited for the server would take that long; one that obeys the timeout gives
up after about a second, and the retry on a fresh handle gets the bytes.

Over HTTP the server stalls mid-body (headers and half the body sent, then nothing); over S3 the fault proxy
stalls before its answer (tests/fault_proxy.py). Both at planning (indexing a WebDataset shard) and in a build
(the workers' range reads)."""

from __future__ import annotations

import email.utils
import http.server
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.sources.shards.files import close_handles
from cachebuild.sources.shards.wds import wds_plan
from cachebuild.storage.cache import read_manifest
from tests.shard_fixtures import SIZE

TIMEOUT_S = 1.0
STALL_S = 12.0  # what a read that ignores the timeout waits, per stalled answer (then the server closes)
GAVE_UP_BY_S = 5.0  # a client that obeys the 1 s timeout has dropped the stalled answer by then


class _StallingServer(http.server.ThreadingHTTPServer):
    """A folder over HTTP/1.1 on 127.0.0.1 (HEAD, GET, single byte ranges, ETag and Last-Modified), whose next
    :meth:`stall` GETs send their headers and half their body, then nothing until the client drops the
    connection or :data:`STALL_S` has passed. ``.gave_up`` holds, per stalled answer, the seconds until the
    client dropped it (None: it never did)."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.lock = threading.Lock()
        self.to_stall = 0
        self.gave_up: list[float | None] = []

    def stall(self, n: int) -> None:
        with self.lock:
            self.to_stall = n

    def take_stall(self) -> bool:
        with self.lock:
            if self.to_stall <= 0:
                return False
            self.to_stall -= 1
            return True


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: Nagle + delayed ACKs cost 40 ms a request
    server: _StallingServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = path.read_bytes()
        st = path.stat()
        lo, hi, status = 0, len(data), 200
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            lo, hi, status = int(m[1]), min(len(data), int(m[2]) + 1 if m[2] else len(data)), 206
        body = data[lo:hi]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        if not self.server.take_stall():
            self.wfile.write(body)
            return
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        self.server.gave_up.append(self._wait_for_the_client_to_leave())
        self.close_connection = True

    def _wait_for_the_client_to_leave(self) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < STALL_S:
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        return time.monotonic() - t0
                except OSError:  # reset by the client
                    return time.monotonic() - t0
        return None


@pytest.fixture
def stalling_server(wds_set) -> Iterator[_StallingServer]:
    server = _StallingServer(wds_set["shards"][0].parent)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _shard_hashes(path: Path) -> list[str]:
    return [s.digest for s in read_manifest(path).shards]


def test_a_source_read_stalled_mid_body_gives_up_after_cachebuild_http_timeout(wds_set, stalling_server, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("CACHEBUILD_HTTP_TIMEOUT", f"{TIMEOUT_S:g}")
    server = stalling_server
    n = len(wds_set["shards"])
    url = f"{server.url}/imagenet1k-train-{{0000..{n - 1:04d}}}.tar"
    local = wds_plan(wds_set["pattern"])

    server.stall(1)  # the first GET of planning: indexing shard 0
    t0 = time.monotonic()
    plan = wds_plan(url)
    planned_s = time.monotonic() - t0
    assert len(server.gave_up) == 1, "the stall must have happened"
    assert server.gave_up[0] is not None and TIMEOUT_S * 0.8 <= server.gave_up[0] < GAVE_UP_BY_S, server.gave_up
    assert planned_s < STALL_S - 2, planned_s
    assert plan.keys == local.keys and plan.labels.tolist() == local.labels.tolist()
    # the version the source digest holds is the server's ETag, by the name the digests have always used
    st = wds_set["shards"][0].stat()
    assert plan.reader.shards[0].version == f'ETag="{st.st_mtime_ns:x}-{st.st_size:x}"'

    close_handles()  # as a fresh worker
    server.stall(1)  # the first range read of the build
    remote = build(plan, tmp_path / "remote", BuildOptions(size=SIZE, jobs=1, block_size=16))
    assert len(server.gave_up) == 2, "the stall must have happened"
    assert server.gave_up[1] is not None and TIMEOUT_S * 0.8 <= server.gave_up[1] < GAVE_UP_BY_S, server.gave_up
    ref = build(local, tmp_path / "local", BuildOptions(size=SIZE, jobs=1, block_size=16))
    assert _shard_hashes(remote.path) == _shard_hashes(ref.path)
    assert read_manifest(remote.path).failures == read_manifest(ref.path).failures


def test_an_s3_source_read_stalled_by_the_store_gives_up_after_cachebuild_http_timeout(wds_set, s3, fault_proxy,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_HTTP_TIMEOUT", f"{TIMEOUT_S:g}")
    for shard in wds_set["shards"]:
        s3.fs.put_file(str(shard), s3.url(f"stall-wds/{shard.name}"))
    local = wds_plan(wds_set["pattern"])
    proxy = fault_proxy(s3.endpoint_url, kinds=("stall",), every=1, limit=1, stall_s=STALL_S,
                        only=lambda method, path: method == "GET" and path.endswith(".tar"))
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # every client of the test goes through the proxy
        monkeypatch.setenv(name, proxy.url)
    close_handles()

    t0 = time.monotonic()
    plan = wds_plan(s3.url("stall-wds/"))  # its first GET (indexing a shard) stalls
    planned_s = time.monotonic() - t0
    assert proxy.faults["stall"] == 1, "the stall must have happened"
    assert planned_s < STALL_S - 2, planned_s  # waiting for the store would take STALL_S
    assert plan.keys == local.keys

    close_handles()
    proxy.limit, proxy.faults["stall"] = 2, 1  # one more stall: the first range read of the build
    t0 = time.monotonic()
    remote = build(plan, tmp_path / "remote", BuildOptions(size=SIZE, jobs=1, block_size=16))
    built_s = time.monotonic() - t0
    assert proxy.faults["stall"] == 2, "the stall must have happened"
    assert built_s < STALL_S - 2, built_s
    ref = build(local, tmp_path / "local", BuildOptions(size=SIZE, jobs=1, block_size=16))
    assert _shard_hashes(remote.path) == _shard_hashes(ref.path)
