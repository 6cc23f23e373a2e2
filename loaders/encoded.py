"""Batches of stored JPEGs handed over undecoded, to be decoded where the batch lands (nvJPEG on a GPU).

Under ``DatasetOptions(decode="none")`` (what ``device_loader(dl, decode="cuda")`` sets) a compact cache's
workers read and checksum each sample's stored bytes and hand them over as one :class:`EncodedImages`, a
fraction of the pixels' bytes; on CUDA :func:`loaders.cuda_decode.decode_on_cuda` decodes the batch with
nvJPEG, elsewhere the cache's CPU decoder does (the same pixels). CUDA code is imported only on CUDA.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

__all__ = ["EncodedImages"]


class EncodedImages:
    """``len(offsets) - 1`` encoded samples back to back in ``data`` (uint8), each decoding to ``shape``; crosses
    processes as a tensor pair and is pinned by ``pin_memory=True`` through :meth:`pin_memory`."""

    __slots__ = ("codec", "data", "offsets", "shape")

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, shape: tuple[int, ...],
                 codec: str = "jpeg") -> None:
        self.data = data
        self.offsets = offsets
        self.shape: tuple[int, ...] = tuple(shape)
        self.codec = codec

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __repr__(self) -> str:
        return f"EncodedImages({len(self)} x {self.codec} {list(self.shape)}, {int(self.data.numel())} bytes)"

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sample ``i``'s stored bytes (a 1-D uint8 view of ``data``): what ``default_collate`` looks at to
        find a :class:`~loaders.collate.CacheBatch`'s sample type."""
        k = range(len(self))[i]  # IndexError past the end, negative indices as for a list
        return self.data[int(self.offsets[k]) : int(self.offsets[k + 1])]

    def pin_memory(self, device: Any = None) -> EncodedImages:
        return EncodedImages(self.data.pin_memory(), self.offsets, self.shape, self.codec)

    def payloads(self) -> list[torch.Tensor]:
        """One 1-D uint8 tensor per sample: views of ``data``, no copy."""
        cuts = self.offsets.tolist()
        return [self.data[a:z] for a, z in itertools.pairwise(cuts)]

    def decode(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The batch decoded on ``device``: uint8 (B, 3, H, W), a channels_last view of NHWC storage, as
        ``device_loader`` delivers raw batches."""
        device = torch.device(device)
        if self.codec != "jpeg":
            raise ValueError(f"cannot decode {self.codec!r} samples: this release decodes jpeg")
        if device.type == "cuda":
            if not torch.cuda.is_available():  # before importing the nvJPEG path, which dies deep in torchvision
                raise RuntimeError(f"cannot decode stored JPEGs on {device}: CUDA is not available here; "
                                   f"decode on the CPU (device='cpu', or DatasetOptions(decode='cpu'))")
            from loaders.cuda_decode import decode_on_cuda

            return decode_on_cuda(self.payloads(), self.shape, device)
        from cachebuild.storage.kinds.jpeg import decode_into

        out = np.empty((len(self), *self.shape), dtype=np.uint8)
        data = self.data.numpy()
        for k, (a, z) in enumerate(itertools.pairwise(self.offsets.tolist())):
            decode_into(data[a:z], out[k])
        return torch.from_numpy(out).to(device).permute(0, 3, 1, 2)
