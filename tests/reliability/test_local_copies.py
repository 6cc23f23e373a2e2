"""The reader's local copies of a remote cache under stress: threads racing to open one shard (its handle
made once, no descriptor leaked), and a block cache on a disk that fills up (read on uncached, the right
pixels, one warning). The checks are those of tests/cachebuild/storage (test_shard_handles.py,
test_read_integrity.py), repeated as counted trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cachebuild.storage.test_read_integrity import _FULL_DISK, _child, _mounts
from tests.cachebuild.storage.test_shard_handles import FILES, THREADS, _open_all, _open_fds, _rows
from tests.loaders_fixtures import make_cache

FD_ROW = f"{THREADS} threads opening {FILES} shards of a URL at once: each once, no descriptor leaked"
DISK_ROW = "block cache on a disk that fills up: read on uncached, right pixels, warned once"


def test_threads_racing_to_open_shard_handles(tmp_path: Path, ledger) -> None:
    one = _rows(tmp_path, "alone")
    before = _open_fds(tmp_path)
    _open_all(one, 1)
    per_reader = _open_fds(tmp_path) - before
    kept = [one]  # alive to the end: a dropped reader's maps would close and hide what leaked
    for trial in range(40):
        with ledger.trial(FD_ROW, f"trial {trial}"):
            rows = _rows(tmp_path, f"raced{trial}")
            kept.append(rows)
            before = _open_fds(tmp_path)
            got = _open_all(rows, THREADS)
            assert len({id(h) for per_thread in got for h in per_thread}) == FILES
            assert _open_fds(tmp_path) - before == per_reader


@pytest.mark.slow
@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_block_cache_on_a_disk_that_fills_up(tmp_path: Path, http_server, ledger, fs: str) -> None:
    mount = _mounts(fs, tmp_path)
    if mount is None:
        ledger.note(DISK_ROW + f" ({fs})", f"not run: this host cannot mount a small {fs}")
        pytest.skip(f"cannot mount a small {fs} here")
    make_cache(tmp_path / "site" / "c", n=96, h=64, w=64, shard_size=32)
    url = http_server(tmp_path / "site").url_for("c")
    folder = tmp_path / "mnt" / "blocks"
    for free_kb in (50, 100, 150, 200, 250, 300, 400, 550, 700, 1000):
        with ledger.trial(DISK_ROW + f" ({fs})", f"{free_kb} kB free"):
            r = _child(_FULL_DISK, url, str(tmp_path / "mnt"), str(free_kb << 10), shell=mount)
            assert r.returncode == 0, f"rc {r.returncode} (-7 is SIGBUS): {r.stderr[-500:]}"
            got = json.loads(r.stdout.strip().splitlines()[-1])
            assert got["result"] == "ok", got
            assert len(got["warned"]) <= 1 and all(f"block cache {folder} is out of disk space" in w
                                                   for w in got["warned"]), got
