"""Crop-box distributions against torchvision's ``RandomResizedCrop.get_params`` (two-sample KS tests), for
the device transforms' tests and the worker crops' tests."""

from __future__ import annotations

import torch
import torchvision.transforms as T
from scipy.stats import ks_2samp
from torch import Tensor


def torchvision_boxes(h: int, w: int, n: int, seed: int) -> Tensor:
    torch.manual_seed(seed)
    img = torch.empty(3, h, w)
    return torch.tensor([T.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)])


def box_stats(boxes: Tensor, h: int, w: int) -> dict[str, Tensor]:
    b = boxes.double()
    return {
        "scale": b[:, 2] * b[:, 3] / (h * w),
        "log_ratio": torch.log(b[:, 3] / b[:, 2]),
        "top": b[:, 0] / (h - b[:, 2] + 1),
        "left": b[:, 1] / (w - b[:, 3] + 1),
    }


def assert_same_distribution(ours: Tensor, theirs: Tensor, h: int, w: int) -> None:
    so, st = box_stats(ours, h, w), box_stats(theirs, h, w)
    for key in so:
        p = ks_2samp(so[key].numpy(), st[key].numpy()).pvalue
        assert p > 0.01, f"{key}: KS p-value {p:.3g} for a {h}x{w} image"
