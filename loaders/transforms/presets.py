"""Ready-made batch pipelines for ImageNet and CIFAR.

Every preset returns a :class:`~loaders.transforms.modules.Compose` that takes the uint8
(N, 3, H, W) batch from the loader (channels_last view of the NHWC cache, CPU or CUDA) and returns
a normalised channels_last batch of ``dtype`` (:class:`~loaders.transforms.modules.Normalize` says
which to pick). Run them with ``torch.compile(preset)`` (recommended) or eagerly; they also script.
"""

from __future__ import annotations

import torch

from .modules import CenterCrop, Compose, Normalize, RandomCrop, RandomResizedCrop, Resize

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "IMAGENET_MEAN", "IMAGENET_STD", "by_name", "cifar_eval", "cifar_train",
           "imagenet_eval", "imagenet_train", "resolve"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def imagenet_train(size: int = 224, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
                   antialias: bool = False) -> Compose:
    """Per-sample RandomResizedCrop(size) with a fused flip (p=0.5), then Normalize to ``dtype``.

    Pass the valid-image ``boxes`` of a ``--fit pad`` cache as ``preset(images, boxes)``.
    """
    return Compose(
        [
            RandomResizedCrop(size, flip_p=0.5, antialias=antialias, generator=generator),
            Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype=dtype),
        ]
    )


def imagenet_eval(size: int = 224, resize_size: int | None = None, dtype: torch.dtype = torch.float32) -> Compose:
    """Resize the shorter side to ``resize_size`` (default ``round(size / 0.875)``, 256 for 224),
    centre-crop ``size``, Normalize to ``dtype``. A cache already at ``resize_size`` skips the
    resampling (the resize is then a copy)."""
    resize_size = round(size / 0.875) if resize_size is None else resize_size
    return Compose([Resize(resize_size), CenterCrop(size), Normalize(IMAGENET_MEAN, IMAGENET_STD, dtype=dtype)])


def cifar_train(dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> Compose:
    """Per-sample RandomCrop(32, padding=4, zero fill) with a fused flip (p=0.5), Normalize."""
    return Compose(
        [
            RandomCrop(32, padding=4, flip_p=0.5, generator=generator),
            Normalize(CIFAR10_MEAN, CIFAR10_STD, dtype=dtype),
        ]
    )


def cifar_eval(dtype: torch.dtype = torch.float32) -> Compose:
    """Normalize only (CIFAR images are already 32x32)."""
    return Compose([Normalize(CIFAR10_MEAN, CIFAR10_STD, dtype=dtype)])


def resolve(name: str, shape: tuple[int, ...]) -> str:
    """``auto`` as ``cachebuild train --augment`` and ``show --augment`` read it: cifar for 32x32 samples, else
    imagenet; any other name as it is."""
    return name if name != "auto" else ("cifar" if tuple(shape[:2]) == (32, 32) else "imagenet")


def by_name(name: str, size: int, generator: torch.Generator | None = None) -> Compose:
    """The preset called ``name`` (``imagenet``, ``imagenet-eval``, ``cifar``, ``cifar-eval``) at ``size``."""
    if name == "imagenet":
        return imagenet_train(size, generator=generator)
    if name == "imagenet-eval":
        return imagenet_eval(size)
    if name == "cifar":
        return cifar_train(generator=generator)
    if name == "cifar-eval":
        return cifar_eval()
    raise ValueError(f"unknown preset {name!r}: imagenet, imagenet-eval, cifar or cifar-eval")
