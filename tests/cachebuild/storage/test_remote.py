"""Caches read straight from URLs: a real HTTP server and moto's S3 server on 127.0.0.1 (tests/servers.py).

Test caches encode each sample's index in its pixels (tests/loaders_fixtures.py), so a wrong row is seen.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader

from cachebuild.cli import main
from cachebuild.errors import CacheChangedError, CacheCorruptError, CacheNotFoundError, RemoteError
from cachebuild.storage.cache import open_cache
from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import decode_index, make_cache
from tests.manifest_edits import load_unsealed
from tests.same_key import same_key_caches

KINDS = [("npy", "none"), ("zarr", "none"), ("zarr", "zstd")]


def _serve_cache(tmp_path: Path, http_server, storage: str = "npy", compression: str = "none", n: int = 70,
                 h: int = 16, w: int = 12):
    _root, images, labels = make_cache(tmp_path / "site" / "c", n=n, storage=storage, shard_size=16, h=h, w=w,
                                      compression=compression)
    server = http_server(tmp_path / "site")
    return server, server.url_for("c"), images, labels


@pytest.mark.parametrize("storage,compression", KINDS)
def test_http_cache_reads_the_same_bytes_as_the_local_copy(tmp_path, http_server, storage, compression):
    _server, url, images, labels = _serve_cache(tmp_path, http_server, storage, compression)
    ds = CachedImageDataset(url)
    assert len(ds) == 70 and ds.manifest.storage == storage
    idx = np.random.default_rng(0).permutation(70)
    assert np.array_equal(ds.gather(idx), images[idx])
    assert np.array_equal(ds.labels, labels)
    x, y = ds[5]
    assert np.array_equal(x.numpy(), images[5]) and y == labels[5]


@pytest.mark.parametrize("storage,compression", KINDS)
def test_s3_cache_reads_the_same_bytes_through_dataloader_workers(tmp_path, s3, storage, compression):
    root, images, _labels = make_cache(tmp_path / "c", n=70, storage=storage, shard_size=16, h=16, w=12,
                                      compression=compression)
    s3.fs.put(str(root), s3.url("caches/c"), recursive=True)
    ds = CachedImageDataset(s3.url("caches/c"))
    sampler = CacheSampler(ds, shuffle=True, seed=3)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    order = np.fromiter(iter(sampler), dtype=np.int64)
    dl = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=collate_batch)
    got = [x.numpy() for x, _ in dl]
    seen = np.concatenate([decode_index(g) for g in got])
    assert np.array_equal(seen, order)  # every batch in the sampler's order, every pixel of its own sample
    assert np.array_equal(np.concatenate(got), images[order])


def test_http_dataloader_workers_with_spawn(tmp_path, http_server):
    _server, url, images, _ = _serve_cache(tmp_path, http_server, "npy", n=40)
    ds = CachedImageDataset(url)
    dl = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate_batch, multiprocessing_context="spawn")
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in dl]), images)


def test_ddp_ranks_read_disjoint_shards_of_a_url_cache(tmp_path, http_server):
    _server, url, _images, _ = _serve_cache(tmp_path, http_server, "npy", n=50)
    ds = CachedImageDataset(url)
    seen = []
    for rank in range(2):
        sampler = CacheSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=1)
        batch = np.fromiter(iter(sampler), dtype=np.int64)
        assert np.array_equal(decode_index(ds.gather(batch)), batch)
        seen.append(set(batch.tolist()))
    assert seen[0] | seen[1] == set(range(50))


def test_cold_reads_fetch_only_the_rows_a_batch_needs(tmp_path, http_server):
    server, url, images, _ = _serve_cache(tmp_path, http_server, "npy", n=64, h=32, w=32)
    ds = CachedImageDataset(url)
    server.clear()
    idx = np.random.default_rng(1).choice(64, 20, replace=False)
    assert np.array_equal(ds.gather(idx), images[idx])
    needed = 20 * ds.manifest.sample_nbytes
    assert needed <= server.log.bytes() <= 1.2 * needed
    assert ds.bytes_fetched == needed


def test_block_cache_serves_epoch_two_from_local_disk(tmp_path, http_server):
    server, url, images, _ = _serve_cache(tmp_path, http_server, "npy", n=64, h=32, w=32)
    local = tmp_path / "blocks"
    ds = CachedImageDataset(url, DatasetOptions(local_cache=local))
    dl = DataLoader(ds, batch_size=16, sampler=CacheSampler(ds, shuffle=True, seed=0), num_workers=2,
                    collate_fn=collate_batch, persistent_workers=False)
    server.clear()
    first = [x.numpy().copy() for x, _ in dl]
    fetched = server.log.bytes()
    assert fetched >= images.nbytes  # every block, once
    server.clear()
    second = [x.numpy().copy() for x, _ in dl]
    assert server.log.bytes() == 0  # the second epoch (new workers, other order) reads local disk only
    assert np.array_equal(np.sort(decode_index(np.concatenate(second))), np.arange(64))
    assert all(np.array_equal(b, images[decode_index(b)]) for b in first + second)


def test_block_cache_refetches_a_damaged_block(tmp_path, http_server):
    server, url, images, _ = _serve_cache(tmp_path, http_server, "npy", n=64, h=32, w=32)
    local = tmp_path / "blocks"
    ds = CachedImageDataset(url, DatasetOptions(local_cache=local))
    assert np.array_equal(ds.gather(np.arange(64)), images)
    for data in local.glob("*/*.data"):  # flip a byte of every mirrored file, behind the cache's back
        with open(data, "r+b") as f:
            f.seek(200)
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 0xFF]))
    server.clear()
    fresh = CachedImageDataset(url, DatasetOptions(local_cache=local))  # a new process would see the same files
    assert np.array_equal(fresh.gather(np.arange(64)), images)
    assert server.log.bytes() > 0  # the damaged blocks were fetched again


def test_block_cache_stays_within_its_bound(tmp_path, http_server):
    from cachebuild.storage import BlockCache

    _server, url, images, _ = _serve_cache(tmp_path, http_server, "npy", n=96, h=64, w=64)  # 1.2 MB
    cache = BlockCache(tmp_path / "blocks", max_bytes=256 << 10, block_bytes=16 << 10)
    ds = CachedImageDataset(url, DatasetOptions(local_cache=cache))
    for lo in range(0, 96, 8):
        assert np.array_equal(ds.gather(np.arange(lo, lo + 8)), images[lo : lo + 8])
    cache.evict()
    assert cache.usage() <= cache.max_bytes


def test_info_and_verify_work_on_a_url(tmp_path, http_server):
    _server, url, _images, _ = _serve_cache(tmp_path, http_server, "zarr", "zstd")
    runner = CliRunner()
    r = runner.invoke(main, ["info", url])
    assert r.exit_code == 0 and "70 samples" in r.output and "zarr" in r.output
    r = runner.invoke(main, ["verify", url])
    assert r.exit_code == 0 and "ok" in r.output
    chunk = tmp_path / "site" / "c" / "images.zarr" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r = runner.invoke(main, ["verify", url])
    assert r.exit_code == 1 and "c/1/0/0/0" in r.output


def test_a_url_that_404s_is_one_line_naming_it(tmp_path, http_server):
    server = http_server(tmp_path)
    with pytest.raises(CacheNotFoundError, match=r"nothing-here.*not a cachebuild cache"):
        CachedImageDataset(server.url_for("nothing-here"))
    r = CliRunner().invoke(main, ["info", server.url_for("nothing-here")])
    assert r.exit_code == 1 and "Traceback" not in r.output and "nothing-here" in r.output


def test_403_names_the_url_and_never_the_credentials(tmp_path, http_server):
    server, url, _, _ = _serve_cache(tmp_path, http_server)
    server.fail("c/manifest.json", 403, times=None)
    secret_url = url.replace("http://", "http://alice:s3cr3t@") + "?X-Amz-Signature=deadbeef"
    with pytest.raises(RemoteError) as e:
        CachedImageDataset(url.replace("http://", "http://alice:s3cr3t@"))
    assert "access denied" in str(e.value) and "s3cr3t" not in str(e.value) and "alice" not in str(e.value)
    from cachebuild.storage import redact

    assert "s3cr3t" not in redact(secret_url) and "deadbeef" not in redact(secret_url)


def test_dropped_connections_are_retried(tmp_path, http_server, monkeypatch):
    server, url, images, _ = _serve_cache(tmp_path, http_server)
    ds = CachedImageDataset(url)
    server.fail("c/images-00001.npy", "drop", times=2)  # twice cut mid-body, then whole
    assert np.array_equal(ds.gather(np.arange(16, 32)), images[16:32])
    monkeypatch.setenv("CACHEBUILD_RETRIES", "3")  # read at each call: the failing case below stays short
    server.fail("c/images-00002.npy", "drop", times=None)  # always cut: a clear error after the retries
    with pytest.raises(RemoteError, match=r"images-00002\.npy.*after \d+ attempts"):
        ds.gather(np.arange(32, 40))


def test_a_server_error_is_retried(tmp_path, http_server):
    server, url, images, _ = _serve_cache(tmp_path, http_server)
    ds = CachedImageDataset(url)
    server.fail("c/images-00003.npy", 503, times=2)
    assert np.array_equal(ds.gather(np.arange(48, 60)), images[48:60])


@pytest.mark.parametrize("etags", [True, False])
def test_a_truncated_remote_shard_is_named(tmp_path, http_server, etags):
    """Cut after the dataset was opened: a server with ETags says the file is another version than the one
    opened (If-Match); without them, the short read names the truncation."""
    make_cache(tmp_path / "site" / "c", n=70, shard_size=16, h=16, w=12)
    url = http_server(tmp_path / "site", etags=etags).url_for("c")
    ds = CachedImageDataset(url)
    shard = tmp_path / "site" / "c" / "images-00002.npy"
    shard.write_bytes(shard.read_bytes()[:-1000])
    error, says = (CacheChangedError, "changed since this job opened") if etags else (CacheCorruptError, "shorter")
    with pytest.raises(error, match=rf"images-00002\.npy.*{says}"):
        ds.gather(np.arange(32, 48))


@pytest.mark.parametrize("bad", ["../outside.npy", "/etc/passwd", "http://127.0.0.1:1/x.npy", "a/../../b.npy"])
def test_manifest_names_outside_the_cache_are_refused_before_anything_is_opened(tmp_path, http_server, bad):
    server, url, _, _ = _serve_cache(tmp_path, http_server)
    shutil.copy(tmp_path / "site" / "c" / "images-00000.npy", tmp_path / "site" / "outside.npy")
    m = load_unsealed(tmp_path / "site" / "c" / "manifest.json")
    m["shards"][0]["file"] = bad
    (tmp_path / "site" / "c" / "manifest.json").write_text(json.dumps(m))
    server.clear()
    for where in (url, tmp_path / "site" / "c"):
        with pytest.raises(CacheCorruptError, match="not a plain relative name inside the cache"):
            CachedImageDataset(where)
    assert server.log.paths() == ["/c/manifest.json"]  # nothing but the manifest was requested


def test_a_missing_remote_zarr_chunk_is_named(tmp_path, http_server):
    _server, url, _, _ = _serve_cache(tmp_path, http_server, "zarr", "zstd")
    ds = CachedImageDataset(url)  # opened while the chunk was there
    (tmp_path / "site" / "c" / "images.zarr" / "c" / "0" / "0" / "0" / "0").unlink()
    with pytest.raises(CacheCorruptError, match=r"c/0/0/0/0.*missing"):
        ds.gather(np.arange(3))
    with pytest.raises(CacheCorruptError, match=r"c/0/0/0/0.*missing"):
        CachedImageDataset(url)  # the listing shows it gone


def test_open_cache_reports_remote_reads(tmp_path, s3):
    root, images, _ = make_cache(tmp_path / "c", n=30, storage="npy", shard_size=16)
    s3.fs.put(str(root), s3.url("x"), recursive=True)
    reader = open_cache(s3.url("x"))
    assert reader.verify() == [] and np.array_equal(reader.gather([3, 1, 29]), images[[3, 1, 29]])


@pytest.mark.parametrize("where", ["http", "s3"])
def test_a_class_folder_tree_at_a_url_builds_the_same_cache_as_its_local_copy(tmp_path, imagenet_clean, where,
                                                                              request):
    train = Path(imagenet_clean["train_dir"])
    local = tmp_path / "local"
    r = CliRunner().invoke(main, ["folder", str(train), "--size", "32", "--jobs", "1", "--out", str(local)])
    assert r.exit_code == 0, r.output
    if where == "http":
        site = tmp_path / "site"
        shutil.copytree(train, site / "train")
        url = request.getfixturevalue("http_server")(site).url_for("train")
    else:
        s3 = request.getfixturevalue("s3")
        s3.fs.put(str(train), s3.url("data/train"), recursive=True)
        url = s3.url("data/train")
    remote = tmp_path / "remote"
    r = CliRunner().invoke(main, ["folder", url, "--size", "32", "--jobs", "2", "--out", str(remote)])
    assert r.exit_code == 0, r.output
    a, b = open_cache(local / "train"), open_cache(remote / "train")
    assert b.manifest.source["root"].startswith(("http://", "s3://"))
    assert a.paths() == b.paths() and np.array_equal(a.labels, b.labels) and a.manifest.classes == b.manifest.classes
    assert np.array_equal(a.gather(np.arange(len(a))), b.gather(np.arange(len(b))))
    r = CliRunner().invoke(main, ["folder", url, "--size", "32", "--jobs", "1", "--out", str(remote)])
    assert "up to date" in r.output  # the listing's sizes and ETags/mtimes fingerprint the source


def test_eviction_removes_what_killed_writers_left(tmp_path):
    """A block-cache object whose writer died before its rename is never finished by anyone: eviction
    deletes it once it is stale, and leaves a fresh one (a writer may still be at work) alone."""
    import os

    from cachebuild.storage import BlockCache

    cache = BlockCache(tmp_path / "blocks", max_bytes=1 << 20, block_bytes=4096)
    cache.store_object(BlockCache.key("a"), b"x" * 100)
    sub = next(p for p in (tmp_path / "blocks").iterdir() if p.is_dir())
    stale, fresh = sub / ".abc.obj.123.deadbeef.tmp", sub / ".abd.obj.124.cafebabe.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (1, 1))
    cache.evict()
    assert not stale.exists() and fresh.exists()
    assert cache.lookup_object(BlockCache.key("a")) == b"x" * 100


@pytest.mark.parametrize("flags", [[], ["--format", "zarr", "--compression", "zstd"]], ids=["npy", "zarr-zstd"])
def test_block_cache_never_serves_an_earlier_cache_of_the_same_build_key(tmp_path, http_server, flags):
    a, b = same_key_caches(tmp_path, flags)
    pixels_a, pixels_b = (CachedImageDataset(c).gather(np.arange(12)) for c in (a, b))
    site = tmp_path / "site"
    shutil.copytree(a, site / "c")
    url, local = http_server(site).url_for("c"), tmp_path / "blocks"
    assert np.array_equal(CachedImageDataset(url, DatasetOptions(local_cache=local)).gather(np.arange(12)), pixels_a)
    shutil.rmtree(site / "c")
    shutil.copytree(b, site / "c")  # rebuilt in place, or pushed with --force
    assert np.array_equal(CachedImageDataset(url, DatasetOptions(local_cache=local)).gather(np.arange(12)), pixels_b)


def test_s3_locations_parse_botocore_models_once_per_process(tmp_path, s3, monkeypatch):
    """Each location has a session of its own (its pins' hooks), but botocore's JSON (endpoints, S3's API) is
    parsed once: a fresh session per filesystem cost 0.18 s of CPU each, every cache opened, every worker."""
    import botocore.loaders

    from cachebuild.storage.locations.url import FsspecLocation

    root, images, _ = make_cache(tmp_path / "c", n=20, shard_size=8, h=8, w=8)
    s3.fs.put(str(root), s3.url("caches/c"), recursive=True)
    assert np.array_equal(open_cache(s3.url("caches/c")).gather(np.arange(20)), images)  # models loaded by now
    parsed: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file
    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file",
                        lambda self, path: parsed.append(path) or real(self, path))
    locations = [FsspecLocation(s3.url("caches/c")) for _ in range(2)]
    assert [loc.read_bytes("manifest.json") for loc in locations] == [(root / "manifest.json").read_bytes()] * 2
    assert locations[0].fs.session is not locations[1].fs.session
    assert parsed == []


def test_a_fork_collects_the_filesystems_of_dropped_locations_first(tmp_path, http_server):
    """fsspec's filesystems are reference cycles whose finalizer closes their session through the parent's event
    loop: one dropped but not yet collected when a DataLoader worker forks would be finalized in the worker,
    against a loop nothing runs there (1 s each, measured as a 5 s stall of a cold epoch). A fork after a
    location was dropped collects first, in the parent: the dropped filesystems are gone once it forked."""
    import gc
    import weakref

    from cachebuild.storage.locations.url import FsspecLocation

    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 16)
    server = http_server(tmp_path)
    gc.disable()  # no automatic collection between the drop and the fork
    try:
        dropped = []
        for _ in range(3):  # each with a session (opened by a read), then dropped
            loc = FsspecLocation(server.url_for(""))
            assert loc.read_many([("f.bin", [(0, 8)])]) == [[bytes(range(8))]]
            dropped.append(weakref.ref(loc.fs))
            del loc
        assert all(r() is not None for r in dropped)  # cyclic garbage: only a collection frees them
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert all(r() is None for r in dropped)
    finally:
        gc.enable()
