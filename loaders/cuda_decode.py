"""nvJPEG batch decode of a compact cache's samples on a CUDA device (imported only there).

TorchCodec's ``decode_jpeg(list_of_tensors, device="cuda")`` (the optional extra ``torchcodec``:
``cachebuild.storage.kinds.jpeg.decode_jpegs``) decodes the whole list in one batched nvJPEG call; the host has
sent only the compressed bytes. Each sample's crc32 was already checked by the DataLoader worker that read it, so a
damaged sample never reaches the GPU.
"""

from __future__ import annotations

import torch

__all__ = ["decode_on_cuda"]


def decode_on_cuda(payloads: list[torch.Tensor], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Decode JPEGs (1-D uint8 CPU tensors, pinned for a fast copy) on ``device``: uint8 (B, 3, H, W), a
    channels_last view of NHWC storage."""
    from cachebuild.storage.kinds.jpeg import decode_jpegs

    h, w, _ = shape
    if not payloads:
        return torch.empty((0, h, w, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
    images = decode_jpegs(payloads, device)
    for k, im in enumerate(images):
        if tuple(im.shape) != (3, h, w):
            raise ValueError(f"sample {k} of the batch decodes to {list(im.shape)} on {device}, the cache's "
                             f"samples are [3, {h}, {w}]")
    # One stacking copy into NHWC storage; its NCHW view is channels_last, like raw batches.
    return torch.stack([im.permute(1, 2, 0) for im in images]).permute(0, 3, 1, 2)
