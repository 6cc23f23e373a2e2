"""examples/timm_train.py at a tiny size, and timm's Mixup against ours.

* The recipe trains a ``timm.create_model`` model (``pretrained=False``) from a cache with our loader, our
  device transforms and timm's Mixup (and with our MixUpCutMix).
* Our batches are what timm's Mixup expects: on our loader's batch and on timm's own loader's batch of the
  same samples, timm's Mixup (same NumPy seed) gives identical targets and the same images.
* Where timm's Mixup and ours agree (``pairing="flip"``, the same draws replayed): MixUp images and targets
  exactly, CutMix when the box side ``int(sqrt(1 - lam) * H)`` is even; where it is odd timm's box is one
  row/column larger (its side is that int, ours twice ``int(0.5 * sqrt(1 - lam) * H)``, torchvision's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
import torch.nn.functional as F
from timm.data import Mixup, create_loader
from timm.loss import SoftTargetCrossEntropy
from torch.utils.data import Dataset

from examples import timm_train
from loaders import CachedImageDataset, CacheSampler
from loaders.transforms import IMAGENET_MEAN, IMAGENET_STD, Compose, Normalize
from loaders.transforms import mix as M
from tests.loaders_fixtures import make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root, _, _ = make_cache(tmp_path_factory.mktemp("timm") / "train", n=24, h=32, w=32)
    return root


@pytest.mark.parametrize("mix", ["timm", "ours"])
def test_recipe_trains_a_timm_model(cache: Path, mix: str) -> None:
    s = timm_train.main([str(cache), "--val", str(cache), "--model", "test_resnet", "--batch-size", "8",
                         "--epochs", "1", "--workers", "0", "--mix", mix, "--lr", "0.01"])
    assert s.steps == 3 and s.samples == 24  # 24 samples, batches of 8
    assert np.isfinite(s.first_loss) and np.isfinite(s.last_loss) and 0.0 <= (s.val_acc or 0.0) <= 1.0


class PilView(Dataset):
    """The cache as timm's loaders expect a dataset: PIL images, and a ``transform`` attribute timm sets."""

    def __init__(self, ds: CachedImageDataset) -> None:
        self.ds, self.transform = ds, None

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image, label = self.ds[i][:2]
        pil = PIL.Image.fromarray(image.numpy())
        return (self.transform(pil) if self.transform else pil), int(label)


@pytest.mark.parametrize("mixup,cutmix", [(0.8, 1.0), (1.0, 0.0), (0.0, 1.0)])
def test_timm_mixup_on_our_batch_equals_on_timm_loader_batch(cache: Path, mixup: float, cutmix: float) -> None:
    ds = CachedImageDataset(cache)
    theirs = create_loader(PilView(ds), input_size=(3, 32, 32), batch_size=8, is_training=False,
                           use_prefetcher=False, num_workers=0, crop_pct=1.0, interpolation="bilinear",
                           persistent_workers=False)
    ours = timm_train.make_loader(ds, CacheSampler(ds, shuffle=False), 8, 0, torch.device("cpu"), drop_last=False)
    norm = Compose([Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    mix = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=0.1, num_classes=5)
    for seed, ((xt, yt), (xo, yo)) in enumerate(zip(theirs, ours, strict=True)):
        xo = norm(xo)
        assert xo.dtype == xt.dtype == torch.float32 and xo.shape == xt.shape and torch.equal(yo, yt)
        torch.testing.assert_close(xo, xt, atol=1e-5, rtol=0)  # the same normalised pixels
        np.random.seed(seed)
        mt, tt = mix(xt.clone(), yt)
        np.random.seed(seed)
        mo, to = mix(xo.clone(), yo)
        assert torch.equal(to, tt)  # identical targets
        torch.testing.assert_close(mo, mt, atol=1e-5, rtol=0)


def _timm_draws(seed: int, alpha: float, h: int, w: int, cut: bool) -> tuple[float, int, int]:
    """Replay ``Mixup(mode="batch")``'s NumPy draws with one of mixup/cutmix on: (lam, cy, cx)."""
    np.random.seed(seed)
    np.random.rand()  # "mix at all?" (prob=1)
    lam = float(np.random.beta(alpha, alpha))
    if not cut:
        return lam, 0, 0
    return lam, int(np.random.randint(0, h)), int(np.random.randint(0, w))


def test_our_mixup_with_flip_pairing_is_timms_for_the_same_lambda() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(6, 3, 10, 12, generator=g), torch.tensor([0, 1, 2, 3, 4, 0])
    timm_mix = Mixup(mixup_alpha=0.4, cutmix_alpha=0.0, label_smoothing=0.1, num_classes=5)
    for seed in range(10):
        np.random.seed(seed)
        xt, tt = timm_mix(x.clone(), y)
        lam, _, _ = _timm_draws(seed, 0.4, 10, 12, cut=False)
        lam_t = torch.tensor(lam, dtype=torch.float64)
        assert torch.equal(M.mix_images(x, lam_t.reshape(1, 1, 1, 1), flip_pairs=True), xt)
        assert torch.equal(M.mix_targets(y, 5, lam_t, 0.1, flip_pairs=True), tt)
    # and the loss: F.cross_entropy on soft targets is timm's SoftTargetCrossEntropy
    logits = torch.randn(6, 5, generator=g)
    torch.testing.assert_close(F.cross_entropy(logits, tt), SoftTargetCrossEntropy()(logits, tt))


def test_our_cutmix_and_timms_agree_for_even_box_sides_and_differ_by_one_for_odd() -> None:
    h, w = 20, 24
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(4, 3, h, w, generator=g), torch.tensor([0, 1, 2, 3])
    timm_mix = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=5)
    same = odd = 0
    for seed in range(40):
        np.random.seed(seed)
        xt, tt = timm_mix(x.clone(), y)
        lam, cy, cx = _timm_draws(seed, 1.0, h, w, cut=True)
        lam_t = torch.tensor(lam, dtype=torch.float64)
        box = M.cutmix_box(lam_t, torch.tensor(cy), torch.tensor(cx), h, w)
        xo = M.mix_images(x, M.box_weight(box, h, w), flip_pairs=True)
        to = M.mix_targets(y, 5, M.box_lambda(box, h, w), flip_pairs=True)
        cut_h, cut_w = int(h * np.sqrt(1 - lam)), int(w * np.sqrt(1 - lam))
        if cut_h % 2 == 0 and cut_w % 2 == 0:
            assert torch.equal(xo, xt) and torch.equal(to, tt)
            same += 1
        else:
            # timm's box: [cy - cut//2, cy + (cut + 1)//2); ours: [cy - cut//2, cy + cut//2), clipped alike
            grown = box.clone()
            grown[2] = min(h, cy + (cut_h + 1) // 2)
            grown[3] = min(w, cx + (cut_w + 1) // 2)
            assert torch.equal(M.mix_images(x, M.box_weight(grown, h, w), flip_pairs=True), xt)
            torch.testing.assert_close(M.mix_targets(y, 5, M.box_lambda(grown, h, w), flip_pairs=True), tt)
            odd += 1
    assert same > 3 and odd > 3
