"""Batched JPEG decoding through ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA devices, libjpeg on CPU).

torchvision 0.29 deprecates its image codecs in favour of TorchCodec (and warns on every call); they
still work, they are what the pinned torch stack ships, and TorchCodec is not a dependency. The warning
is silenced here, for these calls only. Imported only by the GPU paths and their tests.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["decode_jpegs"]


def decode_jpegs(data: Any, device: Any) -> Any:
    """``decode_jpeg(data, mode=RGB, device=device)``: a 1-D uint8 CPU tensor, or a list of them (one
    batched nvJPEG call on CUDA), to (3, H, W) uint8 tensor(s) on ``device``. EXIF orientation ignored."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
