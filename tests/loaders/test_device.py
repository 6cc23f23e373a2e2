"""device_loader and ThreadLoader: NCHW channels_last views, identity, re-iteration, safe buffer reuse."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.device import device_loader
from loaders.sampler import CacheSampler
from loaders.thread_loader import ThreadLoader
from tests.loaders_fixtures import decode_index, make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    return make_cache(tmp_path_factory.mktemp("c") / "c", n=37, boxes=True)


def test_device_loader_cpu(cache) -> None:
    root, images, _labels = cache
    ds = CachedImageDataset(root)
    dl = DataLoader(ds, batch_size=8, collate_fn=collate_batch)
    loader = device_loader(dl, "cpu")
    assert len(loader) == 5
    for _ in range(2):  # re-iterates each epoch
        xs = []
        for x, _y in loader:
            assert x.shape[1] == 3 and x.dtype == torch.uint8
            assert x.is_contiguous(memory_format=torch.channels_last)  # NCHW view of NHWC storage
            xs.append(x.permute(0, 2, 3, 1))
        assert np.array_equal(torch.cat(xs).numpy(), images)


def test_device_loader_boxes_and_default_collate(cache) -> None:
    root, images, _ = cache
    ds = CachedImageDataset(root, DatasetOptions(return_boxes=True))
    x, _, b = next(iter(device_loader(DataLoader(ds, batch_size=4, collate_fn=collate_batch), "cpu")))
    assert b.shape == (4, 4) and x.shape == (4, 3, 8, 6)
    x, _y, b = next(iter(device_loader(DataLoader(ds, batch_size=4), "cpu")))  # default_collate list
    assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), images[:4])


@pytest.mark.parametrize("storage", ["npy", "zarr"])
def test_thread_loader_equals_sampler_order(tmp_path, storage: str) -> None:
    root, images, labels = make_cache(tmp_path / "c", n=61, storage=storage)
    ds = CachedImageDataset(root)
    s = CacheSampler(ds, seed=2)
    fl = ThreadLoader(ds, 16, sampler=s, num_threads=2)
    assert len(fl) == 4
    got = [(x.clone(), y) for x, y in fl]
    order = s.rank_indices()
    assert np.array_equal(torch.cat([g[0] for g in got]).numpy(), images[order])
    assert np.array_equal(torch.cat([g[1] for g in got]).numpy(), labels[order])
    dropping = ThreadLoader(ds, 16, drop_last=True)
    assert len(dropping) == 3 and sum(len(y) for _, y in dropping) == 48


def test_a_thread_loader_without_a_sampler_draws_cache_samplers_order_one_epoch_per_pass(tmp_path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=30)
    ds = CachedImageDataset(root)
    tl = ThreadLoader(ds, 8, shuffle=True, seed=4, num_threads=2)
    passes = [torch.cat([x.clone() for x, _ in tl]).numpy() for _ in range(2)]
    for epoch, got in enumerate(passes):
        want = CacheSampler(ds, seed=4, num_replicas=1, rank=0)
        want.set_epoch(epoch)
        assert np.array_equal(got, images[want.rank_indices()])


def test_fast_loader_is_the_previous_releases_name_of_thread_loader() -> None:
    from loaders import FastLoader
    from loaders.device import FastLoader as OldHome

    assert FastLoader is OldHome is ThreadLoader


def test_thread_loader_buffers_reused_only_when_free(tmp_path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=200)
    ds = CachedImageDataset(root)
    fl = ThreadLoader(ds, 10, shuffle=True, seed=0, num_threads=2, prefetch=1)
    kept = []
    for i, (x, _) in enumerate(fl):
        if i % 3 == 0:
            kept.append((x, decode_index(x.numpy()).copy()))  # held: its buffer must not be reused
    for x, idx in kept:
        assert np.array_equal(decode_index(x.numpy()), idx)
        assert np.array_equal(x.numpy(), images[idx])
    n_bufs = len(fl._pool.bufs)
    del kept, x
    for _ in fl:
        pass
    assert len(fl._pool.bufs) == n_bufs  # freed buffers were recycled, none added
    assert n_bufs < 20


def test_thread_loader_short_last_batch_comes_from_the_pool_and_is_kept_safe(tmp_path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=205)
    ds = CachedImageDataset(root)
    fl = ThreadLoader(ds, 10, shuffle=True, seed=1, num_threads=2, prefetch=1)
    *_, (last, _) = fl
    assert len(last) == 5 and any(np.shares_memory(last.numpy(), b) for b in fl._pool.bufs)  # not a fresh batch
    idx = decode_index(last.numpy()).copy()
    n_bufs = len(fl._pool.bufs)
    for _ in range(2):  # later epochs must not write into the buffer the kept short batch lives in
        for x, _ in fl:
            assert not np.shares_memory(x.numpy(), last.numpy())
    assert np.array_equal(last.numpy(), images[idx])
    del last
    for _ in fl:
        pass
    assert len(fl._pool.bufs) <= n_bufs + 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_WIPEONFORK is Linux's")
def test_thread_loader_buffers_are_not_shared_with_a_forked_child(tmp_path) -> None:
    """A fork (a DataLoader starting its workers) after a ThreadLoader epoch used to make every page of its
    buffers copy-on-write, so the next epoch copied them all before writing (6x slower, measured). The
    buffers are now wipe-on-fork: the child sees zeros there and the parent keeps its own pages."""
    root, images, _ = make_cache(tmp_path / "c", n=96, h=32, w=32)
    fl = ThreadLoader(CachedImageDataset(root), 32, num_threads=2)
    for _ in range(2):
        for _ in fl:
            pass
    assert fl._pool.bufs and all(b.any() for b in fl._pool.bufs)  # the parent's buffers hold pixels
    del _  # the last batch: one still held goes to the child as it is (tests/test_loader_integrity.py)
    child = os.fork()
    if child == 0:
        os._exit(0 if not any(b.any() for b in fl._pool.bufs) else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child saw the loader's buffers"
    assert all(b.any() for b in fl._pool.bufs)
    got = [x.clone() for x, _ in fl]
    assert np.array_equal(torch.cat(got).numpy(), images)


def _gather_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ThreadLoader")]


def test_thread_loader_early_break_stops_its_threads(cache) -> None:
    root, images, _ = cache
    ds = CachedImageDataset(root)
    assert not _gather_threads()
    it = iter(ThreadLoader(ds, 4, num_threads=2))
    x, _ = next(it)
    assert np.array_equal(x.numpy(), images[:4])
    assert len(_gather_threads()) == 2  # running while the epoch is open
    it.close()  # closing the generator mid-epoch must join them, not leave them to the interpreter
    assert not _gather_threads()


@pytest.mark.gpu
def test_device_loader_cuda(cache) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    s = CacheSampler(ds, seed=1)
    for src in (DataLoader(ds, batch_size=8, sampler=s, collate_fn=collate_batch, pin_memory=True),
                ThreadLoader(ds, 8, sampler=s, pin_memory=True)):
        xs, ys = [], []
        for x, y in device_loader(src, "cuda"):
            assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] == 3
            xs.append(x.permute(0, 2, 3, 1).cpu())
            ys.append(y.cpu())
        order = s.rank_indices()
        assert np.array_equal(torch.cat(xs).numpy(), images[order])
        assert np.array_equal(torch.cat(ys).numpy(), labels[order])
