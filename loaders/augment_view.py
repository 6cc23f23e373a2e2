"""What the device transforms make of a batch, back as uint8 pixels: ``cachebuild show --augment``.

Runs a preset of :mod:`loaders.transforms.presets` on the CPU on the stored uint8 batch (boxes of a
``--fit pad`` cache included), then undoes the preset's ``Normalize`` so the result can be looked at.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["PRESETS", "augment_view", "preset_name"]

PRESETS = ("auto", "imagenet", "imagenet-eval", "cifar", "cifar-eval")


def preset_name(preset: str, shape: tuple[int, int, int]) -> str:
    """``auto`` as ``cachebuild train --augment auto`` reads it: cifar for 32x32 caches, else imagenet."""
    if preset != "auto":
        return preset
    return "cifar" if shape[:2] == (32, 32) else "imagenet"


def augment_view(preset: str, shape: tuple[int, int, int], crop: int | None = None,
                 seed: int = 0) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """A function stored uint8 (N, H, W, 3) [+ boxes (N, 4)] -> the preset's output as uint8 (N, h, w, 3)."""
    import torch

    from loaders.transforms import presets
    from loaders.transforms.modules import Normalize

    name = preset_name(preset, shape)
    size = crop or shape[0]
    gen = torch.Generator().manual_seed(seed)
    pipeline = {
        "imagenet": lambda: presets.imagenet_train(size, generator=gen),
        "imagenet-eval": lambda: presets.imagenet_eval(size),
        "cifar": lambda: presets.cifar_train(generator=gen),
        "cifar-eval": lambda: presets.cifar_eval(),
    }[name]()
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
