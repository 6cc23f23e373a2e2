"""Crop + resize + flip in the loader's workers (loaders.worker_crop): boxes as torchvision draws them, pixels
as torchvision resamples them, the same batches whatever loads them, on every storage kind. The crops are the
device transforms' own classes (``loaders.transforms``); the previous release's spellings are aliases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TVF
from torch.utils.data import DataLoader

from loaders import batch_ring, worker_crop
from loaders.collate import collate_batch
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.sampler import CacheSampler
from loaders.transforms import CenterCrop, Compose, RandomResizedCrop, Resize
from loaders.transforms import functional as TF
from loaders.worker_crop import draw_crops, progressive, resize_into, uniforms
from tests.box_checks import assert_same_distribution, torchvision_boxes
from tests.compact_fixtures import jpeg_index_cache
from tests.loaders_fixtures import make_cache

H, W = 40, 48
BOXES = [(0, 0, 40, 48), (5, 7, 12, 9), (20, 10, 20, 38), (3, 0, 30, 48), (0, 17, 40, 5)]


def _reference(ds: CachedImageDataset, idx: np.ndarray, size: tuple[int, int], epoch: int,
               boxes: np.ndarray | None = None) -> np.ndarray:
    """The batch by hand: whole samples gathered, boxes drawn from the documented key inside ``boxes`` (default:
    the stored valid boxes), each resized."""
    full = ds.gather(idx)
    assert ds.crop is not None and isinstance(ds.crop.spec, RandomResizedCrop)
    valid = ds.valid_boxes(idx) if boxes is None else boxes
    crops, flips = draw_crops(ds.crop.spec, valid, ds.shape[:2], uniforms(ds.crop.seed, epoch, idx), ds.crop.flip_p)
    out = np.empty((len(idx), *size, 3), dtype=np.uint8)
    for i in range(len(idx)):
        resize_into(full[i], crops[i], out[i], bool(flips[i]))
    return out


# ---------------------------------------------------------------------------- pixels and boxes


@pytest.mark.parametrize("size", [(24, 20), (64, 80)])
@pytest.mark.parametrize("flip", [False, True])
def test_resize_into_matches_torchvision_resized_crop(size: tuple[int, int], flip: bool) -> None:
    # The device kernels' uint8 tolerance (test_transforms): within 1 level, mean difference < 0.3.
    src = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
    for box in BOXES:
        dst = np.empty((*size, 3), dtype=np.uint8)
        resize_into(src, box, dst, flip)
        ref = TVF.resized_crop(torch.from_numpy(src).permute(2, 0, 1), *box, list(size), antialias=False)
        if flip:
            ref = TVF.horizontal_flip(ref)
        diff = np.abs(dst.astype(np.int64) - ref.permute(1, 2, 0).numpy())
        assert diff.max() <= 1 and diff.mean() < 0.3, (box, diff.mean())


@pytest.mark.parametrize("hw", [(256, 256), (50, 1000)])
def test_box_distribution_matches_torchvision(hw: tuple[int, int]) -> None:
    h, w = hw
    n = 20_000
    idx = np.arange(n)
    boxes = np.tile([0, 0, h, w], (n, 1))
    ours, flips = draw_crops(RandomResizedCrop(224), boxes, (h, w), uniforms(3, 0, idx), 0.5)
    assert (ours[:, 0] >= 0).all() and (ours[:, 0] + ours[:, 2] <= h).all()
    assert (ours[:, 1] >= 0).all() and (ours[:, 1] + ours[:, 3] <= w).all()
    assert_same_distribution(torch.from_numpy(ours), torchvision_boxes(h, w, n, seed=0), h, w)
    assert abs(flips.mean() - 0.5) < 0.02


def test_boxes_stay_inside_valid_boxes_and_keep_the_distribution() -> None:
    n = 20_000
    boxes = np.tile(np.array([[8, 0, 56, 80], [0, 10, 64, 70]]), (n // 2, 1))
    crops, _ = draw_crops(RandomResizedCrop(32), boxes, (64, 80), uniforms(0, 0, np.arange(n)), 0.0)
    assert (crops[:, 0] >= boxes[:, 0]).all() and (crops[:, 0] + crops[:, 2] <= boxes[:, 2]).all()
    assert (crops[:, 1] >= boxes[:, 1]).all() and (crops[:, 1] + crops[:, 3] <= boxes[:, 3]).all()
    first = torch.from_numpy(crops[0::2] - np.array([8, 0, 0, 0]))
    assert_same_distribution(first, torchvision_boxes(48, 80, 5_000, seed=1), 48, 80)


def test_uniforms_are_keyed_by_seed_epoch_and_index_only() -> None:
    idx = np.array([5, 900, 3, 5])
    u = uniforms(0, 2, idx)
    assert np.array_equal(u[0], u[3]) and not np.array_equal(u[0], u[1])
    assert np.array_equal(uniforms(0, 2, idx[1:2]), u[1:2])  # a sample's draw does not depend on its batch
    assert not np.array_equal(uniforms(0, 3, idx), u) and not np.array_equal(uniforms(1, 2, idx), u)
    assert ((u >= 0) & (u < 1)).all()


def test_progressive_schedule() -> None:
    s = progressive(160, 192, 2, 6)
    assert [s(e) for e in range(8)] == [160, 160, 160, 160, 160, 160, 192, 192]
    s = progressive(96, 128, 0, 4, step=8)
    assert [s(e) for e in range(6)] == [96, 104, 112, 120, 128, 128]
    with pytest.raises(ValueError, match="progressive"):
        progressive(192, 160, 0, 1)


# ---------------------------------------------------------------------------- datasets


def _npy(tmp_path: Path, **kw: object) -> Path:
    return make_cache(tmp_path / "c", n=40, h=H, w=W, shard_size=16, **kw)[0]  # type: ignore[arg-type]


def _cropped(ds: CachedImageDataset, idx: np.ndarray, size: int) -> np.ndarray:
    """What a batch of ``idx`` holds under the dataset's crop, as a numpy array."""
    return ds.load_batch(idx, torch.empty((len(idx), size, size, 3), dtype=torch.uint8)).images.numpy()


@pytest.mark.parametrize("kind", ["npy", "zarr", "npy-in-memory", "npy-pad"])
def test_gather_cropped_on_storage_kinds(tmp_path: Path, kind: str) -> None:
    root = make_cache(tmp_path / "c", n=40, h=H, w=W, shard_size=16, storage="zarr" if kind == "zarr" else "npy",
                      boxes=kind == "npy-pad")[0]
    ds = CachedImageDataset(root, DatasetOptions(crop=RandomResizedCrop(24, scale=(0.2, 1.0), flip_p=0.5), seed=7,
                                                 in_memory=kind == "npy-in-memory"))
    ds.set_epoch(3)
    idx = np.array([31, 2, 17, 2, 39, 0])
    got = _cropped(ds, idx, 24)
    assert np.array_equal(got, _reference(ds, idx, (24, 24), 3))
    images, labels = collate_batch(ds.__getitems__(idx.tolist()))
    assert images.shape == (6, 24, 24, 3) and torch.equal(images, torch.from_numpy(got))
    assert labels.tolist() == ds.labels[idx].tolist()
    if kind == "npy-pad":  # the crops were drawn inside the stored boxes, not the whole padded sample
        assert (ds.valid_boxes(idx) != [0, 0, H, W]).any()
        whole = np.tile([0, 0, H, W], (len(idx), 1))
        assert not np.array_equal(_reference(ds, idx, (24, 24), 3, boxes=whole), got)


def test_sample_views_are_read_only_views_where_samples_lie_in_memory(tmp_path: Path) -> None:
    root = _npy(tmp_path)
    zarr = make_cache(tmp_path / "z", n=40, h=H, w=W, shard_size=16, storage="zarr")[0]
    idx = np.array([17, 3, 3, 39])
    for ds in (CachedImageDataset(root), CachedImageDataset(root, DatasetOptions(in_memory=True))):
        views = ds.sample_views(idx)
        assert views is not None and np.array_equal(np.stack(views), ds.gather(idx))
        assert not any(v.flags.writeable for v in views)  # a view of the cache is never written through
    assert CachedImageDataset(zarr).sample_views(idx) is None  # chunks must be read: the crop gathers them
    with pytest.raises(IndexError, match="out of range"):
        CachedImageDataset(root).sample_views([40])


def test_compact_and_url_caches(tmp_path: Path, http_server) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = jpeg_index_cache(tmp_path / "site" / "j", n=40)
    url = http_server(tmp_path / "site").url_for("j")
    crop = RandomResizedCrop(16, flip_p=0.5)
    local = CachedImageDataset(root, DatasetOptions(crop=crop))
    remote = CachedImageDataset(url, DatasetOptions(crop=crop))
    idx = np.array([3, 30, 11, 0])
    a = _cropped(local, idx, 16)
    b = _cropped(remote, idx, 16)
    assert np.array_equal(a, b) and np.array_equal(a, _reference(local, idx, (16, 16), 0))
    assert remote.bytes_fetched > 0


def test_center_crop_equals_imagenet_eval_kernels(tmp_path: Path) -> None:
    ds = CachedImageDataset(_npy(tmp_path), DatasetOptions(crop=Compose([Resize(27), CenterCrop(24)])))
    idx = np.arange(8)
    got = _cropped(ds, idx, 24)
    batch = torch.from_numpy(ds.gather(idx)).permute(0, 3, 1, 2)
    ref = TF.center_crop(TF.resize(batch, [round(24 / 0.875)]), [24, 24]).permute(0, 2, 3, 1)
    assert torch.equal(torch.from_numpy(got), ref)
    plain = CachedImageDataset(_npy(tmp_path), DatasetOptions(crop=CenterCrop(24)))
    assert np.array_equal(_cropped(plain, idx, 24), ds.gather(idx)[:, 8:32, 12:36])


def test_the_previous_releases_spellings_are_aliases_of_the_device_classes(tmp_path: Path) -> None:
    assert worker_crop.RandomResizedCrop is RandomResizedCrop
    old_eval = worker_crop.CenterCrop(24)  # resize to round(24 / 0.875), then the centre crop
    assert isinstance(old_eval, Compose) and [type(t) for t in old_eval.transforms] == [Resize, CenterCrop]
    assert old_eval.transforms[0].size == [27] and isinstance(worker_crop.CenterCrop(24, resize_size=0), CenterCrop)
    root = _npy(tmp_path)
    idx = np.array([4, 1, 33])
    new = CachedImageDataset(root, DatasetOptions(crop=RandomResizedCrop(20, flip_p=0.5), seed=3))
    old = CachedImageDataset(root, DatasetOptions(crop=worker_crop.RandomResizedCrop(20), flip=True, seed=3))
    assert np.array_equal(_cropped(new, idx, 20), _cropped(old, idx, 20))
    sampler = worker_crop.EpochSampler(old, seed=5, schedule=progressive(16, 20, 0, 1))
    assert isinstance(sampler, CacheSampler) and old.resolution == (16, 16)
    sampler.set_epoch(1)
    assert old.resolution == (20, 20) and old.crop is not None and old.crop.epoch == 1


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    root = _npy(tmp_path)
    with pytest.raises(TypeError, match=r"loaders\.transforms RandomResizedCrop, CenterCrop"):
        CachedImageDataset(root, DatasetOptions(crop=object()))
    with pytest.raises(TypeError, match="other device transforms run on the batch"):
        DatasetOptions(crop=Compose([CenterCrop(16), Resize(20)]))
    with pytest.raises(ValueError, match="flip needs"):
        CachedImageDataset(root, DatasetOptions(crop=CenterCrop(16), flip=True))
    with pytest.raises(ValueError, match="without antialias"):
        DatasetOptions(crop=RandomResizedCrop(16, antialias=True))
    with pytest.raises(ValueError, match="short side"):
        DatasetOptions(crop=Compose([Resize([20, 30]), CenterCrop(16)]))
    with pytest.raises(ValueError, match="set_resolution needs"):
        CachedImageDataset(root).set_resolution(16)


# ---------------------------------------------------------------------------- loaders


def _epoch(dl: object) -> list[np.ndarray]:
    return [x.numpy().copy() for x, *_ in dl]  # type: ignore[attr-defined]


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_same_batches_any_workers_persistent_resolution_and_resume(tmp_path: Path, ctx: str) -> None:
    root = _npy(tmp_path)
    ds = CachedImageDataset(root, DatasetOptions(crop=RandomResizedCrop(24, flip_p=0.5), seed=1))
    ds.set_resolution(progressive(16, 24, 0, 1))  # each set_epoch of the sampler sets the size too
    sampler = CacheSampler(ds, seed=5)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    plain = _epoch(DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=collate_batch))  # epoch 0, 16 px
    assert plain[0].shape == (8, 16, 16, 3)
    before = set(batch_ring._registry)
    dl = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=collate_batch,
                    persistent_workers=True, multiprocessing_context=ctx)
    assert all(np.array_equal(a, b) for a, b in zip(_epoch(dl), plain, strict=True))
    rings = [r for k, r in batch_ring._registry.items() if k not in before]  # this loader's workers'
    sent = sum(int(r.buf[batch_ring._COUNTS : batch_ring._COUNTS + 8].view(np.int64)[0]) for r in rings)
    assert len(rings) == 2 and sent == len(plain)  # every batch came through the reused ring slots
    sampler.set_epoch(1)  # schedule -> 24 px; the same (persistent) workers must see it
    workers = _epoch(dl)
    assert workers[0].shape == (8, 24, 24, 3)
    idx = sampler.rank_indices(1)
    assert np.array_equal(np.concatenate(workers), _reference(ds, idx, (24, 24), 1))
    # resume mid-epoch: the rest of the epoch is what the uninterrupted run saw
    fresh = CachedImageDataset(root, DatasetOptions(crop=RandomResizedCrop(24, flip_p=0.5), seed=1))
    fresh.set_resolution(progressive(16, 24, 0, 1))
    resumed = CacheSampler(fresh, seed=5)
    resumed.load_state_dict({**sampler.state_dict(), "position": 16})
    rest = _epoch(DataLoader(fresh, batch_size=8, sampler=resumed, num_workers=1, collate_fn=collate_batch,
                             multiprocessing_context=ctx))
    assert all(np.array_equal(a, b) for a, b in zip(rest, workers[2:], strict=True))


def test_workers_crop_a_boxed_cache_the_same_batches_inside_its_boxes(tmp_path: Path) -> None:
    ds = CachedImageDataset(_npy(tmp_path, boxes=True),
                            DatasetOptions(crop=RandomResizedCrop(20, flip_p=0.5), return_boxes=True))
    sampler = CacheSampler(ds, seed=2)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    ref = _epoch(DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=collate_batch))
    dl = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=collate_batch)
    got = list(dl)
    assert all(np.array_equal(g[0].numpy(), r) for g, r in zip(got, ref, strict=True))
    assert got[0][2].tolist()[0] == [0, 0, 20, 20]  # cropped inside the valid box: all of the output is valid
    ds.set_resolution(12)
    assert next(iter(dl))[0].shape == (8, 12, 12, 3)
