"""``device_loader``: a DataLoader's batches on the training device.

uint8 NHWC batches (pinned by ``pin_memory=True``) are copied with ``non_blocking=True`` and viewed as NCHW by
``permute(0, 3, 1, 2)``, which for an NHWC tensor *is* channels_last NCHW (no copy). On CUDA the copy of
batch ``k+1`` runs on a side stream while the loop works on batch ``k`` (timm's ``PrefetchLoader``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from loaders.dataset import CacheBatch, CachedImageDataset
from loaders.encoded import EncodedImages

__all__ = ["DeviceLoader", "device_loader", "to_device"]


def __getattr__(name: str) -> Any:
    if name == "FastLoader":  # a removed loader's home in an earlier release: the error that names the DataLoader way
        import loaders

        return getattr(loaders, name)
    raise AttributeError(f"module 'loaders.device' has no attribute {name!r}")


def _as_tuple(batch: Any) -> tuple[Any, ...]:
    if isinstance(batch, CacheBatch):
        return batch.as_tuple()
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    return (batch,)


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = True, nchw: bool = True) -> tuple[Any, ...]:
    """Move ``(x, y[, boxes])`` to ``device``; a 4-D ``x`` (NHWC) becomes its NCHW channels_last view."""
    items = _as_tuple(batch)
    out = []
    for k, t in enumerate(items):
        if isinstance(t, EncodedImages):  # a compact cache's stored JPEGs: decoded where they land
            t = t.decode(device)
            out.append(t if nchw else t.permute(0, 2, 3, 1))
            continue
        if isinstance(t, torch.Tensor):
            t = t.to(device, non_blocking=non_blocking)
            if k == 0 and nchw and t.ndim == 4:
                t = t.permute(0, 3, 1, 2)  # NHWC storage seen as NCHW: channels_last, no copy
        out.append(t)
    return tuple(out)


def _record(items: tuple[Any, ...], stream: torch.cuda.Stream) -> None:
    # Tensors allocated on the side stream are used on the main one: tell the caching allocator.
    for t in items:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


class DeviceLoader:
    """Iterable over ``loader``'s batches on ``device``; see :func:`device_loader`."""

    def __init__(self, loader: Iterable[Any], device: torch.device | str = "cuda", non_blocking: bool = True,
                 nchw: bool = True, decode: str = "cpu") -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.non_blocking = non_blocking
        self.nchw = nchw
        if decode not in ("cpu", "cuda"):
            raise ValueError(f"decode must be 'cpu' or 'cuda', got {decode!r}")
        if decode == "cuda" and (self.device.type != "cuda" or not torch.cuda.is_available()):
            raise ValueError(f"decode='cuda' decodes on a CUDA device, and this one is {self.device} "
                             f"(CUDA available: {torch.cuda.is_available()}); use decode='cpu'")
        if decode == "cuda":  # TorchCodec's nvJPEG decoder, an optional extra: missing, one line now, not a batch in
            from cachebuild.storage.kinds.jpeg import jpeg_batch_decoder

            jpeg_batch_decoder()
        self.decode = decode

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        dataset = self.dataset
        if self.decode == "cuda" and isinstance(dataset, CachedImageDataset):
            # Workers started from here on hand over the stored JPEGs; persistent workers started earlier
            # still send pixels, which go through as they are.
            dataset.decode = "none"
        if self.device.type == "cuda" and torch.cuda.is_available():
            return self._iter_cuda()
        return (to_device(b, self.device, self.non_blocking, self.nchw) for b in self.loader)

    def _iter_cuda(self) -> Iterator[tuple[Any, ...]]:
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        it = iter(self.loader)
        try:
            first = next(it)
        except StopIteration:
            return
        with torch.cuda.stream(side):
            nxt = to_device(first, self.device, self.non_blocking, self.nchw)
        for batch in it:
            main.wait_stream(side)
            cur = nxt
            _record(cur, main)
            with torch.cuda.stream(side):  # next copy overlaps the loop's work on `cur`
                nxt = to_device(batch, self.device, self.non_blocking, self.nchw)
            yield cur
        main.wait_stream(side)
        _record(nxt, main)
        yield nxt


def device_loader(loader: Iterable[Any], device: torch.device | str = "cuda", non_blocking: bool = True,
                  nchw: bool = True, decode: str = "cpu") -> DeviceLoader:
    """Yield ``(x, y[, boxes])`` on ``device``, x uint8 NCHW (a channels_last view of the NHWC batch), once per
    iteration (every epoch), with ``len(loader)``. Pass ``pin_memory=True`` to the loader so that the copies
    are asynchronous. ``decode="cuda"`` (compact caches, on CUDA): the loader's dataset is set to
    ``decode="none"``, so its workers send the stored JPEGs (checksummed), decoded on the GPU by nvJPEG through
    TorchCodec (``pip install 'cachebuild[torchcodec]'``; without it, a one-line error here)."""
    return DeviceLoader(loader, device, non_blocking, nchw, decode)
