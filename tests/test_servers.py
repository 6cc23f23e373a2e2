"""The loopback servers of tests/servers.py behave like real ones: ranges, listings, faults, logs, S3 env."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import urllib.error
import urllib.request

import fsspec
import pytest


@pytest.fixture
def served(tmp_path, http_server):
    payload = bytes(range(256)) * 40  # 10240 bytes, every offset distinguishable by position
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(payload)
    (tmp_path / "sub" / "b c.tar").write_bytes(b"xyz")
    (tmp_path / "sub" / "deeper").mkdir()
    return http_server(tmp_path), payload


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET",
         data: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body); an error status is returned, not raised."""
    req = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def test_range_get_head_and_log(served):
    server, payload = served
    url = server.url_for("sub/a.bin")
    status, headers, body = _get(url, {"Range": "bytes=100-299"})
    assert (status, body) == (206, payload[100:300])
    assert headers["Content-Range"] == f"bytes 100-299/{len(payload)}"
    assert _get(url, {"Range": "bytes=-10"})[2] == payload[-10:]
    assert _get(url, {"Range": "bytes=10000-"})[2] == payload[10000:]
    status, _, body = _get(url)
    assert (status, body) == (200, payload)
    assert _get(url, {"Range": f"bytes={len(payload)}-"})[0] == 416
    status, headers, body = _get(url, method="HEAD")
    assert (status, int(headers["Content-Length"]), body) == (200, len(payload), b"")
    assert [(r.method, r.range, r.status, r.bytes_sent) for r in server.log] == [
        ("GET", "bytes=100-299", 206, 200), ("GET", "bytes=-10", 206, 10), ("GET", "bytes=10000-", 206, 240),
        ("GET", None, 200, len(payload)), ("GET", f"bytes={len(payload)}-", 416, 0), ("HEAD", None, 200, 0)]
    assert server.log.bytes("/sub/a.bin") == 200 + 10 + 240 + len(payload)


def test_fsspec_reads_ranges_lists_and_sees_etag(served):
    server, payload = served
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    url = server.url_for("sub/a.bin")
    info = fs.info(url)
    assert info["size"] == len(payload) and info["ETag"].startswith('"')
    assert fs.cat_file(url, start=5000, end=5100) == payload[5000:5100]
    with fs.open(url, block_size=1024) as f:
        f.seek(9000)
        assert f.read(50) == payload[9000:9050]
    ranged = [r for r in server.log.matching("GET", "/sub/a.bin") if r.status == 206]
    assert ranged and all(r.bytes_sent <= 1024 + 100 for r in ranged)  # never the whole file
    listed = sorted(fs.ls(server.url + "/sub/", detail=False))
    assert listed == sorted([server.url_for("sub/a.bin"), server.url + "/sub/b%20c.tar", server.url + "/sub/deeper/"])
    assert fs.cat_file(server.url + "/sub/b%20c.tar") == b"xyz"


def test_fault_injection(served):
    server, payload = served
    url = server.url_for("sub/a.bin")
    server.fail("sub/a.bin", 503, times=2)
    assert [_get(url)[0] for _ in range(2)] == [503, 503]
    assert _get(url)[2] == payload  # the fault is used up
    server.fail("sub/a.bin", "drop")
    with pytest.raises(http.client.IncompleteRead) as cut:
        _get(url)
    assert len(cut.value.partial) == len(payload) // 2
    assert server.log[-1].bytes_sent == len(payload) // 2
    assert _get(url)[2] == payload
    server.fail("sub/a.bin", 403, times=None)
    assert [_get(url)[0] for _ in range(3)] == [403, 403, 403]
    server.clear()
    assert _get(url)[2] == payload and len(server.log) == 1


def test_nothing_outside_the_root_and_read_only(served, tmp_path):
    server, _ = served
    assert _get(server.url + "/sub/%2e%2e/%2e%2e/etc/passwd")[0] in (403, 404)
    assert _get(server.url_for("new.bin"), method="PUT", data=b"x")[0] == 405
    assert not (tmp_path / "new.bin").exists()


def test_writable_server_stores_puts(tmp_path, http_server):
    server = http_server(tmp_path, writable=True)
    assert _get(server.url_for("d/new.bin"), method="PUT", data=b"hello")[0] == 201
    assert (tmp_path / "d" / "new.bin").read_bytes() == b"hello"


def test_s3_bucket_env_and_log(s3, tmp_path):
    data = os.urandom(50_000)
    s3.fs.pipe(s3.url("k/obj.bin"), data)
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
    # a plain fsspec URL, with no endpoint passed, reaches the loopback server through the environment
    s3.log.clear()
    with fsspec.open(s3.url("k/obj.bin"), "rb", skip_instance_cache=True, default_block_size=4096) as f:
        f.seek(30_000)
        assert f.read(100) == data[30_000:30_100]
    gets = s3.log.matching("GET", f"/{s3.name}/k/obj.bin")
    assert gets and all(r.range is not None for r in gets) and s3.log.bytes() < 20_000
    assert s3.fs.info(s3.url("k/obj.bin"))["ETag"]
    # and so does a subprocess given the test's environment
    code = f"import fsspec; print(fsspec.open({s3.url('k/obj.bin')!r}, 'rb').open().read(3).hex())"
    out = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == data[:3].hex()


def test_s3_buckets_are_fresh(s3):
    assert s3.fs.ls(s3.name) == []
