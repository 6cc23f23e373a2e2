"""The on-disk contract: manifest round trip, version refusal, damaged files named when opened."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import xxhash

from cachebuild.errors import CacheCorruptError, CacheNotFoundError, UnsupportedFormatError
from cachebuild.format import FORMAT_VERSION, Manifest
from cachebuild.storage.cache import open_cache, read_manifest, write_cache
from cachebuild.storage.kinds.npy import shrink_npy_shard
from tests.legacy_caches import as_sha256_cache
from tests.manifest_edits import load_unsealed


def _images(n: int, side: int = 8) -> np.ndarray:
    # Every image encodes its own index, so any misplaced sample shows.
    idx = np.arange(n, dtype=np.int64)
    return np.broadcast_to((idx % 251).astype(np.uint8)[:, None, None, None], (n, side, side, 3)).copy()


@pytest.fixture
def cache(tmp_path):
    write_cache(tmp_path / "c", _images(37), np.arange(37) % 4, ["a", "b", "c", "d"], shard_size=10)
    return tmp_path / "c"


def test_manifest_round_trip(cache):
    m = read_manifest(cache)
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert [s.count for s in m.shards] == [10, 10, 10, 7]
    head = list(m.to_dict())[:4]
    assert head == ["format", "format_version", "dataset", "split"]


@pytest.mark.parametrize("storage", ["npy", "zarr"])
def test_gather_returns_the_right_samples(tmp_path, storage):
    write_cache(tmp_path / "c", _images(37), np.arange(37) % 4, list("abcd"), shard_size=10, storage=storage)
    c = open_cache(tmp_path / "c")
    idx = np.array([36, 0, 9, 10, 10, 25, 3])
    assert np.array_equal(c.gather(idx)[:, 0, 0, 0], idx % 251)
    assert c.gather([]).shape == (0, 8, 8, 3)
    with pytest.raises(IndexError):
        c.gather([37])
    assert c.verify() == []


def test_unknown_version_is_refused_by_name(cache):
    path = cache / "manifest.json"
    d = load_unsealed(path)
    d["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(d))
    with pytest.raises(UnsupportedFormatError) as e:
        read_manifest(cache)
    assert f"version {FORMAT_VERSION + 1}" in str(e.value) and "reads versions 1, 2, 3, 4" in str(e.value)
    d["format"] = "ffcv"
    path.write_text(json.dumps(d))
    with pytest.raises(UnsupportedFormatError, match="not a cachebuild manifest"):
        read_manifest(cache)


def _file_digest(path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


@pytest.mark.parametrize("storage", ["npy", "jpeg"])
def test_shard_checksums_are_the_files_own_and_the_file_table_reuses_them(imagenet_tree, tmp_path, storage):
    """Since format 2 a build hashes each npy shard byte once, as it writes it: the manifest's shard
    digest (xxh3-128 since format 4) is the file's, header included (jpeg: already so), even for shards shrunk
    after broken files, and files.json takes it instead of hashing again. Every digest must be the file's real one."""
    from cachebuild.builder.pipeline import BuildOptions, build
    from cachebuild.sources.imagenet import imagenet_plans

    (plan,) = imagenet_plans(imagenet_tree["root"], "train")
    opts = BuildOptions(size=32, jobs=2, storage=storage, block_size=8, progress=False)
    m = build(plan, tmp_path / "c", opts)
    man = read_manifest(tmp_path / "c")
    assert man.format_version == FORMAT_VERSION == 4 and man.digest_algorithm == "xxh3-128" and man.failures
    assert any(s.count < 8 for s in man.shards)
    for s in man.shards:
        assert _file_digest(tmp_path / "c" / s.file) == s.digest
    table = json.loads((tmp_path / "c" / "files.json").read_text())["files"]
    assert {name: sha for name, _, sha in table} == {
        p.relative_to(tmp_path / "c").as_posix(): _file_digest(p)
        for p in (tmp_path / "c").rglob("*") if p.is_file() and p.name not in ("manifest.json", "files.json")}
    assert open_cache(tmp_path / "c").verify() == [] and m.count == man.count


def test_a_byte_outside_the_pixels_is_caught_by_verify(cache):
    """The shard checksum covers the header too: a changed padding byte (the shard still opens and
    serves the same pixels) is a mismatch, as it would be for a pull checking the file."""
    shard = cache / "images-00002.npy"
    data = bytearray(shard.read_bytes())
    pad = data.index(b" \n")
    data[pad] = ord("\t")
    shard.write_bytes(bytes(data))
    c = open_cache(cache)
    assert np.array_equal(c.gather([20])[:, 0, 0, 0], [20])
    assert c.verify() == ["images-00002.npy samples [20, 30): checksum mismatch"]


def test_version_1_caches_still_read_and_verify(cache):
    """Format 1 kept the sha256 of an npy shard's pixel rows: such caches open, serve and verify with
    that meaning, and a flipped pixel is still named."""
    as_sha256_cache(cache, 1)
    assert json.loads((cache / "manifest.json").read_text())["shards"][0]["sha256"] == hashlib.sha256(
        np.load(cache / "images-00000.npy")).hexdigest()
    c = open_cache(cache)
    assert c.manifest.format_version == 1 and c.verify() == []
    assert np.array_equal(c.gather([36, 5])[:, 0, 0, 0], [36, 5])
    shard = cache / "images-00003.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert c.verify() == ["images-00003.npy samples [30, 37): checksum mismatch"]


def test_not_a_cache_and_a_parent_of_caches(tmp_path, cache):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CacheNotFoundError, match="not a cachebuild cache"):
        open_cache(tmp_path / "nothing")
    with pytest.raises(CacheNotFoundError, match="gone does not exist"):
        open_cache(tmp_path / "gone")
    with pytest.raises(CacheNotFoundError, match="pass one of them"):
        open_cache(tmp_path)  # holds the cache 'c'


def test_missing_truncated_and_misshapen_shards(cache):
    shard = cache / "images-00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheCorruptError, match=r"images-00001\.npy"):
        open_cache(cache)
    np.save(shard, np.zeros((10, 8, 9, 3), np.uint8))
    with pytest.raises(CacheCorruptError, match="manifest says uint8"):
        open_cache(cache)
    shard.unlink()
    with pytest.raises(CacheCorruptError, match="missing"):
        open_cache(cache)


def test_manifest_fields_are_validated(cache):
    path = cache / "manifest.json"
    d = load_unsealed(path)
    for field, value, message in [("count", 36, "manifest count"), ("storage", "tar", "storage"),
                                  ("shape", [8, 8, 4], "shape"), ("count", -1, "count")]:
        bad = dict(d, **{field: value})
        path.write_text(json.dumps(bad))
        with pytest.raises(CacheCorruptError, match=message):
            read_manifest(cache)
    del d["classes"]
    path.write_text(json.dumps(d))
    with pytest.raises(CacheCorruptError, match="classes"):
        read_manifest(cache)


@pytest.mark.parametrize("capacity,count", [(1024, 1021), (1000, 999), (10, 3), (100000, 9), (5, 0)])
def test_shrinking_a_shard_keeps_its_rows(tmp_path, capacity, count):
    path = tmp_path / "s.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(capacity, 2, 2, 3))
    mm[:] = (np.arange(capacity) % 251).astype(np.uint8)[:, None, None, None]
    mm.flush()
    del mm
    shrink_npy_shard(path, count)
    a = np.load(path)
    assert a.shape == (count, 2, 2, 3) and np.array_equal(a[:, 0, 0, 0], np.arange(count) % 251)
