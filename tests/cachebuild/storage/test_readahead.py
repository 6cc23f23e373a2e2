"""A sequential read of a URL cache through a block cache fetches the rest of its shard and the next one whole,
in the background; the bytes stay exactly the opened cache's: real servers on 127.0.0.1 (the aiohttp file
server, moto's S3), a shard replaced mid-epoch is refused as without readahead, never served."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheBuildError, CacheChangedError
from cachebuild.storage import BlockCache
from cachebuild.storage.cache import write_cache
from loaders.dataset import CachedImageDataset, DatasetOptions
from tests.loaders_fixtures import make_images

N, SHARD = 128, 32  # 4 shards of 32 rows of 3,072 bytes: 24 blocks of 4 KiB each


def _cache(root, invert: bool = False) -> np.ndarray:
    img = make_images(N, 32, 32)
    img = 255 - img if invert else img
    write_cache(root, img, np.arange(N) % 4, [f"c{k}" for k in range(4)], storage="npy", shard_size=SHARD)
    return img


def _reader(url, tmp_path) -> CachedImageDataset:
    return CachedImageDataset(url, DatasetOptions(local_cache=BlockCache(tmp_path / "blocks", block_bytes=4096)))


def _rows(ds: CachedImageDataset):
    return ds._images.rows  # type: ignore[attr-defined]


def _push(src, url, *flags) -> None:
    r = CliRunner().invoke(main, ["push", str(src), url, "--no-progress", *flags])
    assert r.exit_code == 0, r.output


def test_a_sequential_read_fetches_its_shard_and_the_next_whole_and_no_further(tmp_path, http_server):
    site = tmp_path / "site"
    img = _cache(site / "c")
    ds = _reader(http_server(site).url_for("c"), tmp_path)
    assert np.array_equal(ds.gather(np.arange(0, 8)), img[:8])
    _rows(ds).readahead.wait()
    sizes = [_rows(ds)._name_and_size(k)[1] for k in (0, 1)]
    assert _rows(ds).bytes_fetched == sum(sizes)  # shards 0 and 1 whole (header and rows), each block once
    shutil.rmtree(site / "c")  # from here on the server has none of it: what is served is the block cache's
    assert np.array_equal(ds.gather(np.arange(8, 2 * SHARD)), img[8 : 2 * SHARD])
    with pytest.raises(CacheBuildError, match=r"images-00002\.npy"):  # one shard ahead, not three
        ds.gather(np.arange(2 * SHARD, 2 * SHARD + 4))


def test_shuffled_reads_fetch_only_their_blocks(tmp_path, http_server):
    site = tmp_path / "site"
    img = _cache(site / "c")
    ds = _reader(http_server(site).url_for("c"), tmp_path)
    idx = np.array([70, 3, 40, 9, 100, 33])  # no two consecutive rows of one shard
    assert np.array_equal(ds.gather(idx), img[idx])
    _rows(ds).readahead.wait()
    assert _rows(ds).bytes_fetched <= len(idx) * 2 * 4096  # each row's one or two blocks, nothing ahead


def test_readahead_off_fetches_only_what_is_read(tmp_path, http_server, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_READAHEAD_FILES", "0")
    site = tmp_path / "site"
    img = _cache(site / "c")
    ds = _reader(http_server(site).url_for("c"), tmp_path)
    assert np.array_equal(ds.gather(np.arange(0, 8)), img[:8])
    _rows(ds).readahead.wait()
    assert _rows(ds).bytes_fetched <= 8 * img[0].nbytes + 2 * 4096


def test_a_shard_replaced_mid_epoch_is_refused_never_read_ahead(tmp_path, s3):
    """Shards 0-1 read ahead before ``push --force`` serve the opened cache's bytes; the readahead of shard 2,
    started after it, meets the version pin and keeps nothing, so reading shard 2 is a CacheChangedError."""
    a_img = _cache(tmp_path / "a")
    _cache(tmp_path / "b", invert=True)
    url = s3.url("team/ra")
    _push(tmp_path / "a", url)
    ds = _reader(url, tmp_path)
    assert np.array_equal(ds.gather(np.arange(0, 8)), a_img[:8])
    _rows(ds).readahead.wait()
    _push(tmp_path / "b", url, "--force")
    assert np.array_equal(ds.gather(np.arange(SHARD, 2 * SHARD)), a_img[SHARD : 2 * SHARD])  # read ahead before
    _rows(ds).readahead.wait()  # shard 1's sequential read sent shard 2's readahead: refused by the pin
    with pytest.raises(CacheChangedError, match=r"images-00002\.npy changed since this job opened"):
        ds.gather(np.arange(2 * SHARD, 2 * SHARD + 8))


def test_whole_file_readahead_runs_its_files_at_once_and_keeps_that_across_pickling():
    """A shard-windowed reader's readahead (``read_files_whole()``) fetches several files at once: a first file
    whose fetch waits (a slow server) holds up no other. The second job here releases the first; one thread
    would run them in turn and the first would time out. A pickled copy (a DataLoader worker's) keeps the count."""
    import pickle
    import threading

    from cachebuild.storage.remote.block_cache import WHOLE_FILE_THREADS, Readahead

    ra = Readahead(WHOLE_FILE_THREADS)
    assert pickle.loads(pickle.dumps(ra)).threads == WHOLE_FILE_THREADS >= 2
    released, waited = threading.Event(), []

    def slow() -> int:
        waited.append(released.wait(5))
        return 0

    def fast() -> int:
        released.set()
        return 0

    assert ra.schedule(0, slow, "slow") and ra.schedule(1, fast, "fast")
    ra.wait()
    assert waited == [True]
