"""Pixels: each sampled sample against torchvision's transform of its source file, as PSNR.

The reference for each fit, from the recipe (docs/FORMAT.md): ``crop`` is torchvision's ``Resize(S)`` +
``CenterCrop(S)`` on the PIL image; ``squash`` ``Resize((S, S))``; ``pad`` ``Resize`` to the letterbox and
zeros around it. ``antialias`` is PIL's bilinear (what torchvision does to PIL images), ``area`` PIL's box
filter when shrinking, ``linear`` torchvision's tensor bilinear with ``antialias=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loaders.parity.recipe import Recipe

__all__ = ["PixelResult", "letterbox", "psnr", "reference_pixels"]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float(10 * np.log10(255.0**2 / max(mse, 1e-10)))


def letterbox(h: int, w: int, s: int) -> tuple[int, int, int, int]:
    """``--fit pad``'s box as docs/FORMAT.md defines it: aspect kept, long side S, centred (y0, x0, y1, x1)."""
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    y0, x0 = (s - nh) // 2, (s - nw) // 2
    return y0, x0, y0 + nh, x0 + nw


def _resize(img: Any, hw: list[int], interpolation: str) -> np.ndarray:
    """torchvision's ``resize`` to ``hw`` ([S]: the short side to S, as ``Resize(S)``)."""
    import torch
    import torchvision.transforms.v2.functional as F
    from PIL import Image
    from torchvision.transforms import InterpolationMode

    if interpolation == "linear":
        t = torch.from_numpy(np.array(img)).permute(2, 0, 1)
        out = F.resize(t, hw, InterpolationMode.BILINEAR, antialias=False)
        return out.permute(1, 2, 0).numpy()
    mode = InterpolationMode.BILINEAR
    if interpolation == "area" and min(hw) <= min(img.height, img.width) and max(hw) <= max(img.height, img.width):
        mode = InterpolationMode.BOX  # shrinking; the build's area filter enlarges bilinearly
    return np.asarray(F.resize(img if isinstance(img, Image.Image) else Image.fromarray(img), hw, mode))


def reference_pixels(source: Any, recipe: Recipe) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """The S x S x 3 reference of one source image (PIL or uint8 array) and the box of its real pixels."""
    from PIL import Image

    img = source if isinstance(source, Image.Image) else Image.fromarray(np.asarray(source))
    s, w, h = recipe.size, img.width, img.height
    if recipe.fit == "squash":
        return _resize(img, [s, s], recipe.interpolation), (0, 0, s, s)
    if recipe.fit == "pad":
        y0, x0, y1, x1 = letterbox(h, w, s)
        out = np.zeros((s, s, 3), np.uint8)
        out[y0:y1, x0:x1] = _resize(img, [y1 - y0, x1 - x0], recipe.interpolation)
        return out, (y0, x0, y1, x1)
    import torch
    import torchvision.transforms.v2.functional as F

    big = torch.from_numpy(_resize(img, [s], recipe.interpolation).copy()).permute(2, 0, 1)  # Resize(S)
    return F.center_crop(big, [s, s]).permute(1, 2, 0).numpy(), (0, 0, s, s)  # CenterCrop(S)


@dataclass
class PixelResult:
    """PSNR of each checked sample; the worst ones kept for the contact sheet."""

    indices: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    box_mismatches: list[int] = field(default_factory=list)  # pad: stored box != the letterbox
    worst: list[tuple[float, int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (dB, index, ours, ref)

    def summary(self) -> dict[str, Any]:
        s = np.asarray(self.scores)
        return {"checked": len(s), "median_db": float(np.median(s)) if len(s) else None,
                "min_db": float(s.min()) if len(s) else None,
                "worst": [{"index": i, "psnr_db": round(float(p), 2)}
                          for p, i in sorted(zip(self.scores, self.indices, strict=True))[:8]],
                "box_mismatches": self.box_mismatches[:20]}
