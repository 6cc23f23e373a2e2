"""CachedImageDataset: identity of every sample through DataLoader paths, bad caches, in-RAM mode, memory."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachebuild.errors import CacheCorruptError, CacheNotFoundError, UnsupportedFormatError
from loaders.dataset import CacheBatch, CachedImageDataset, DatasetOptions, collate_batch
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import decode_index, make_cache
from tests.manifest_edits import load_unsealed
from tests.repo import REPO

STORAGES = [("npy", "none"), ("zarr", "none"), ("zarr", "zstd")]  # zstd: through the zarr API


@pytest.fixture(scope="module", params=STORAGES, ids=lambda p: "-".join(p))
def cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    storage, compression = request.param
    root = tmp_path_factory.mktemp("cache") / "c"
    return make_cache(root, n=53, storage=storage, shard_size=16, compression=compression)


def test_metadata_and_items(cache) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    assert len(ds) == 53 and ds.shape == (8, 6, 3)
    assert ds.classes == tuple(f"class{k}" for k in range(5))
    assert ds.targets == labels.tolist() and ds.manifest.count == 53
    assert ds.paths[3] == "sample-3"
    for i in (0, 15, 16, 52, -1):
        img, label = ds[i]
        assert img.dtype == torch.uint8 and img.shape == (8, 6, 3)
        assert np.array_equal(img.numpy(), images[i]) and label == labels[i]
    with pytest.raises(IndexError):
        ds[53]
    with pytest.raises(IndexError):
        ds.__getitems__([0, 99])


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_equal_cache(cache, workers: int) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    sampler = CacheSampler(ds, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers, collate_fn=collate_batch)
    order = sampler.rank_indices()
    xs, ys = zip(*dl, strict=True)
    x, y = torch.cat(xs).numpy(), torch.cat(ys).numpy()
    assert all(t.dtype == torch.uint8 and t.ndim == 4 for t in xs) and ys[0].dtype == torch.int64
    assert x.tobytes() == images[order].tobytes()  # byte for byte, in the sampler's order
    assert np.array_equal(decode_index(x), order) and np.array_equal(y, labels[order])


def test_default_collate_still_correct(cache) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    x, y = next(iter(DataLoader(ds, batch_size=10, shuffle=False)))
    assert np.array_equal(x.numpy(), images[:10]) and np.array_equal(y.numpy(), labels[:10])


def test_raw_zarr_chunks_differ_from_shards(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "z", n=150, storage="zarr", shard_size=100)  # zarr chunk 64
    ds = CachedImageDataset(root)
    assert ds._images.layout.raw and ds.chunk_size == 64  # uncompressed chunks: read as memory-mapped rows
    idx = np.random.default_rng(0).permutation(150)
    assert np.array_equal(ds.gather(idx), images[idx])


def test_getitems_is_one_batch(cache) -> None:
    root, images, _ = cache
    ds = CachedImageDataset(root)
    b = ds.__getitems__([40, 2, 17, 2])
    assert isinstance(b, CacheBatch) and len(b) == 4
    x, _y = collate_batch(b)
    assert x.shape == (4, 8, 6, 3) and np.array_equal(x.numpy(), images[[40, 2, 17, 2]])


def test_boxes(tmp_path: Path) -> None:
    root, _images, _ = make_cache(tmp_path / "c", n=20, boxes=True)
    ds = CachedImageDataset(root, DatasetOptions(return_boxes=True))
    _img, _label, box = ds[4]
    assert box.tolist() == [0, 0, 8, 5]
    _x, _y, b = collate_batch(ds.__getitems__([1, 4]))
    assert b.tolist() == [[1, 0, 8, 5], [0, 0, 8, 5]]
    plain, _, _ = make_cache(tmp_path / "p", n=5)
    whole = CachedImageDataset(plain, DatasetOptions(return_boxes=True))
    assert whole[0][2].tolist() == [0, 0, 8, 6]  # the whole image is valid


def test_transform_per_sample(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=12)
    ds = CachedImageDataset(root, DatasetOptions(transform=lambda t: t.permute(2, 0, 1).float() / 255))
    x, _ = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate_batch)))
    assert x.shape == (4, 3, 8, 6) and torch.allclose(x[1], torch.from_numpy(images[1]).permute(2, 0, 1) / 255)


def test_pickles_cheaply_without_open_files(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=40)
    ds = CachedImageDataset(root)
    assert ds._images.rows._handles is None  # the constructor leaves no shard mapped
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    clone = pickle.loads(blob)
    assert clone._images.rows._handles is None and np.array_equal(clone[7][0].numpy(), images[7])


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(("field", "bad", "message"), [
    ("decode", "gpu", "decode must be 'cpu' or 'none'"),
    ("decode_threads", 0, "decode_threads must be >= 1"),
    ("in_memory", "yes", "in_memory must be True, False or 'auto'"),
    ("ring_slots", -1, "ring_slots must be in 0.."),
    ("flip", 1.5, "flip must be a bool or a probability"),
    ("flip", True, "flip needs crop=RandomResizedCrop"),
])
def test_options_refuse_bad_values_when_made(field: str, bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):  # before any cache is opened: no root involved
        DatasetOptions(**{field: bad})  # type: ignore[arg-type]


def test_one_options_value_opens_caches_alike(tmp_path: Path) -> None:
    (a, images_a, _), (b, images_b, _) = make_cache(tmp_path / "a", n=9), make_cache(tmp_path / "b", n=5, h=10)
    options = DatasetOptions(in_memory=True, return_boxes=True, ring_slots=2)
    for root, images in ((a, images_a), (b, images_b)):
        ds = CachedImageDataset(root, options)
        assert ds.in_memory and ds.return_boxes and ds.ring_slots == 2
        assert np.array_equal(ds.gather(np.arange(len(images))), images) and len(ds[0]) == 3
    with pytest.raises(AttributeError):
        options.in_memory = False  # type: ignore[misc]  # frozen: a value shared by datasets stays what it was
    with pytest.raises(TypeError, match=r"must be a loaders\.dataset\.DatasetOptions, got dict"):
        CachedImageDataset(a, {"in_memory": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="in_memory"):
        CachedImageDataset(a, in_memory=True)  # type: ignore[call-arg]  # the settings are the options' fields


# ---------------------------------------------------------------- bad input: named errors at open


def _rewrite_manifest(root: Path, **changes) -> None:
    m = load_unsealed(root / "manifest.json")
    m.update(changes)
    (root / "manifest.json").write_text(json.dumps(m))


def test_not_a_cache(tmp_path: Path) -> None:
    with pytest.raises(CacheNotFoundError, match="not a cachebuild cache"):
        CachedImageDataset(tmp_path)


def test_missing_shard(tmp_path: Path) -> None:
    root, _, _ = make_cache(tmp_path / "c")
    (root / "images-00001.npy").unlink()
    with pytest.raises(CacheCorruptError, match="missing"):
        CachedImageDataset(root)


def test_truncated_shard(tmp_path: Path) -> None:
    root, _, _ = make_cache(tmp_path / "c")
    p = root / "images-00002.npy"
    p.write_bytes(p.read_bytes()[:300])
    with pytest.raises(CacheCorruptError, match="truncated"):
        CachedImageDataset(root)


def test_truncated_raw_zarr_chunk(tmp_path: Path) -> None:
    root, _, _ = make_cache(tmp_path / "c", storage="zarr")
    chunk = root / "images.zarr" / "c" / "0" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(CacheCorruptError, match="zarr chunk"):
        CachedImageDataset(root)


def test_unknown_format_version(tmp_path: Path) -> None:
    root, _, _ = make_cache(tmp_path / "c")
    _rewrite_manifest(root, format_version=99)
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        CachedImageDataset(root)


def test_shard_shape_disagrees(tmp_path: Path) -> None:
    root, _, _ = make_cache(tmp_path / "c")
    np.save(root / "images-00000.npy", np.zeros((16, 8, 7, 3), np.uint8))
    with pytest.raises(CacheCorruptError, match="the manifest says"):
        CachedImageDataset(root)


# ---------------------------------------------------------------- in-RAM mode


@pytest.mark.parametrize("storage", ["npy", "zarr"])
def test_in_memory_equal_and_auto(tmp_path: Path, storage: str) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=30, storage=storage)
    ds = CachedImageDataset(root, DatasetOptions(in_memory=True))
    assert ds.in_memory and ds._shared.is_shared()
    x, _ = collate_batch(ds.__getitems__([29, 0, 5]))
    assert np.array_equal(x.numpy(), images[[29, 0, 5]])
    assert CachedImageDataset(root, DatasetOptions(in_memory="auto", memory_budget=ds.nbytes)).in_memory
    assert not CachedImageDataset(root, DatasetOptions(in_memory="auto", memory_budget=ds.nbytes - 1)).in_memory
    with pytest.raises(ValueError, match="in_memory"):
        CachedImageDataset(root, DatasetOptions(in_memory="yes"))


def _poke(ds: CachedImageDataset, queue) -> None:  # runs in the child process
    ds._shared[3, 0, 0, 0] = 77  # written through the shared mapping: the parent must see it
    queue.put(int(ds._shared[4, 0, 0, 0]))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_in_memory_shared_not_copied(tmp_path: Path, method: str) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=10)
    ds = CachedImageDataset(root, DatasetOptions(in_memory=True))
    ctx = torch.multiprocessing.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_poke, args=(ds, q))
    p.start()
    got = q.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0 and got == images[4, 0, 0, 0]
    assert int(ds._shared[3, 0, 0, 0]) == 77  # same pages, not a per-process copy


def test_in_memory_dataloader_workers(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=40)
    ds = CachedImageDataset(root, DatasetOptions(in_memory=True))
    dl = DataLoader(ds, batch_size=7, num_workers=2, collate_fn=collate_batch)
    assert np.array_equal(torch.cat([x for x, _ in dl]).numpy(), images)


# ---------------------------------------------------------------- memory: mapped pages are page cache, not heap

_RSS_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch
    from torch.utils.data import DataLoader
    from loaders.dataset import CachedImageDataset, collate_batch
    from loaders.sampler import CacheSampler

    def rss(kind):
        for line in open("/proc/self/status"):
            if line.startswith(kind):
                return int(line.split()[1]) * 1024
    ds = CachedImageDataset(sys.argv[1])
    dl = DataLoader(ds, batch_size=32, sampler=CacheSampler(ds, seed=0), collate_fn=collate_batch)
    for x, y in dl:  # warm allocator / imports with one batch
        break
    before = rss("RssAnon:")
    n = 0
    for x, y in dl:
        n += len(x)
    del x, y
    print(n, rss("RssAnon:") - before, rss("RssFile:"), ds.nbytes)
""")


def _rss_growth(root: Path) -> tuple[int, int, int, int]:
    # A fixed mmap threshold makes glibc return freed batch buffers to the OS at once; otherwise its
    # dynamic threshold keeps a few freed batches on the heap and RssAnon measures allocator slack.
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(root)], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    n, grown, file_rss, nbytes = map(int, out.stdout.split())
    return n, grown, file_rss, nbytes


def test_iterating_does_not_grow_anonymous_memory(tmp_path: Path) -> None:
    n = 500  # 500 x 150 kB = 75 MB of images; growth allowed: a few 4.8 MB batches, not the cache
    root, _, _ = make_cache(tmp_path / "c", n=n, h=224, w=224, shard_size=128)
    seen, grown, _, nbytes = _rss_growth(root)
    assert seen == n
    assert grown < 20e6, f"RssAnon grew {grown / 1e6:.1f} MB iterating {nbytes / 1e6:.0f} MB"


@pytest.mark.slow
def test_iterating_large_cache_memory(tmp_path: Path) -> None:
    n = 8000  # 1.2 GB
    root, _, _ = make_cache(tmp_path / "c", n=n, h=224, w=224, shard_size=1024)
    seen, grown, _, nbytes = _rss_growth(root)
    assert seen == n and grown < 20e6, f"RssAnon grew {grown / 1e6:.1f} MB iterating {nbytes / 1e6:.0f} MB"
