"""Crop + resize + flip + normalize fused in the loader's workers (``DatasetOptions(normalize=)``): float32
batches equal to torchvision's resized_crop + flip + normalize of the same boxes, the same batches as the uint8
crop normalized afterwards, and no float buffer handed out while a batch still holds it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TVF
from torch.utils.data import DataLoader

from cachebuild.storage.cache import write_cache
from loaders import batch_ring
from loaders import transforms as T
from loaders.collate import collate_batch
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.device import device_loader
from loaders.sampler import CacheSampler
from loaders.worker_crop import draw_crops, uniforms
from tests.compact_fixtures import jpeg_index_cache
from tests.loaders_fixtures import make_cache

H, W = 40, 48
NORM = (T.IMAGENET_MEAN, T.IMAGENET_STD)
LEVEL = 1 / (255 * min(T.IMAGENET_STD))  # one uint8 level in normalized units


def _npy(tmp_path: Path) -> Path:
    return make_cache(tmp_path / "c", n=40, h=H, w=W, shard_size=16)[0]


def _pair(root: Path, crop: object, **kw: object) -> tuple[CachedImageDataset, CachedImageDataset]:
    """The same crop without and with normalize."""
    o = dict(crop=crop, seed=4, **kw)
    return (CachedImageDataset(root, DatasetOptions(**o)),  # type: ignore[arg-type]
            CachedImageDataset(root, DatasetOptions(**o, normalize=NORM)))  # type: ignore[arg-type]


def _batch(ds: CachedImageDataset, idx: np.ndarray) -> torch.Tensor:
    return ds.load_batch(idx, torch.empty((len(idx), *ds.output_shape), dtype=torch.from_numpy(
        np.empty(0, ds.output_dtype)).dtype)).images


def _normalized(u8: torch.Tensor) -> torch.Tensor:
    """NHWC uint8 -> NHWC float32 through the device transform's Normalize."""
    return T.Normalize(*NORM)(u8.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


@pytest.mark.parametrize("kind", ["npy", "npy-in-memory", "jpeg"])
def test_fused_output_is_torchvision_resized_crop_flip_normalize(tmp_path: Path, kind: str) -> None:
    root = jpeg_index_cache(tmp_path / "j", n=40)[0] if kind == "jpeg" else _npy(tmp_path)
    plain, fused = _pair(root, T.RandomResizedCrop(24, flip_p=0.5), in_memory=kind == "npy-in-memory")
    fused.set_epoch(2)
    plain.set_epoch(2)
    idx = np.array([31, 2, 17, 2, 39, 0, 8, 25])
    got = _batch(fused, idx)
    assert got.dtype == torch.float32 and got.shape == (8, 24, 24, 3) and got.is_contiguous()
    # the same boxes and flips as the uint8 crop, normalized later: the augmentation is unchanged
    assert torch.allclose(got, _normalized(_batch(plain, idx)), atol=1e-5, rtol=0)
    # and the pixels torchvision gives for those crop parameters, within the resize kernels' tolerance
    crops, flips = draw_crops(fused.crop.spec, fused.valid_boxes(idx), fused.shape[:2],  # type: ignore[union-attr]
                              uniforms(4, 2, idx), 0.5)
    assert flips.any() and not flips.all()
    full = torch.from_numpy(fused.gather(idx)).permute(0, 3, 1, 2)
    refs = []
    for k, (t, l, h, w) in enumerate(crops.tolist()):
        ref = TVF.resized_crop(full[k], t, l, h, w, [24, 24], antialias=False)
        ref = TVF.horizontal_flip(ref) if flips[k] else ref
        refs.append(TVF.normalize(ref.float() / 255, list(T.IMAGENET_MEAN), list(T.IMAGENET_STD)).permute(1, 2, 0))
    diff = (got - torch.stack(refs)).abs() / LEVEL  # in uint8 levels of the channel with the smallest std
    assert float(diff.max()) <= 1.001 and float(diff.mean()) < 0.3  # the device kernels' tolerance


def test_center_crop_normalized_and_bad_arguments(tmp_path: Path) -> None:
    root = _npy(tmp_path)
    plain, fused = _pair(root, T.Compose([T.Resize(27), T.CenterCrop(24)]))
    idx = np.arange(6)
    assert torch.allclose(_batch(fused, idx), _normalized(_batch(plain, idx)), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="normalize needs crop"):
        DatasetOptions(normalize=NORM)
    with pytest.raises(ValueError, match="3 values each"):
        DatasetOptions(crop=T.CenterCrop(8), normalize=((0.5, 0.5), (0.2, 0.2)))
    with pytest.raises(ValueError, match="std > 0"):
        DatasetOptions(crop=T.CenterCrop(8), normalize=((0.5,) * 3, (0.2, 0.0, 0.2)))
    with pytest.raises(ValueError, match=r"out must be float32"):
        fused.load_batch(idx, torch.empty((6, 24, 24, 3), dtype=torch.uint8))


@pytest.mark.parametrize("workers", [0, 2])
def test_kept_float_batches_on_the_device_are_each_their_own(tmp_path: Path, workers: int) -> None:
    root = _npy(tmp_path)
    plain, fused = _pair(root, T.RandomResizedCrop(20, flip_p=0.5))
    sampler = CacheSampler(fused, seed=1)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    dl = DataLoader(fused, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=collate_batch)
    held = [x for x, _ in device_loader(dl, "cpu")]  # every batch of the epoch kept: 10 of them
    assert len(held) == 10 and all(x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
                                   for x in held)
    assert len({x.data_ptr() for x in held}) == 10  # each kept batch in its own buffer
    idx = np.fromiter(iter(sampler), dtype=np.int64).reshape(10, 4)
    ref = [_normalized(_batch(plain, i)) for i in idx]
    assert all(torch.allclose(x.permute(0, 2, 3, 1), r, atol=1e-5, rtol=0) for x, r in zip(held, ref, strict=True))
    fused.set_resolution(12)
    assert next(iter(dl))[0].shape == (4, 12, 12, 3)


def test_dataloader_workers_send_float_batches_through_the_ring(tmp_path: Path) -> None:
    root = _npy(tmp_path)
    plain, fused = _pair(root, T.RandomResizedCrop(16, flip_p=0.5))
    sampler = CacheSampler(fused, seed=3)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    ref = [_normalized(x) for x, _ in DataLoader(plain, batch_size=2, sampler=sampler, collate_fn=collate_batch)]
    before = set(batch_ring._registry)
    dl = DataLoader(fused, batch_size=2, sampler=sampler, num_workers=2, collate_fn=collate_batch,
                    multiprocessing_context="fork")
    held = [x for x, _ in dl]  # all 20 kept: more than the 2 x 5 slots, so later ones come fresh, none overwritten
    assert all(x.dtype == torch.float32 for x in held)
    assert all(torch.allclose(x, r, atol=1e-5, rtol=0) for x, r in zip(held, ref, strict=True))
    rings = [r for k, r in batch_ring._registry.items() if k not in before]
    assert len(rings) == 2 and sum(int(r.buf[batch_ring._COUNTS : batch_ring._COUNTS + 8].view(np.int64)[0])
                                   for r in rings) >= 4  # float batches travelled in the reused slots


@pytest.mark.parametrize("norm", [NORM, ((0.5,) * 3, (0.5,) * 3), ((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))])
def test_every_uint8_level_normalizes_within_1e_6_of_the_exact_value(tmp_path: Path, norm: tuple) -> None:
    """The whole uint8 range through the fused path: each value within 1e-6 of (v / 255 - mean) / std computed
    in float64, per channel (float32 arithmetic near |value| ~ 2.6 is off by ~2e-7; one uint8 level is ~0.017,
    so a wrong channel order, scale or offset is off by far more)."""
    levels = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1)
    levels[:, 1] = levels[::-1, 1]  # channels differ, so a swapped channel shows
    images = np.broadcast_to(levels.reshape(16, 16, 3), (4, 16, 16, 3)).copy()
    root = tmp_path / "levels"
    write_cache(root, images, np.zeros(4, dtype=np.int64), ["c"], shard_size=4, replace=True)
    whole = T.RandomResizedCrop(16, scale=(1.0, 1.0), ratio=(1.0, 1.0))  # the whole sample, pixels unchanged
    ds = CachedImageDataset(root, DatasetOptions(crop=whole, normalize=norm))
    got = _batch(ds, np.arange(4)).numpy().astype(np.float64)
    mean, std = (np.asarray(v, dtype=np.float64) for v in norm)
    exact = (images.astype(np.float64) / 255.0 - mean) / std
    assert np.abs(got - exact).max() <= 1e-6
