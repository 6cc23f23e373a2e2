"""An existing torchvision transform on a cache's samples: it works through ``DatasetOptions(transform_input=)``
('pil' for a PIL pipeline, 'chw' for tensor transforms), or fails with a message naming that option and
docs/porting.md; never silently on the wrong axes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T1
import torchvision.transforms.v2 as T2
from PIL import Image
from torch.utils.data import DataLoader

from loaders import CachedImageDataset, DatasetOptions
from tests.loaders_fixtures import make_cache

HELP = ("transform_input", "docs/porting.md")


@pytest.fixture
def cache(tmp_path: Path) -> tuple[Path, np.ndarray]:
    root, images, _ = make_cache(tmp_path / "c", n=12, h=40, w=40)
    return root, images


@pytest.mark.parametrize("transform", [T1.Compose([T1.RandomResizedCrop(16), T1.ToTensor()]),
                                       T2.Compose([T2.RandomResizedCrop(16), T2.ToDtype(torch.float32, scale=True)]),
                                       T1.RandomHorizontalFlip()], ids=["v1", "v2", "v1-single"])
def test_a_torchvision_transform_on_the_default_samples_is_refused_naming_the_option(cache, transform):
    with pytest.raises(ValueError, match="transform_input") as e:
        DatasetOptions(transform=transform)
    assert all(h in str(e.value) for h in HELP) and "(H, W, 3)" in str(e.value)


def test_a_v1_pil_pipeline_runs_unchanged_with_pil_input(cache):
    root, images = cache
    seen: list[Image.Image] = []
    tf = T1.Compose([T1.Lambda(lambda im: seen.append(im) or im), T1.RandomResizedCrop(16), T1.ToTensor()])
    ds = CachedImageDataset(root, DatasetOptions(transform=tf, transform_input="pil"))
    x, _ = ds[3]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and 0 <= float(x.min()) <= float(x.max()) <= 1
    assert isinstance(seen[0], Image.Image) and seen[0].mode == "RGB"
    assert np.array_equal(np.asarray(seen[0]), images[3])  # the sample's own pixels
    xb, yb = next(iter(DataLoader(ds, batch_size=5, num_workers=1)))  # torch's default collate stacks them
    assert xb.shape == (5, 3, 16, 16) and yb.tolist() == [int(v) for v in ds.labels[:5]]


def test_v2_tensor_transforms_get_chw_samples(cache):
    root, images = cache
    tf = T2.Compose([T2.CenterCrop(20), T2.ToDtype(torch.float32, scale=True)])
    ds = CachedImageDataset(root, DatasetOptions(transform=tf, transform_input="chw"))
    x, _ = ds[5]
    want = torch.from_numpy(images[5]).permute(2, 0, 1)[:, 10:30, 10:30].float() / 255
    assert x.shape == (3, 20, 20) and torch.allclose(x, want)
    hwc = CachedImageDataset(root, DatasetOptions(transform=lambda t: t.shape, transform_input="hwc"))
    assert tuple(hwc[0][0]) == (40, 40, 3)  # said explicitly: the HWC tensor, as before


def test_a_transform_that_fails_or_reads_the_wrong_axes_says_why(cache):
    root, _ = cache
    ds = CachedImageDataset(root)
    ds.transform = torch.nn.Sequential(T1.RandomResizedCrop(16))  # v1 tensor crop: crops (W, 3) as if (H, W)
    with pytest.raises(TypeError, match="transform_input") as e:
        ds[0]
    assert all(h in str(e.value) for h in HELP) and "(40, 16, 16)" in str(e.value)
    ds.transform = lambda im: im.convert("L")  # a PIL-only function
    with pytest.raises(TypeError, match="transform_input") as e:
        ds[1]
    assert "AttributeError" in str(e.value) and "docs/porting.md" in str(e.value)
    assert isinstance(e.value.__cause__, AttributeError)
    loader = DataLoader(ds, batch_size=4, num_workers=1)
    with pytest.raises(TypeError, match="transform_input"):  # from a worker too
        next(iter(loader))


def test_pil_input_needs_uint8_samples():
    from loaders.transforms import RandomResizedCrop

    with pytest.raises(ValueError, match="transform_input='pil'"):
        DatasetOptions(transform=T1.ToTensor(), transform_input="pil", crop=RandomResizedCrop(16),
                       normalize=((0.5, 0.5, 0.5), (0.2, 0.2, 0.2)))
    with pytest.raises(ValueError, match="transform_input must be"):
        DatasetOptions(transform_input="nhwc")  # type: ignore[arg-type]
