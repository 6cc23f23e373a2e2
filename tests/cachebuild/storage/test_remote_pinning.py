"""A job reading a cache from a URL never serves another cache's pixels: after ``push --force`` puts a new cache
at the same URL (same file names, same sizes), the old reader's next fetch is a CacheChangedError naming the
file, never the new bytes. Real servers on 127.0.0.1: moto's S3 (``IfMatch``) and the aiohttp file server."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader

from cachebuild.cli import main
from cachebuild.errors import CacheChangedError
from cachebuild.storage.cache import write_cache
from cachebuild.storage.remote.pinning import etag_of, precondition_failed
from loaders.dataset import CachedImageDataset, collate_batch
from tests.compact_fixtures import jpeg_index_images
from tests.loaders_fixtures import make_images

KINDS = [("npy", "none"), ("zarr", "none"), ("zarr", "zstd"), ("jpeg", "none")]
N = 70


def _pair(tmp_path: Path, storage: str, compression: str) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """Caches A and B: same count, shape and shard names; every pixel of B differs from A's. Returns both
    roots and their pixels as a local reader serves them."""
    a_img = jpeg_index_images(N) if storage == "jpeg" else make_images(N, 16, 12)
    labels = np.arange(N) % 5
    roots = []
    for name, img in (("a", a_img), ("b", 255 - a_img)):
        root = tmp_path / name
        write_cache(root, img, labels, [f"class{k}" for k in range(5)], storage=storage, shard_size=16,
                    compression=compression)
        roots.append(root)
    if storage != "jpeg" and compression == "none":  # raw shards: the replacement is invisible to a size check
        sizes = [[p.stat().st_size for p in sorted(r.rglob("*")) if p.is_file() and "images" in p.as_posix()]
                 for r in roots]
        assert sizes[0] == sizes[1]
    served = [CachedImageDataset(r).gather(np.arange(N)) for r in roots]
    assert not (served[0] == served[1]).all(axis=(1, 2, 3)).any()
    return roots[0], roots[1], served[0], served[1]


def _push(src: Path, url: str, *flags: str) -> None:
    r = CliRunner().invoke(main, ["push", str(src), url, "--no-progress", *flags])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("storage,compression", KINDS)
def test_s3_reader_stops_after_push_force_instead_of_serving_the_new_cache(tmp_path, s3, storage, compression):
    a, b, a_img, b_img = _pair(tmp_path, storage, compression)
    url = s3.url("team/c")
    _push(a, url)
    ds = CachedImageDataset(url)
    assert np.array_equal(ds.gather(np.arange(0, 20)), a_img[:20])
    _push(b, url, "--force")
    for idx in (np.arange(20, 40), np.arange(0, 20)):  # rows never read, and rows read before
        with pytest.raises(CacheChangedError, match=r"images.*changed since this job opened"):
            ds.gather(idx)
    assert np.array_equal(CachedImageDataset(url).gather(np.arange(N)), b_img)  # a new job reads the new cache


def test_s3_reader_pinned_in_forked_dataloader_workers(tmp_path, s3):
    """Each worker's own S3 client carries the IfMatch hook, with the versions taken when the dataset opened."""
    a, b, a_img, _ = _pair(tmp_path, "npy", "none")
    url = s3.url("team/c")
    _push(a, url)
    ds = CachedImageDataset(url)
    dl = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="fork", collate_fn=collate_batch)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in dl]), a_img)
    _push(b, url, "--force")
    with pytest.raises(CacheChangedError, match=r"images-0000\d\.npy changed since this job opened"):
        for _ in dl:
            pass


def test_http_reader_pinned_in_dataloader_workers(tmp_path, http_server):
    """The versions taken when the dataset opened travel into spawned workers with it."""
    a, b, _, _ = _pair(tmp_path, "npy", "none")
    site = tmp_path / "site"
    shutil.copytree(a, site / "c")
    ds = CachedImageDataset(http_server(site).url_for("c"))
    shutil.rmtree(site / "c")
    shutil.copytree(b, site / "c")  # replaced by hand, files written again: new ETags
    # One spawned worker: a second one still starting when the first one's error ends the loop failed its
    # unpickling once the loader had shut down (an unraisable error at teardown, seen under load).
    dl = DataLoader(ds, batch_size=16, num_workers=1, multiprocessing_context="spawn", collate_fn=collate_batch)
    with pytest.raises(CacheChangedError, match=r"images-0000\d\.npy changed since this job opened"):
        for _ in dl:
            pass


@pytest.mark.parametrize("push", ["complete", "under way"])
def test_a_file_first_read_after_the_replacement_is_refused(tmp_path, s3, push):
    """paths.json is read only when asked for: its version is taken then, and the manifest (another one, or
    none while a push --force is under way) says it is not the opened cache's."""
    a, b, _, _ = _pair(tmp_path, "npy", "none")
    url = s3.url("team/c")
    _push(a, url)
    ds = CachedImageDataset(url)
    if push == "complete":
        _push(b, url, "--force")
    else:  # the first step of push --force: the manifest goes; paths.json is still the old cache's
        s3.fs.rm(s3.url("team/c/manifest.json"))
    with pytest.raises(CacheChangedError, match=r"paths\.json changed since this job opened"):
        ds.paths  # noqa: B018 (a property that reads)


def test_an_unchanged_cache_reads_as_before_with_one_version_check_per_file(tmp_path, http_server):
    a, _, a_img, _ = _pair(tmp_path, "npy", "none")
    site = tmp_path / "site"
    shutil.copytree(a, site / "c")
    server = http_server(site)
    ds = CachedImageDataset(server.url_for("c"))
    heads = len(server.log.matching("HEAD"))
    server.log.clear()
    for _ in range(2):
        assert np.array_equal(ds.gather(np.random.default_rng(0).permutation(N)), a_img[np.random.default_rng(0)
                                                                                          .permutation(N)])
    assert not server.log.matching("HEAD") and all(r.status == 206 for r in server.log)
    assert heads <= 2 * (N // 16 + 1) + 8  # taken at open: about one per file, plus the manifest's checks


def test_a_server_without_strong_etags_is_read_unpinned(tmp_path, http_server):
    a, _, a_img, _ = _pair(tmp_path, "npy", "none")
    site = tmp_path / "site"
    shutil.copytree(a, site / "c")
    ds = CachedImageDataset(http_server(site, etags=False).url_for("c"))
    assert ds.location.pins is None and np.array_equal(ds.gather(np.arange(N)), a_img)
    assert etag_of({"ETag": 'W/"5-abc"'}) is None and etag_of({"ETag": '"5-abc"'}) == '"5-abc"'
    assert not precondition_failed(OSError("x")) and precondition_failed(type("E", (Exception,), {"status": 412})())


def test_pinning_can_be_turned_off_for_a_server_that_answers_if_match_wrongly(tmp_path, http_server, monkeypatch):
    a, _, a_img, _ = _pair(tmp_path, "npy", "none")
    site = tmp_path / "site"
    shutil.copytree(a, site / "c")
    url = http_server(site).url_for("c")
    assert CachedImageDataset(url).location.pins is not None
    monkeypatch.setenv("CACHEBUILD_PIN_VERSIONS", "0")  # read when a location is pinned
    ds = CachedImageDataset(url)
    assert ds.location.pins is None and np.array_equal(ds.gather(np.arange(N)), a_img)


def test_a_manifest_missing_when_the_version_is_taken_is_not_a_cache_even_if_it_appears_next(tmp_path, http_server):
    """Found by the reliability row (readers while push --force runs): the manifest was missing for the
    version check (a push under way) and present for the read a moment later, and the reader then read
    unpinned for good. It must say "not a cache" instead (the job retries), never open unpinned."""
    from cachebuild.errors import CacheNotFoundError

    a, _, _, _ = _pair(tmp_path, "npy", "none")
    site = tmp_path / "site"
    shutil.copytree(a, site / "c")
    server = http_server(site)
    url = server.url_for("c")
    # gone for the version check (fsspec asks by HEAD, then by GET), back for the read that follows
    server.fail("c/manifest.json", 404, times=2, methods=("HEAD", "GET"))
    with pytest.raises(CacheNotFoundError, match=r"is not a cachebuild cache \(no manifest\.json\)"):
        CachedImageDataset(url)
    assert CachedImageDataset(url).location.pins is not None


def _versioned(s3) -> None:
    s3.fs.call_s3("put_bucket_versioning", Bucket=s3.name, VersioningConfiguration={"Status": "Enabled"})


@pytest.mark.parametrize("storage,compression", KINDS)
def test_a_reader_of_a_versioned_bucket_reads_its_own_cache_to_the_end_after_push_force(tmp_path, s3, storage,
                                                                                          compression):
    """With versioning the old cache's objects stay as versions: a job that opened it reads them (VersionId
    pinned with each tag), never the new cache's bytes; a file it had not read yet is the named error."""
    _versioned(s3)
    a, b, a_img, b_img = _pair(tmp_path, storage, compression)
    url = s3.url("team/v")
    _push(a, url)
    ds = CachedImageDataset(url)
    assert np.array_equal(ds.gather(np.arange(0, N)), a_img)
    _push(b, url, "--force")
    for idx in (np.arange(N), np.arange(N)[::-1]):
        assert np.array_equal(ds.gather(idx), a_img[idx])
    with pytest.raises(CacheChangedError, match=r"paths\.json changed since this job opened"):
        ds.paths  # noqa: B018 (a property that reads: not read before the replacement)
    assert np.array_equal(CachedImageDataset(url).gather(np.arange(N)), b_img)  # a new job reads the new cache


def test_versioned_reads_travel_into_dataloader_workers(tmp_path, s3):
    _versioned(s3)
    a, b, a_img, _ = _pair(tmp_path, "npy", "none")
    url = s3.url("team/w")
    _push(a, url)
    ds = CachedImageDataset(url)
    _push(b, url, "--force")  # before any worker starts: the versions pinned at open go with the dataset
    dl = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="spawn", collate_fn=collate_batch)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in dl]), a_img)
