"""loaders.collate: torch's default_collate takes a gathered CacheBatch whole (no per-sample stack), with
exactly the bytes, dtypes and container type it gave before; other CacheSample lists collate as torch's tuples."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset, default_collate

from loaders.batch_ring import drop_dead_rings, ring_stats
from loaders.collate import CacheBatch, CacheSample, collate_batch
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import make_cache

STORAGES = [("npy", "none"), ("zarr", "none"), ("zarr", "zstd")]


@pytest.fixture(autouse=True)
def _no_dead_rings():
    gc.collect()
    drop_dead_rings()


@pytest.fixture(scope="module", params=STORAGES, ids=lambda p: "-".join(p))
def cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    storage, compression = request.param
    return make_cache(tmp_path_factory.mktemp("collate") / "c", n=83, storage=storage, shard_size=16,
                      compression=compression)


def _stacked(samples: list[tuple]) -> list:
    """What default_collate gave before loaders.collate: torch's own tuple path on plain tuples."""
    return default_collate([tuple(s) for s in samples])


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_dataloader_equals_collate_batch(cache, workers: int) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    sampler = CacheSampler(ds, shuffle=True, seed=3)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    before = ring_stats()
    plain = [(x.clone(), y.clone()) for x, y in DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers)]
    handed = {k: v - before[k] for k, v in ring_stats().items()}
    fast = [(x.clone(), y.clone()) for x, y in DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers,
                                                          collate_fn=collate_batch)]
    order = sampler.rank_indices()
    assert len(plain) == len(fast) == 11
    for (px, py), (fx, fy) in zip(plain, fast, strict=True):
        assert px.dtype == fx.dtype == torch.uint8 and py.dtype == fy.dtype == torch.int64
        assert px.shape == fx.shape and px.numpy().tobytes() == fx.numpy().tobytes()
        assert torch.equal(py, fy)
    assert torch.cat([x for x, _ in plain]).numpy().tobytes() == images[order].tobytes()
    assert np.array_equal(torch.cat([y for _, y in plain]).numpy(), labels[order])
    if workers:  # the plain loader handed its batches over through the ring, as collate_batch does: no stack
        assert handed["slot_batches"] == 11 and handed["fallbacks"] == 0


def test_default_collate_of_a_batch_is_the_batch(cache) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    batch = ds.__getitems__([40, 2, 17, 2, 82])
    assert isinstance(batch, CacheBatch) and type(batch[0]) is CacheSample
    out = default_collate(batch)
    # the container torch's tuple path returns (a list), holding the batch's own tensors: nothing copied
    assert type(out) is list and len(out) == 2
    assert out[0] is batch.images and out[1] is batch.labels
    ref = _stacked(list(batch))
    assert type(ref) is list and out[0].numpy().tobytes() == ref[0].numpy().tobytes()
    assert out[0].shape == ref[0].shape and torch.equal(out[1], ref[1]) and out[1].dtype == ref[1].dtype
    assert np.array_equal(out[0].numpy(), images[[40, 2, 17, 2, 82]])
    assert np.array_equal(out[1].numpy(), labels[[40, 2, 17, 2, 82]])


def test_boxes_through_default_collate(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=30, boxes=True)
    ds = CachedImageDataset(root, DatasetOptions(return_boxes=True))
    out = list(DataLoader(Subset(ds, range(5, 30)), batch_size=7, num_workers=2))  # Subset forwards __getitems__
    x, y, b = (torch.cat([o[k] for o in out]) for k in range(3))
    assert x.numpy().tobytes() == images[5:].tobytes() and torch.equal(b, torch.from_numpy(ds.boxes[5:]))
    assert y.dtype == torch.int64 and b.dtype == torch.int32
    ref = _stacked([ds[i] for i in range(5, 12)])
    assert all(torch.equal(o, r) and o.dtype == r.dtype for o, r in zip(out[0], ref, strict=True))


def test_other_sample_lists_collate_like_tuples(cache) -> None:
    root, _images, _ = cache
    ds = CachedImageDataset(root)
    picked = [ds.__getitems__([i, i + 1])[1] for i in (0, 9, 30)]  # samples of different batches
    assert all(type(s) is CacheSample for s in picked)
    out, ref = default_collate(picked), _stacked(picked)
    assert type(out) is list and len(out) == 2
    assert all(torch.equal(o, r) and o.dtype == r.dtype for o, r in zip(out, ref, strict=True))
    assert out[0].data_ptr() != picked[0][0].data_ptr()  # a real stack, not a view of one batch
    with pytest.raises(RuntimeError, match="equal size"):
        default_collate([picked[0], CacheSample((*picked[1], torch.zeros(4)))])


def test_transform_datasets_still_stack(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=12)
    ds = CachedImageDataset(root, DatasetOptions(transform=lambda t: t.flip(0)))
    x, y = next(iter(DataLoader(ds, batch_size=4)))
    assert np.array_equal(x.numpy(), images[:4, ::-1]) and y.dtype == torch.int64
