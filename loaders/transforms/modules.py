# ruff: noqa: UP006, UP035, UP045 - typing.List/Optional keep these TorchScript-compilable on older torch
"""``nn.Module`` batch transforms that draw every random parameter per sample.

A torchvision v1 ``RandomHorizontalFlip`` on a 4-D batch tosses one coin for the whole batch; every module
here draws one set of parameters per sample, vectorised, then calls a kernel of
:mod:`loaders.transforms.functional`. ``generator=torch.Generator(device).manual_seed(s)`` gives a private
stream (drawn on its device and moved to the images', so a CPU generator drives a CUDA batch with the CPU's
draws); None draws from the global RNG of the images' device. ``torch.compile(module)`` is the recommended
path; every module also scripts (``torch.jit.script``, deprecated from torch 2.14), which is why the
generator's device is kept as a string (TorchScript cannot read ``Generator.device``).
"""

import math
from collections.abc import Sequence
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import functional as TF

__all__ = ["BatchTransform", "CenterCrop", "Compose", "Normalize", "RandomCrop", "RandomHorizontalFlip",
           "RandomResizedCrop", "Resize"]


def _size_pair(size: int | Sequence[int], name: str = "size") -> List[int]:
    if isinstance(size, bool) or not isinstance(size, (int, Sequence)):
        raise TypeError(f"{name}: expected an int or a sequence of 1 or 2 ints, got {type(size).__name__}")
    vals = [size, size] if isinstance(size, int) else list(size)
    if len(vals) == 1:
        vals = [vals[0], vals[0]]
    if len(vals) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise TypeError(f"{name}: expected an int or a sequence of 1 or 2 ints, got {size!r}")
    if vals[0] <= 0 or vals[1] <= 0:
        raise ValueError(f"{name}: expected sizes > 0, got {size!r}")
    return [int(vals[0]), int(vals[1])]


def _ordered_pair(vals: Sequence[float], name: str) -> Tuple[float, float]:
    if not isinstance(vals, Sequence) or len(vals) != 2:
        raise TypeError(f"{name}: expected a (min, max) pair of floats, got {vals!r}")
    lo, hi = float(vals[0]), float(vals[1])
    if not (0.0 < lo <= hi) or not math.isfinite(hi):
        raise ValueError(f"{name}: expected (min, max) with 0 < min <= max, got {tuple(vals)!r}")
    return lo, hi


def _probability(p: float, name: str) -> float:
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{name}: expected a probability in [0, 1], got {p!r}")
    return float(p)


class BatchTransform(nn.Module):
    """Base class: holds the optional generator and draws uniforms with it.

    ``geometric`` tells :class:`Compose` that the transform moves pixels, so the valid-image boxes
    of a padded cache no longer apply after it.
    """

    generator: Optional[torch.Generator]

    def __init__(self, generator: Optional[torch.Generator] = None, geometric: bool = False) -> None:
        super().__init__()
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        # TorchScript cannot read Generator.device: record it ("" = draw on the images' device).
        self.draw_device = "" if generator is None else str(generator.device)
        self.geometric = geometric

    def _rand(self, n: int, k: int, device: torch.device) -> Tensor:
        """(n, k) float32 uniforms in [0, 1), drawn in one call, moved to ``device``."""
        dev = device if self.draw_device == "" else torch.device(self.draw_device)
        gen = self.generator
        if gen is None:  # no generator= at all: torch.compile fails on generator=None once the batch size varies
            return torch.rand([n, k], device=dev, dtype=torch.float32).to(device)
        return torch.rand([n, k], generator=gen, device=dev, dtype=torch.float32).to(device)

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:  # pragma: no cover
        raise NotImplementedError


class RandomResizedCrop(BatchTransform):
    """Per-sample ``RandomResizedCrop`` (+ an optional fused horizontal flip) of a uint8/float batch.

    Boxes follow torchvision's ``RandomResizedCrop.get_params`` exactly in distribution (10 tries of scale and
    log-ratio per sample at once, the first valid one kept, else the central fallback). Resampling is bilinear,
    ``antialias=False`` by default (torchvision's ``resized_crop(..., antialias=False)``).
    ``forward(images, boxes=None)``: ``boxes`` (N, 4) integer ``(y0, x0, y1, x1)``, end-exclusive, the real
    image inside each padded sample (``--fit pad``); crops are drawn inside it. The same class says what the
    loader's workers crop (``DatasetOptions(crop=...)``, ``loaders.worker_crop``).
    """

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0), flip_p: float = 0.0, antialias: bool = False,
                 method: str = "auto", generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator, geometric=True)
        self.size = _size_pair(size)
        self.scale_lo, self.scale_hi = _ordered_pair(scale, "scale")
        self.ratio_lo, self.ratio_hi = _ordered_pair(ratio, "ratio")
        self.log_ratio_lo = math.log(self.ratio_lo)
        self.log_ratio_hi = math.log(self.ratio_hi)
        self.flip_p = _probability(flip_p, "flip_p")
        self.antialias = bool(antialias)
        if method not in ("auto", "batched", "per_sample"):
            raise ValueError(f"method: expected 'auto', 'batched' or 'per_sample', got {method!r}")
        self.method = method

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, scale=({self.scale_lo}, {self.scale_hi}), "
            f"ratio=({self.ratio_lo:.4f}, {self.ratio_hi:.4f}), flip_p={self.flip_p}, "
            f"antialias={self.antialias}, method={self.method!r}"
        )

    @torch.jit.export
    def get_params(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Draw per-sample crops (N, 4) int64 (top, left, height, width) in image coordinates and
        flips (N,) bool, on the images' device."""
        TF.check_images(images)
        n, height, width = images.shape[0], images.shape[2], images.shape[3]
        dev = images.device
        if boxes is None:
            y0 = torch.zeros([n], dtype=torch.int64, device=dev)
            x0 = torch.zeros([n], dtype=torch.int64, device=dev)
            hh = torch.full([n], height, dtype=torch.int64, device=dev)
            ww = torch.full([n], width, dtype=torch.int64, device=dev)
        else:
            if boxes.is_floating_point() or boxes.dtype == torch.bool:
                raise TypeError(f"boxes: expected an integer tensor, got dtype {boxes.dtype}")
            if boxes.dim() != 2 or boxes.shape[0] != n or boxes.shape[1] != 4:
                raise ValueError(f"boxes: expected shape [{n}, 4] of (y0, x0, y1, x1), got {list(boxes.shape)}")
            b = boxes.to(device=dev, dtype=torch.int64)
            y0 = b[:, 0].clamp(0, height - 1)
            x0 = b[:, 1].clamp(0, width - 1)
            hh = (b[:, 2].clamp(max=height) - y0).clamp_min(1)
            ww = (b[:, 3].clamp(max=width) - x0).clamp_min(1)
        # One draw for everything: 10 scale tries, 10 ratio tries, top, left, flip.
        u = self._rand(n, 23, dev).to(torch.float64)
        h_f = hh.to(torch.float64)
        w_f = ww.to(torch.float64)
        target_area = (h_f * w_f)[:, None] * (self.scale_lo + (self.scale_hi - self.scale_lo) * u[:, 0:10])
        aspect = torch.exp(self.log_ratio_lo + (self.log_ratio_hi - self.log_ratio_lo) * u[:, 10:20])
        # torch.round rounds half to even, as Python's round() in torchvision does.
        cw = torch.round(torch.sqrt(target_area * aspect)).to(torch.int64)
        ch = torch.round(torch.sqrt(target_area / aspect)).to(torch.int64)
        valid = (cw > 0) & (cw <= ww[:, None]) & (ch > 0) & (ch <= hh[:, None])
        first = valid.to(torch.int64).argmax(dim=1, keepdim=True)  # first valid try (argmax: first max)
        found = valid.any(dim=1)
        # torchvision's fallback: the central crop of the largest box with a ratio in range.
        in_ratio = w_f / h_f
        too_tall = in_ratio < self.ratio_lo
        too_wide = in_ratio > self.ratio_hi
        fb_h = torch.where(too_tall, torch.round(w_f / self.ratio_lo).to(torch.int64), hh)
        fb_w = torch.where(too_wide, torch.round(h_f * self.ratio_hi).to(torch.int64), ww)
        crop_h = torch.where(found, ch.gather(1, first).squeeze(1), fb_h)
        crop_w = torch.where(found, cw.gather(1, first).squeeze(1), fb_w)
        # randint(0, H - h + 1) as floor(u * (H - h + 1)); the clamp guards u -> 1 rounding.
        span_h = hh - crop_h
        span_w = ww - crop_w
        rand_top = torch.minimum(torch.floor(u[:, 20] * (span_h + 1).to(torch.float64)).to(torch.int64), span_h)
        rand_left = torch.minimum(torch.floor(u[:, 21] * (span_w + 1).to(torch.float64)).to(torch.int64), span_w)
        top = torch.where(found, rand_top, torch.div(span_h, 2, rounding_mode="floor"))
        left = torch.where(found, rand_left, torch.div(span_w, 2, rounding_mode="floor"))
        crops = torch.stack([y0 + top, x0 + left, crop_h, crop_w], dim=1)
        flips = u[:, 22] < self.flip_p
        return crops, flips

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        crops, flips = self.get_params(images, boxes)
        return TF.resized_crop(
            images, crops, self.size, flips if self.flip_p > 0.0 else None, self.antialias, self.method
        )


class RandomHorizontalFlip(BatchTransform):
    """Mirror each sample with probability ``p``, one coin per sample (not one per batch)."""

    def __init__(self, p: float = 0.5, generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator, geometric=True)
        self.p = _probability(p, "p")

    def extra_repr(self) -> str:
        return f"p={self.p}"

    @torch.jit.export
    def get_params(self, images: Tensor) -> Tensor:
        """(N,) bool: which samples to mirror."""
        return self._rand(images.shape[0], 1, images.device)[:, 0] < self.p

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        TF.check_images(images)
        return TF.horizontal_flip(images, self.get_params(images))


class RandomCrop(BatchTransform):
    """CIFAR-style per-sample ``RandomCrop(size, padding)`` with zero fill (torchvision's default
    ``fill=0``), plus an optional fused horizontal flip (``flip_p``). ``boxes`` are ignored."""

    def __init__(self, size: int | Sequence[int], padding: int = 0, flip_p: float = 0.0,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(generator, geometric=True)
        self.size = _size_pair(size)
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding: expected an int >= 0, got {padding!r}")
        self.padding = padding
        self.flip_p = _probability(flip_p, "flip_p")

    def extra_repr(self) -> str:
        return f"size={self.size}, padding={self.padding}, flip_p={self.flip_p}"

    @torch.jit.export
    def get_params(self, images: Tensor) -> Tuple[Tensor, Tensor]:
        """(N, 2) int64 offsets (top, left) in padded coordinates, and (N,) bool flips."""
        TF.check_images(images)
        n = images.shape[0]
        span_h = images.shape[2] + 2 * self.padding - self.size[0]
        span_w = images.shape[3] + 2 * self.padding - self.size[1]
        if span_h < 0 or span_w < 0:
            raise ValueError(
                f"size: expected at most the padded image "
                f"{[images.shape[2] + 2 * self.padding, images.shape[3] + 2 * self.padding]}, got {self.size}"
            )
        u = self._rand(n, 3, images.device).to(torch.float64)
        top = torch.floor(u[:, 0] * (span_h + 1)).to(torch.int64).clamp_max(span_h)
        left = torch.floor(u[:, 1] * (span_w + 1)).to(torch.int64).clamp_max(span_w)
        return torch.stack([top, left], dim=1), u[:, 2] < self.flip_p

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        offsets, flips = self.get_params(images)
        return TF.padded_crop(images, offsets, self.size, self.padding, flips if self.flip_p > 0.0 else None)


class CenterCrop(BatchTransform):
    """Evaluation centre crop (torchvision ``CenterCrop``); ``boxes`` are ignored."""

    def __init__(self, size: int | Sequence[int]) -> None:
        super().__init__(None, geometric=True)
        self.size = _size_pair(size)

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        return TF.center_crop(images, self.size)


class Resize(BatchTransform):
    """Evaluation bilinear resize; an int or a 1-element sequence resizes the shorter side, keeping the
    aspect ratio (torchvision's rule); ``[h, w]`` resizes to exactly that.
    ``antialias=True`` by default, as torchvision v2. ``boxes`` are ignored."""

    def __init__(self, size: int | Sequence[int], antialias: bool = True) -> None:
        super().__init__(None, geometric=True)
        if isinstance(size, Sequence) and len(size) == 1:
            size = size[0]  # torchvision's Resize([s]) is Resize(s), not a square [s, s]
        if isinstance(size, int) and not isinstance(size, bool):
            if size <= 0:
                raise ValueError(f"size: expected > 0, got {size}")
            self.size = [size]
        else:
            self.size = _size_pair(size)
        self.antialias = bool(antialias)

    def extra_repr(self) -> str:
        return f"size={self.size}, antialias={self.antialias}"

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        return TF.resize(images, self.size, self.antialias)


class Normalize(BatchTransform):
    """uint8 -> ``dtype`` conversion fused with ``(x / 255 - mean) / std``, channels_last output.

    ``mean``/``std`` in 0-1 units as torchvision's ``Normalize``. ``dtype`` is float32 by default
    (what torchvision produces; autocast casts inside the model); bfloat16/float16 halve the bytes
    written and read by the first layer when the model runs in that dtype anyway.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(None, geometric=False)
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean/std: expected 3 values each, got {list(mean)!r} and {list(std)!r}")
        if any(float(s) <= 0 for s in std):
            raise ValueError(f"std: expected all values > 0, got {list(std)!r}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"dtype: expected float32, bfloat16, float16 or float64, got {dtype}")
        self.mean = [float(m) for m in mean]
        self.std = [float(s) for s in std]
        self.dtype = dtype

    def extra_repr(self) -> str:
        return f"mean={self.mean}, std={self.std}, dtype={self.dtype}"

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        return TF.normalize(images, self.mean, self.std, self.dtype)


class Compose(nn.Module):
    """Apply batch transforms in order: ``forward(images, boxes=None)``.

    ``boxes`` (the valid region of each padded sample) are handed to every transform up to and
    including the first geometric one, then dropped, since pixels have moved.
    """

    def __init__(self, transforms: Sequence[nn.Module]) -> None:
        super().__init__()
        for t in transforms:
            if not isinstance(t, BatchTransform):
                raise TypeError(
                    f"transforms: expected loaders.transforms modules (BatchTransform), got {type(t).__name__}"
                )
        self.transforms = nn.ModuleList(transforms)

    def forward(self, images: Tensor, boxes: Optional[Tensor] = None) -> Tensor:
        for t in self.transforms:
            images = t(images, boxes)
            if t.geometric:
                boxes = None
        return images
