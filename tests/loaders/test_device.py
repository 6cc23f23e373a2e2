"""device_loader over DataLoaders: NCHW channels_last views, identity, re-iteration, the sampler's order; the
removed ThreadLoader's spellings are errors naming the DataLoader way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.device import device_loader
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import make_cache


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


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("storage", ["npy", "zarr"])
def test_dataloader_batches_equal_sampler_order(tmp_path, storage: str, workers: int) -> None:
    root, images, labels = make_cache(tmp_path / "c", n=61, storage=storage)
    ds = CachedImageDataset(root)
    s = CacheSampler(ds, seed=2)
    dl = DataLoader(ds, 16, sampler=s, num_workers=workers, collate_fn=collate_batch)
    assert len(dl) == 4
    got = [(x.clone(), y) for x, y in dl]
    order = s.rank_indices()
    assert np.array_equal(torch.cat([g[0] for g in got]).numpy(), images[order])
    assert np.array_equal(torch.cat([g[1] for g in got]).numpy(), labels[order])
    dropping = DataLoader(ds, 16, num_workers=workers, collate_fn=collate_batch, drop_last=True)
    assert len(dropping) == 3 and sum(len(y) for _, y in dropping) == 48


def test_the_removed_thread_loader_is_an_error_naming_the_dataloader_way() -> None:
    """ThreadLoader (and FastLoader, its earlier name and home) are gone: the old spellings say what to write."""
    import loaders

    def says(name: str) -> str:
        return rf"^{name} was removed: .*torch\.utils\.data\.DataLoader\(ds, .*collate_fn=collate_batch\)"

    with pytest.raises(ImportError, match=says("ThreadLoader")) as e:
        from loaders import ThreadLoader  # noqa: F401
    assert "\n" not in str(e.value)
    with pytest.raises(ImportError, match=says("FastLoader")):
        from loaders import FastLoader  # noqa: F401
    with pytest.raises(ImportError, match=says("FastLoader")):
        from loaders.device import FastLoader as _  # noqa: F401
    with pytest.raises(ImportError, match=says("ThreadLoader")):
        loaders.ThreadLoader  # noqa: B018
    assert not {"ThreadLoader", "FastLoader"} & {*loaders.__all__, *dir(loaders)}
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):  # other names: as any module says
        loaders.Nope  # noqa: B018


@pytest.mark.gpu
def test_device_loader_cuda(cache) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    s = CacheSampler(ds, seed=1)
    for workers in (0, 2):
        src = DataLoader(ds, batch_size=8, sampler=s, num_workers=workers, collate_fn=collate_batch, pin_memory=True)
        xs, ys = [], []
        for x, y in device_loader(src, "cuda"):
            assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] == 3
            xs.append(x.permute(0, 2, 3, 1).cpu())
            ys.append(y.cpu())
        order = s.rank_indices()
        assert np.array_equal(torch.cat(xs).numpy(), images[order])
        assert np.array_equal(torch.cat(ys).numpy(), labels[order])
