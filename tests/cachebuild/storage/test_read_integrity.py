"""Read paths never serve pixels other than the cache's: damage, a full disk or a misbehaving server is a named
error. Real loopback servers (tests/servers.py, and Python's own http.server for one that ignores Range).

Test caches encode each sample's index in its pixels (tests/loaders_fixtures.py), so a wrong row is seen.
Cases that could kill the reading process (SIGBUS) run in a child process.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from cachebuild.errors import RemoteError
from cachebuild.storage import BlockCache
from cachebuild.storage.cache import open_cache
from tests.compact_fixtures import jpeg_index_cache, read_index
from tests.loaders_fixtures import decode_index, make_cache
from tests.repo import REPO

_UNSHARE = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-rm"]


def _child(code: str, *args: str, shell: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (inside ``unshare`` with ``shell`` run first, when given)."""
    cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
    if shell is not None:
        cmd = [*_UNSHARE, "sh", "-c", f'{shell} && exec "$@"', "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


def _mounts(kind: str, tmp_path: Path) -> str | None:
    """A shell line mounting a small filesystem of ``kind`` at ``tmp_path/mnt``; None when this host cannot."""
    if shutil.which("unshare") is None:
        return None
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    if kind == "tmpfs":
        line = f"mount -t tmpfs -o size=4m tmpfs {mnt}"
    else:  # ext4 on a loop device: needs root and a free loop device
        if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
            return None
        img = tmp_path / "ext4.img"
        with open(img, "wb") as f:
            f.truncate(8 << 20)
        if subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], capture_output=True).returncode:
            return None
        line = f"mount -o loop {img} {mnt}"
    ok = subprocess.run([*_UNSHARE, "sh", "-c", line], capture_output=True, timeout=30).returncode == 0
    return line if ok else None


_FULL_DISK = """
import json, logging, os, shutil, sys
import numpy as np
from cachebuild.storage.cache import open_cache
from cachebuild.storage import BlockCache
from tests.loaders_fixtures import make_images
url, mnt, free = sys.argv[1], sys.argv[2], int(sys.argv[3])
warned = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warned.append(record.getMessage())
logging.getLogger("cachebuild").addHandler(handler)
images = make_images(96, 64, 64)
shutil.rmtree(os.path.join(mnt, "blocks"), ignore_errors=True)  # an ext4 image outlives its mount: start empty
if os.path.exists(os.path.join(mnt, "filler")):
    os.unlink(os.path.join(mnt, "filler"))
st = os.statvfs(mnt)
fd = os.open(os.path.join(mnt, "filler"), os.O_RDWR | os.O_CREAT)
os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - free)  # leave `free` bytes
reader = open_cache(url, local_cache=BlockCache(os.path.join(mnt, "blocks"), block_bytes=16 << 10))
result = "ok"
for epoch in range(2):  # the second pass: blocks held are served, the rest fetched again
    for lo in range(0, 96, 8):
        if not np.array_equal(reader.gather(np.arange(lo, lo + 8)), images[lo : lo + 8]):
            result = f"wrong pixels in samples [{lo}, {lo + 8}) in pass {epoch}"
            break
print(json.dumps({"result": result, "warned": warned}))
"""


@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_a_block_cache_on_a_full_disk_reads_on_uncached_never_zeros(tmp_path, http_server, fs):
    """A nearly full disk makes ``pwrite`` write part of a block without an error: the rest is a hole that reads
    as zeros (ext4), or a SIGBUS on a memory-mapped read or table store (tmpfs). Before the first fix the
    filling process served those zeros as pixels (ext4) or died of SIGBUS (tmpfs); before the second it
    stopped with BlockCacheFullError. Now it reads on uncached, the right pixels, and warns once naming the
    folder."""
    mount = _mounts(fs, tmp_path)
    if mount is None:
        needs = "mount namespaces" + (", root and a loop device" if fs == "ext4" else "")
        pytest.skip(f"cannot mount a small {fs} here (needs {needs})")
    make_cache(tmp_path / "site" / "c", n=96, h=64, w=64, shard_size=32)  # 3 shards of 393 kB
    url = http_server(tmp_path / "site").url_for("c")
    results = []
    for free in (100 << 10, 150 << 10, 250 << 10, 400 << 10, 700 << 10):  # part of a batch fits, or none
        r = _child(_FULL_DISK, url, str(tmp_path / "mnt"), str(free), shell=mount)
        results.append(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
                       {"result": f"free={free}: rc {r.returncode} (-7 is SIGBUS): {r.stderr[-500:]}", "warned": []})
    assert [x["result"] for x in results] == ["ok"] * 5, results
    folder = tmp_path / "mnt" / "blocks"
    assert all(len(x["warned"]) == 1 for x in results), results  # once per process, however many reads follow
    assert all(f"block cache {folder} is out of disk space" in x["warned"][0] and "uncached" in x["warned"][0]
               for x in results), results


def test_readers_with_other_block_sizes_share_a_block_cache_folder(tmp_path, http_server):
    """Two jobs whose block caches use different block sizes (``BlockCache(block_bytes=...)``, or another
    cachebuild version's default) in one folder. Before the fix they shared one table file: the second
    resized it under the first's memory map, whose next read was a SIGBUS."""
    make_cache(tmp_path / "site" / "c", n=256, h=64, w=64, shard_size=256)  # one 3 MB shard: > 512 small blocks
    url = http_server(tmp_path / "site").url_for("c")
    code = """
    import sys
    import numpy as np
    from cachebuild.storage.cache import open_cache
    from cachebuild.storage import BlockCache
    from tests.loaders_fixtures import decode_index
    url, folder = sys.argv[1], sys.argv[2]
    small = open_cache(url, local_cache=BlockCache(folder, block_bytes=4096))
    assert np.array_equal(decode_index(small.gather(np.arange(4))), np.arange(4))
    big = open_cache(url, local_cache=BlockCache(folder))  # the default block size
    assert np.array_equal(decode_index(big.gather(np.arange(256))), np.arange(256))
    assert np.array_equal(decode_index(small.gather(np.arange(256))), np.arange(256))
    assert np.array_equal(decode_index(big.gather(np.arange(256)[::-1])), np.arange(256)[::-1])
    print("ok")
    """
    r = _child(code, url, str(tmp_path / "blocks"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", f"rc {r.returncode}: {r.stderr[-2000:]}"


@pytest.fixture
def range_ignoring_server(tmp_path) -> Iterator[tuple[str, list[str]]]:
    """Python's http.server on 127.0.0.1: it ignores ``Range`` and answers 200 with the whole file."""
    site = tmp_path / "site"
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.requestline)

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/c", requests
    server.shutdown()
    server.server_close()


def test_a_server_that_ignores_range_requests_is_named_as_such(tmp_path, range_ignoring_server):
    """Before the fix: five downloads of the whole shard per range, then "shorter than its manifest says
    (truncated upload?)" about a shard that came back longer."""
    make_cache(tmp_path / "site" / "c", n=64, h=32, w=32, shard_size=32)
    url, requests = range_ignoring_server
    reader = open_cache(url)
    requests.clear()
    with pytest.raises(RemoteError, match=r"images-00000\.npy: the server ignores HTTP Range requests") as e:
        reader.gather(np.arange(3))
    assert "truncated" not in str(e.value)
    assert len([r for r in requests if r.startswith("GET")]) == 1  # not retried: it would fetch it all again


def _tricky_indices(n: int, shard: int) -> np.ndarray:
    """Unsorted, with duplicates, the first and last sample of every shard (the last shard holds one)."""
    edges = sorted({*range(0, n, shard), *(min(n, s + shard) - 1 for s in range(0, n, shard))})
    rng = np.random.default_rng(7)
    idx = np.array([*edges, *edges[::-1], n - 1, 0, n - 1, *rng.integers(0, n, 40)], dtype=np.int64)
    return idx[rng.permutation(len(idx))]


@pytest.mark.parametrize("storage,compression", [("npy", "none"), ("zarr", "none"), ("zarr", "zstd"), ("jpeg", "")])
@pytest.mark.parametrize("local_cache", [False, True], ids=["direct", "block-cache"])
def test_url_gathers_of_unsorted_duplicate_and_boundary_indices(tmp_path, http_server, storage, compression,
                                                                local_cache):
    n, shard = 49, 16  # shards of 16, 16, 16 and 1 samples (zarr: chunks of the same)
    if storage == "jpeg":
        jpeg_index_cache(tmp_path / "site" / "c", n=n, shard_size=shard)
        index_of = read_index
    else:
        make_cache(tmp_path / "site" / "c", n=n, storage=storage, shard_size=shard, h=16, w=12,
                   compression=compression)
        index_of = decode_index
    url = http_server(tmp_path / "site").url_for("c")
    cache = BlockCache(tmp_path / "blocks", block_bytes=4096) if local_cache else None
    idx = _tricky_indices(n, shard)
    for _ in range(2):  # cold, then (with a block cache) from local disk
        reader = open_cache(url, local_cache=cache)
        assert np.array_equal(index_of(reader.gather(idx)), idx)
        assert np.array_equal(reader.gather(idx), open_cache(tmp_path / "site" / "c").gather(idx))
