"""A per-sample CPU transform (``DatasetOptions(transform=)``) and what it is given: ``transform_input``.

A cache's sample is a uint8 ``(H, W, 3)`` tensor, which no torchvision transform reads as an image: v1's
``ToTensor`` refuses it ("pic should be PIL Image or ndarray") and v2 takes its first axis for channels,
silently. So a torchvision transform says what it takes: ``'pil'`` (an RGB PIL image: an ImageFolder
pipeline runs unchanged, as slowly as it did), ``'chw'`` (a uint8 ``(3, H, W)`` tensor: v2 and v1 tensor
transforms), or ``'hwc'`` (the sample as it is). Left unsaid (None), the sample is given as ``'hwc'``, a
torchvision transform is refused when the options are made, and a transform that raises on a sample, or
returns an image whose axes hold no 3 channels, is a ``TypeError`` that names this option and docs/porting.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

__all__ = ["TRANSFORM_INPUTS", "TransformInput", "apply_transform", "check_transform"]

TransformInput = Literal["hwc", "chw", "pil"]
TRANSFORM_INPUTS: tuple[str, ...] = ("hwc", "chw", "pil")
_PAGE = "docs/porting.md#transforms"
_HOW = ("pass DatasetOptions(transform_input='pil') for a PIL pipeline (ToTensor, RandomResizedCrop on PIL images), "
        "'chw' for tensor transforms (torchvision v2), 'hwc' for the sample as it is; device transforms on the "
        f"batch are faster: {_PAGE}")


def _is_torchvision(transform: Any) -> bool:
    return type(transform).__module__.startswith("torchvision.transforms")


def check_transform(transform: Callable[..., Any] | None, transform_input: str | None) -> None:
    """ValueError for an unknown ``transform_input``, and for a torchvision transform left to get the default
    ``(H, W, 3)`` tensor (which it would misread or refuse)."""
    if transform_input is not None and transform_input not in TRANSFORM_INPUTS:
        raise ValueError(f"transform_input must be one of {', '.join(map(repr, TRANSFORM_INPUTS))} or None, got "
                         f"{transform_input!r}")
    if transform is not None and transform_input is None and _is_torchvision(transform):
        raise ValueError(f"DatasetOptions(transform={type(transform).__name__}(...)) is a torchvision transform, "
                         f"but a cache's samples are uint8 (H, W, 3) tensors, which it misreads or refuses: {_HOW}")


def apply_transform(transform: Callable[..., Any], img: torch.Tensor, transform_input: str | None) -> Any:
    """``transform`` of one sample ``img`` (uint8 ``(H, W, 3)``, or float32 after a normalizing worker crop),
    given as ``transform_input`` says (module docstring)."""
    if transform_input == "pil":
        from PIL import Image

        return transform(Image.fromarray(img.numpy().copy()))
    if transform_input == "chw":
        return transform(img.permute(2, 0, 1))
    if transform_input == "hwc":
        return transform(img)
    try:
        out = transform(img)
    except Exception as e:  # the user's transform: say what it was given, keep its error as the cause
        raise TypeError(f"DatasetOptions(transform=...) failed on a sample, which it is given as a uint8 (H, W, 3) "
                        f"torch.Tensor by default ({type(e).__name__}: {str(e)[:200]}): {_HOW}") from e
    if isinstance(out, torch.Tensor) and out.ndim == 3 and 3 not in (out.shape[0], out.shape[-1]):
        raise TypeError(f"DatasetOptions(transform=...) turned a {tuple(img.shape)} sample into {tuple(out.shape)}: "
                        f"it read the (H, W, 3) sample's axes as another layout; {_HOW}")
    return out
