"""What the device transforms make of a batch, back as uint8 pixels: ``cachebuild show --augment``.

Runs a preset of :mod:`loaders.transforms.presets` on the CPU on the stored uint8 batch (boxes of a
``--fit pad`` cache included), then undoes the preset's ``Normalize`` so the result can be looked at.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["PRESETS", "augment_view"]

PRESETS = ("auto", "imagenet", "imagenet-eval", "cifar", "cifar-eval")


def augment_view(preset: str, shape: tuple[int, int, int], crop: int | None = None,
                 seed: int = 0) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """A function stored uint8 (N, H, W, 3) [+ boxes (N, 4)] -> the preset's output as uint8 (N, h, w, 3)."""
    import torch

    from loaders.transforms import presets
    from loaders.transforms.modules import Normalize

    size = crop or shape[0]
    pipeline = presets.by_name(presets.resolve(preset, shape), size, torch.Generator().manual_seed(seed))
    norm = next(t for t in pipeline.transforms if isinstance(t, Normalize))
    mean = torch.tensor(norm.mean).view(1, 3, 1, 1)
    std = torch.tensor(norm.std).view(1, 3, 1, 1)

    def run(stored: np.ndarray, boxes: np.ndarray | None) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(stored)).permute(0, 3, 1, 2)  # channels_last NCHW, no copy
        with torch.no_grad():
            y = pipeline(x, torch.from_numpy(boxes.astype(np.int64)) if boxes is not None else None)
            pixels = ((y.float() * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).contiguous().numpy()

    return run
