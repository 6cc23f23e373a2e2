"""``cachebuild gc STORE``: whole caches, least recently used first, until the store is within ``--max-bytes`` (or
what ``--older-than`` leaves); never one in use (a URL reader's lease, a job holding a folder cache open); a dry
run deletes nothing; a cache removed under a reader whose lease ran out is an error there, never other pixels.
A shared folder and moto's S3 on 127.0.0.1."""

from __future__ import annotations

import datetime as dt
import gc as collector
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheChangedError, RemoteError
from cachebuild.share.gc import collect, parse_age, parse_bytes
from cachebuild.share.push import push
from cachebuild.share.store import Store
from cachebuild.storage.cache import open_cache, write_cache
from cachebuild.storage.remote.lease import LeaseRecord, lease_name, used_name, utc_now
from loaders.dataset import CachedImageDataset
from tests.loaders_fixtures import make_cache
from tests.trees import tree_bytes

DAY = 86400.0


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _record(store: Path, name: str, seconds_ago: float, ttl_s: float = 0.0, what: str = "use",
            host: str = "trainer-3", token: str = "t0") -> None:
    at = utc_now() - dt.timedelta(seconds=seconds_ago)
    rec = LeaseRecord(host, 777, "ada", at.isoformat(), ttl_s, what)
    target = store / (used_name(name) if what == "use" else lease_name(name, token))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(rec.to_bytes())


def _folder_store(root: Path, used_days_ago: dict[str, float]) -> tuple[Path, dict[str, np.ndarray], int]:
    """A marked store of one cache per name (same size each), each last used that many days ago."""
    store = root / "store"
    images = {}
    for k, (name, days) in enumerate(used_days_ago.items()):
        _, images[name], _ = make_cache(store / name, n=40 + 0 * k, shard_size=16, h=16, w=16)
        _record(store, name, days * DAY)
    Store(store).mark()
    size = Store(store).cache(next(iter(used_days_ago))).list_files()
    return store, images, sum(v for k, v in size.items() if k != "manifest.json")


def test_a_dry_run_deletes_nothing(tmp_path):
    store, _, _ = _folder_store(tmp_path, {"a": 3, "b": 1, "c": 2})
    before = tree_bytes(store)
    r = _cli("gc", store, "--max-bytes", "0")
    assert r.exit_code == 0, r.output
    assert [line.split(":")[0] for line in r.output.splitlines()[:3]] == ["would remove a", "would remove c",
                                                                          "would remove b"]  # oldest use first
    assert "a dry run: nothing was removed (--yes removes)" in r.output
    assert tree_bytes(store) == before


def test_only_unused_caches_go_least_recently_used_first_and_the_budget_holds(tmp_path):
    store, images, size = _folder_store(tmp_path, {"a": 3, "b": 1, "c": 1 / 24, "held": 10, "leased": 5})
    reader = open_cache(store / "held")  # a job reading the folder: its shared lock on the manifest
    _record(store, "leased", 30, ttl_s=600, what="reader")  # a URL reader renewed its lease 30 s ago
    _record(store, "a", 2 * DAY, ttl_s=600, what="reader", token="dead")  # a lease that ran out long ago
    report = collect(store, max_bytes=3 * size, yes=True)
    assert [e.name for e in report.removed] == ["a", "b"]  # least recently used first; "held" (the oldest) kept
    assert set(report.kept) == {"held"} and "in use: a process holds it open" in report.kept["held"]
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".") and p.is_dir()) == [
        "c", "held", "leased"]
    assert report.after <= 3 * size and not report.over_budget
    assert not (store / ".store" / "used" / "a.json").exists() and not (store / ".store" / "leases" / "a").exists()
    assert np.array_equal(reader.gather(np.arange(40)), images["held"])  # its reader read on
    over = _cli("gc", store, "--max-bytes", str(size), "--yes")
    assert over.exit_code == 1 and "still over the budget" in over.output and "removed c:" in over.output
    assert "kept leased: in use: reader pid 777 on trainer-3 (user ada)" in over.output, over.output
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".") and p.is_dir()) == ["held", "leased"]
    del reader
    collector.collect()
    freed = _cli("gc", store, "--max-bytes", str(size), "--yes")
    assert freed.exit_code == 0 and "removed held:" in freed.output and (store / "leased").is_dir()


def test_older_than_removes_what_was_not_used_for_that_long(tmp_path):
    store, _, _ = _folder_store(tmp_path, {"old": 40, "recent": 2, "older": 31})
    r = _cli("gc", store, "--older-than", "30d", "--yes", "--json")
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(r.output)["removed"]) == ["old", "older"] and (store / "recent").is_dir()


def test_gc_keeps_to_stores_and_writable_ones(tmp_path, http_server):
    make_cache(tmp_path / "plain" / "x", n=5)
    r = _cli("gc", tmp_path / "plain", "--max-bytes", "0", "--yes")
    assert r.exit_code == 1 and "is not a cachebuild store" in r.output and (tmp_path / "plain" / "x").is_dir()
    store, _, _ = _folder_store(tmp_path, {"a": 1})
    r = _cli("gc", http_server(store).url, "--max-bytes", "0", "--yes")
    assert r.exit_code == 1 and "read-only" in r.output
    assert _cli("gc", store).exit_code == 1  # nothing to keep within: said so


def test_a_folder_that_holds_more_than_its_cache_is_left(tmp_path):
    store, _, _ = _folder_store(tmp_path, {"a": 3})
    (store / "a" / "notes.txt").write_text("mine")
    report = collect(store, max_bytes=0, yes=True)
    assert report.removed == [] and "files its manifest does not name" in report.kept["a"]
    assert (store / "a" / "notes.txt").read_text() == "mine"


def test_ls_shows_each_caches_last_use_and_readers(tmp_path):
    store, _, _ = _folder_store(tmp_path, {"a": 3, "b": 1})
    _record(store, "b", 5, ttl_s=600, what="reader")
    r = _cli("ls", store, "--json")
    rows = {row["path"]: row for row in json.loads(r.output)}
    assert rows["b"]["readers"] == 1 and rows["a"]["readers"] == 0
    assert dt.datetime.fromisoformat(rows["b"]["last_used"]) > dt.datetime.fromisoformat(rows["a"]["last_used"])
    table = _cli("ls", store).output
    assert "LAST USED" in table and "READERS" in table


@pytest.mark.parametrize(("text", "value"), [("500G", 500 * 10**9), ("1.5T", 1.5e12), ("200GiB", 200 * 2**30),
                                             ("1000", 1000), ("3 MB", 3 * 10**6)])
def test_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("text", "value"), [("30d", 30 * DAY), ("12h", 43200.0), ("90m", 5400.0), ("45", 45.0),
                                             ("2w", 14 * DAY)])
def test_ages(text, value):
    assert parse_age(text) == value


def test_bad_sizes_and_ages_are_usage_errors(tmp_path):
    assert "is not a size" in _cli("gc", tmp_path, "--max-bytes", "lots").output
    assert "is not an age" in _cli("gc", tmp_path, "--older-than", "soon").output


# ---------------------------------------------------------------- an object store and its URL readers

def _s3_store(tmp_path: Path, s3: Any, names: list[str]) -> tuple[str, dict[str, np.ndarray]]:
    store = s3.url("store")
    images = {}
    for name in names:
        root, images[name], _ = make_cache(tmp_path / "local" / name, n=40, shard_size=16, h=16, w=16)
        push(root, f"{store}/{name}", progress=False)
    Store(store).mark()
    return store, images


def test_a_url_reader_holds_a_lease_while_it_reads_and_gc_keeps_its_cache(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_LEASE_S", "2")  # renewed every 0.2 s
    store, images = _s3_store(tmp_path, s3, ["read", "idle"])
    ds = CachedImageDataset(f"{store}/read")
    leases = Store(store).lease_files("read")
    (first,) = leases.values()
    assert first is not None and first.live() and first.what == "reader"
    time.sleep(0.6)
    (again,) = Store(store).lease_files("read").values()
    assert again is not None and again.when() > first.when()  # renewed while it lives
    report = collect(store, max_bytes=0, yes=True)
    assert [e.name for e in report.removed] == ["idle"] and "reader pid" in report.kept["read"]
    assert np.array_equal(ds.gather(np.arange(40)), images["read"])
    assert not s3.fs.exists(s3.url("store/idle/manifest.json")) and s3.fs.find(s3.url("store/idle")) == []
    del ds
    collector.collect()
    assert Store(store).lease_files("read") == {}  # given up, its last use recorded
    assert Store(store).usage("read").last_used is not None
    report = collect(store, max_bytes=0, yes=True)
    assert [e.name for e in report.removed] == ["read"]


def test_a_cache_removed_under_a_reader_is_an_error_there_never_other_pixels(tmp_path, s3, monkeypatch):
    """A reader that hung past its lease: gc takes its cache down, and another cache is published under the same
    name; the reader's next batch is an error, never the new cache's pixels."""
    monkeypatch.setenv("CACHEBUILD_LEASE_S", "1")
    store, images = _s3_store(tmp_path, s3, ["c"])
    ds = CachedImageDataset(f"{store}/c")
    assert np.array_equal(ds.gather(np.arange(16)), images["c"][:16])  # the first shard pinned, others not yet
    assert ds.location.lease is not None
    ds.location.lease._stop.set()  # hangs: no more renewals, no release
    time.sleep(1.3)
    report = collect(store, max_bytes=0, yes=True)
    assert [e.name for e in report.removed] == ["c"]
    other_images = 255 - images["c"]  # another cache of the same layout, other pixels
    write_cache(tmp_path / "other", other_images, np.zeros(40, np.int64), [f"class{k}" for k in range(5)],
                shard_size=16, replace=True)
    push(tmp_path / "other", f"{store}/c", progress=False)
    assert np.array_equal(CachedImageDataset(f"{store}/c").gather(np.arange(40)), other_images)  # published
    for batch in (np.arange(16), np.arange(16, 32), np.arange(40)):
        with pytest.raises((CacheChangedError, RemoteError)):
            got = ds.gather(batch)
            assert not np.array_equal(got, other_images[batch])  # never reached: an error comes first


def test_a_reader_process_gives_its_lease_up_when_it_exits(tmp_path, s3):
    """`cachebuild info` of a store's cache: a reader for a moment, its lease written, then given up at exit (its
    last use recorded), and the process ends at once."""
    import os
    import subprocess
    import sys

    from tests.repo import REPO

    store, _ = _s3_store(tmp_path, s3, ["c"])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cachebuild", "info", f"{store}/c"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **s3.env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and "40 samples" in r.stdout, r.stderr
    assert time.monotonic() - t0 < 30
    assert Store(store).lease_files("c") == {} and Store(store).usage("c").last_used is not None
    puts = [q.path for q in s3.log if q.method == "PUT" and "/.store/" in q.path]
    assert any("/.store/leases/c/" in p for p in puts) and any(p.endswith("/.store/used/c.json") for p in puts)
