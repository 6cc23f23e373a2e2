"""Compact (jpeg) caches read straight from URLs: the loopback HTTP and S3 servers of tests/servers.py.

Samples carry their index in JPEG-proof blocks (tests/compact_fixtures.py), so a wrong sample is seen.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader

from cachebuild.cli import main
from cachebuild.errors import CacheCorruptError
from cachebuild.storage.cache import open_cache, read_manifest
from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.sampler import CacheSampler
from tests.compact_fixtures import jpeg_index_cache, read_index


def _serve(tmp_path, http_server, n: int = 70):
    root, images, _labels = jpeg_index_cache(tmp_path / "site" / "c", n=n)
    server = http_server(tmp_path / "site")
    return server, server.url_for("c"), root, images


@pytest.mark.parametrize("local_cache", [False, True])
def test_http_jpeg_cache_reads_the_same_pixels_as_the_local_copy(tmp_path, http_server, local_cache):
    server, url, root, _images = _serve(tmp_path, http_server)
    ds = CachedImageDataset(url, DatasetOptions(local_cache=tmp_path / "blocks" if local_cache else None))
    local = CachedImageDataset(root)
    idx = np.random.default_rng(0).permutation(70)
    assert np.array_equal(ds.gather(idx), local.gather(idx))
    assert np.array_equal(read_index(ds.gather(idx)), idx)
    server.clear()
    again = ds.gather(idx[:20])
    assert np.array_equal(read_index(again), idx[:20])
    if local_cache:
        assert server.log.bytes() == 0  # the second read comes from the local block cache


def test_cold_reads_fetch_only_the_samples_a_batch_needs(tmp_path, http_server):
    server, url, _root, _images = _serve(tmp_path, http_server)
    ds = CachedImageDataset(url)
    files = ds._images.files
    server.clear()
    idx = np.array([5, 6, 7, 40, 3, 66])  # 5-7 are stored back to back: one range
    assert np.array_equal(read_index(ds.gather(idx)), idx)
    needed = int((files.end[idx] - files.begin[idx]).sum())
    assert ds.bytes_fetched == needed and needed <= server.log.bytes() <= needed + 4 * 1024
    assert len(server.log.matching("GET")) == 4  # 4 ranges: [5, 8), 40, 3, 66


def test_s3_jpeg_cache_through_dataloader_workers(tmp_path, s3):
    root, images, labels = jpeg_index_cache(tmp_path / "c", n=70)
    s3.fs.put(str(root), s3.url("caches/c"), recursive=True)
    ds = CachedImageDataset(s3.url("caches/c"))
    sampler = CacheSampler(ds, shuffle=True, seed=3)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    order = np.fromiter(iter(sampler), dtype=np.int64)
    dl = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=collate_batch)
    got = [(x.numpy().copy(), y.numpy()) for x, y in dl]
    x = np.concatenate([g[0] for g in got])
    assert np.array_equal(read_index(x), order) and np.array_equal(x, images[order])
    assert np.array_equal(np.concatenate([g[1] for g in got]), labels[order])
    assert open_cache(s3.url("caches/c")).verify() == []


def test_verify_a_url_names_a_damaged_sample(tmp_path, http_server):
    _server, url, root, _images = _serve(tmp_path, http_server)
    runner = CliRunner()
    r = runner.invoke(main, ["verify", url])
    assert r.exit_code == 0 and "ok (70 samples" in r.output
    s = read_manifest(root).shards[1]
    data = bytearray((root / s.file).read_bytes())
    data[-200] ^= 0xFF  # inside the last sample's JPEG
    (root / s.file).write_bytes(bytes(data))
    r = runner.invoke(main, ["verify", url])
    assert r.exit_code == 1 and f"{s.file} samples [16, 32): checksum mismatch (samples 31 fail" in r.output
    with pytest.raises(CacheCorruptError, match=r"sample 31 \(sample-31\) of http://127\.0\.0\.1:\d+/.*images-00001\.jpegs"):
        CachedImageDataset(url, DatasetOptions(local_cache=tmp_path / "blocks")).gather([30, 31])
