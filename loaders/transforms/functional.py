# ruff: noqa: UP006, UP035, UP045 - typing.List/Optional keep these TorchScript-compilable on older torch
"""Pure batch kernels on ``(N, C, H, W)`` image tensors.

Each kernel takes per-sample parameters as tensors with a leading ``N`` (the modules of
:mod:`loaders.transforms.modules` draw them), never mutates its input, keeps device and (but
:func:`normalize`) dtype, and returns channels_last (what ``x.permute(0, 3, 1, 2)`` of the cache's NHWC batch
is, and what convnets want). Annotated for TorchScript, run under ``torch.compile`` (recommended).
Interpolation is torchvision's (crop, then bilinear with half-pixel centres): sampling never reads outside
the crop box.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["center_crop", "check_images", "horizontal_flip", "normalize", "padded_crop", "resize", "resized_crop"]


def check_images(images: Tensor, name: str = "images") -> None:
    """Raise TypeError/ValueError unless ``images`` is a (N, 3, H, W) uint8 or floating tensor."""
    if images.dtype != torch.uint8 and not images.is_floating_point():
        raise TypeError(f"{name}: expected a torch.uint8 or floating-point tensor, got dtype {images.dtype}")
    if images.dim() != 4:
        raise ValueError(
            f"{name}: expected a batch of shape (N, 3, H, W) (4 dims), got shape {list(images.shape)} "
            f"({images.dim()} dims); add a batch dimension with x[None] for one image"
        )
    if images.shape[1] != 3:
        raise ValueError(
            f"{name}: expected 3 channels in dim 1 of (N, 3, H, W), got shape {list(images.shape)}; "
            "an NHWC batch must be permuted first: x.permute(0, 3, 1, 2)"
        )
    if images.shape[2] <= 0 or images.shape[3] <= 0:
        raise ValueError(f"{name}: expected H > 0 and W > 0, got shape {list(images.shape)}")


def _check_size(size: List[int]) -> None:
    if len(size) != 2 or size[0] <= 0 or size[1] <= 0:
        raise ValueError(f"size: expected [height, width] with both > 0, got {size}")


def _check_per_sample(t: Tensor, n: int, cols: int, name: str) -> None:
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] != cols:
        raise ValueError(f"{name}: expected shape [{n}, {cols}], got {list(t.shape)}")


def _check_flips(flips: Optional[Tensor], n: int) -> None:
    if flips is not None and (flips.dtype != torch.bool or flips.dim() != 1 or flips.shape[0] != n):
        raise ValueError(
            f"flips: expected a bool tensor of shape [{n}], got {flips.dtype} of shape {list(flips.shape)}"
        )


def _empty_like_batch(images: Tensor, n: int, h: int, w: int) -> Tensor:
    return torch.empty((n, images.shape[1], h, w), dtype=images.dtype, device=images.device).contiguous(
        memory_format=torch.channels_last
    )


def _from_float(x: Tensor, dtype: torch.dtype) -> Tensor:
    # uint8 results are rounded half to even and saturated, as torchvision does on float paths.
    if dtype == torch.uint8:
        return x.round().clamp_(0, 255).to(torch.uint8)
    return x.to(dtype)


def _interpolate(x: Tensor, size: List[int], antialias: bool) -> Tensor:
    """Bilinear resize of a (n, C, h, w) tensor, any dtype, torchvision semantics."""
    if x.dtype == torch.float32 or x.dtype == torch.float64 or (x.dtype == torch.uint8 and x.device.type == "cpu"):
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=antialias)
    # Only the CPU has uint8 bilinear kernels, and half types resample in float32: go through it and round back.
    y = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=antialias)
    return _from_float(y, x.dtype)


# --------------------------------------------------------------------------------------------------
# resized crop (RandomResizedCrop kernel), with a fused per-sample horizontal flip


def _axis_tables(start: Tensor, length: Tensor, out: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Source indices (i0, i1) and weight of i1 for a half-pixel-centre bilinear resize of the
    per-sample window [start, start + length) to ``out`` samples; indices stay inside the window,
    as when the window is cropped first (torchvision's ``resized_crop``)."""
    o = torch.arange(out, device=start.device, dtype=torch.float32)
    length_f = length.to(torch.float32)[:, None]
    src = ((o[None, :] + 0.5) * (length_f / out) - 0.5).clamp_min(0.0)
    i0 = src.floor()
    lam = src - i0
    last = (length - 1)[:, None]
    i0l = torch.minimum(i0.to(torch.int64), last)
    i1l = torch.minimum(i0l + 1, last)
    return i0l + start[:, None], i1l + start[:, None], lam


def _resized_crop_batched(images: Tensor, crops: Tensor, size: List[int], flips: Optional[Tensor]) -> Tensor:
    # One batched separable resample: gather 2 rows per output row (index_select on the NHWC rows,
    # a memcpy), blend, then gather 2 columns per output column, blend. Flip = reversed column table.
    n, c, h, w = images.shape
    oh, ow = size[0], size[1]
    crops = crops.to(device=images.device, dtype=torch.int64)
    y0, y1, ly = _axis_tables(crops[:, 0], crops[:, 2], oh)
    x0, x1, lx = _axis_tables(crops[:, 1], crops[:, 3], ow)
    if flips is not None:
        f = flips.to(images.device)[:, None]
        x0 = torch.where(f, x0.flip(1), x0)
        x1 = torch.where(f, x1.flip(1), x1)
        lx = torch.where(f, lx.flip(1), lx)
    rows = images.permute(0, 2, 3, 1).reshape(n * h, w * c)
    base = (torch.arange(n, device=images.device, dtype=torch.int64) * h)[:, None]
    r0 = rows.index_select(0, (y0 + base).reshape(-1)).view(n, oh, w, c).to(torch.float32)
    r1 = rows.index_select(0, (y1 + base).reshape(-1)).view(n, oh, w, c).to(torch.float32)
    t = torch.lerp(r0, r1, ly[:, :, None, None])
    ix0 = x0[:, None, :, None].expand(n, oh, ow, c)
    ix1 = x1[:, None, :, None].expand(n, oh, ow, c)
    out = torch.lerp(t.gather(2, ix0), t.gather(2, ix1), lx[:, None, :, None])
    return _from_float(out, images.dtype).permute(0, 3, 1, 2)


def _resized_crop_per_sample(
    images: Tensor, crops: Tensor, size: List[int], flips: Optional[Tensor], antialias: bool
) -> Tensor:
    # One interpolate call per sample on a crop view: on CPU, torch's uint8 channels_last bilinear kernel
    # (separable, int16 SIMD) beats any batched float resample. Mirroring the crop before resizing equals
    # mirroring the result (the half-pixel grid is symmetric) and beats a copy into a preallocated output.
    n = images.shape[0]
    params: List[List[int]] = crops.tolist()
    flip_list: List[int] = [0] * n
    if flips is not None:
        as_list: List[int] = flips.to(torch.int64).tolist()  # TorchScript needs the annotation
        flip_list = as_list
    outs: List[Tensor] = []
    for i in range(n):
        top, left, h, w = params[i][0], params[i][1], params[i][2], params[i][3]
        crop = images[i : i + 1, :, top : top + h, left : left + w]
        if flip_list[i] != 0:
            crop = crop.flip(-1)
        outs.append(_interpolate(crop, size, antialias))
    return torch.cat(outs).contiguous(memory_format=torch.channels_last)


# torch.compile would trace the Python loop with data-dependent slices (graph breaks, recompiles);
# run it eagerly instead. TorchScript never sees the wrapper (is_scripting() branches are pruned).
_resized_crop_per_sample_eager = torch.compiler.disable(_resized_crop_per_sample)


def resized_crop(images: Tensor, crops: Tensor, size: List[int], flips: Optional[Tensor] = None,
                 antialias: bool = False, method: str = "auto") -> Tensor:
    """Crop each sample to its box and resize it to ``size`` (bilinear), optionally mirrored.

    ``crops``: (N, 4) integer (top, left, height, width), torchvision's ``(i, j, h, w)``, clipped so every box
    holds a pixel. ``flips``: optional (N,) bool, fused (the column table reversed). ``antialias``: False is
    torchvision's ``resized_crop(..., antialias=False)``, True its ``antialias=True`` (``per_sample`` only).
    ``method``: ``"batched"`` (one gather-based resample: any device, compile-friendly), ``"per_sample"`` (one
    ``F.interpolate`` each: fastest on CPU) or ``"auto"`` (per_sample on CPU or with antialias). Returns (N,
    3, *size), same dtype and device, channels_last; uint8 within 1 of torchvision's (its CPU kernel uses
    fixed-point weights).
    """
    check_images(images)
    _check_size(size)
    n, _, h, w = images.shape
    _check_per_sample(crops, n, 4, "crops")
    _check_flips(flips, n)
    if method not in ("auto", "batched", "per_sample"):
        raise ValueError(f"method: expected 'auto', 'batched' or 'per_sample', got '{method}'")
    if n == 0:
        return _empty_like_batch(images, 0, size[0], size[1])
    # Clip boxes to the image (at least one pixel) so that no path can read out of bounds.
    crops = crops.to(torch.int64)
    top = crops[:, 0].clamp(0, h - 1)
    left = crops[:, 1].clamp(0, w - 1)
    ch = torch.minimum(crops[:, 2].clamp_min(1), h - top)
    cw = torch.minimum(crops[:, 3].clamp_min(1), w - left)
    crops = torch.stack([top, left, ch, cw], dim=1)
    if method == "auto":
        method = "per_sample" if images.device.type == "cpu" or antialias else "batched"
    if method == "batched":
        if antialias:
            raise ValueError("antialias=True: expected method 'per_sample' or 'auto', got 'batched'")
        return _resized_crop_batched(images, crops, size, flips)
    if torch.jit.is_scripting():
        return _resized_crop_per_sample(images, crops, size, flips, antialias)
    return _resized_crop_per_sample_eager(images, crops, size, flips, antialias)


# --------------------------------------------------------------------------------------------------
# flips and crops


def horizontal_flip(images: Tensor, flips: Tensor) -> Tensor:
    """Mirror the samples whose ``flips`` entry (bool, shape (N,)) is True; channels_last out."""
    check_images(images)
    _check_flips(flips, images.shape[0])
    out = torch.where(flips.to(images.device)[:, None, None, None], images.flip(-1), images)
    return out.contiguous(memory_format=torch.channels_last)


def padded_crop(
    images: Tensor,
    offsets: Tensor,
    size: List[int],
    padding: int,
    flips: Optional[Tensor] = None,
) -> Tensor:
    """Zero-pad every side by ``padding`` and crop ``size`` at per-sample ``offsets``.

    ``offsets`` is an (N, 2) integer tensor of (top, left) in padded coordinates, each in
    ``[0, H + 2 * padding - size[0]]`` (resp. width); torchvision's ``RandomCrop(size, padding)``
    with ``fill=0``. ``flips`` (bool (N,)) mirrors the crop, fused in the gather.
    """
    check_images(images)
    _check_size(size)
    if padding < 0:
        raise ValueError(f"padding: expected >= 0, got {padding}")
    n, _c, h, w = images.shape
    _check_per_sample(offsets, n, 2, "offsets")
    _check_flips(flips, n)
    if size[0] > h + 2 * padding or size[1] > w + 2 * padding:
        raise ValueError(f"size: expected at most the padded image {[h + 2 * padding, w + 2 * padding]}, got {size}")
    if n == 0:
        return _empty_like_batch(images, 0, size[0], size[1])
    dev = images.device
    offsets = offsets.to(device=dev, dtype=torch.int64)
    top = offsets[:, 0].clamp(0, h + 2 * padding - size[0])
    left = offsets[:, 1].clamp(0, w + 2 * padding - size[1])
    rows = top[:, None] + torch.arange(size[0], device=dev)[None, :]
    cols = left[:, None] + torch.arange(size[1], device=dev)[None, :]
    if flips is not None:
        cols = torch.where(flips.to(dev)[:, None], cols.flip(1), cols)
    padded = F.pad(images, [padding, padding, padding, padding]) if padding > 0 else images
    idx = torch.arange(n, device=dev)[:, None, None]
    # Advanced indices around a slice put the indexed dims first: (N, h, w, C) = channels_last NCHW.
    out = padded[idx, :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2)


def center_crop(images: Tensor, size: List[int]) -> Tensor:
    """torchvision ``center_crop``: the centre ``size`` window, zero-padded if the image is smaller."""
    check_images(images)
    _check_size(size)
    h, w = images.shape[2], images.shape[3]
    oh, ow = size[0], size[1]
    if oh > h or ow > w:
        pw, ph = max(ow - w, 0), max(oh - h, 0)
        images = F.pad(images, [pw // 2, (pw + 1) // 2, ph // 2, (ph + 1) // 2])
        h, w = images.shape[2], images.shape[3]
    # int(): TorchScript's round() returns a float
    top = int(round((h - oh) / 2.0))  # noqa: RUF046
    left = int(round((w - ow) / 2.0))  # noqa: RUF046
    return images[:, :, top : top + oh, left : left + ow].contiguous(memory_format=torch.channels_last)


def resize(images: Tensor, size: List[int], antialias: bool = True) -> Tensor:
    """Bilinear resize of the whole batch. ``size`` = [h, w], or [s] to resize the shorter side to
    ``s`` keeping the aspect ratio (torchvision's rule). Antialias defaults to True as in
    torchvision v2, since evaluation resizes are usually downscales."""
    check_images(images)
    if len(size) == 1:
        if size[0] <= 0:
            raise ValueError(f"size: expected [s] with s > 0, got {size}")
        h, w = images.shape[2], images.shape[3]
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(size[0] * long / short)
        out_size = [new_long, size[0]] if w <= h else [size[0], new_long]
    else:
        _check_size(size)
        out_size = size
    if images.shape[0] == 0:
        return _empty_like_batch(images, 0, out_size[0], out_size[1])
    if out_size[0] == images.shape[2] and out_size[1] == images.shape[3]:
        return images.contiguous(memory_format=torch.channels_last).clone()
    return _interpolate(images, out_size, antialias).contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------------
# normalize


def normalize(images: Tensor, mean: List[float], std: List[float], dtype: torch.dtype = torch.float32) -> Tensor:
    """``(x / 255 - mean) / std`` for uint8 input (``(x - mean) / std`` for floating input, taken
    to be in [0, 1] as torchvision does), in one multiply-add, output ``dtype`` and channels_last.

    ``mean`` and ``std`` are in 0-1 units, as torchvision's ``Normalize`` takes them. The arithmetic
    runs in float32 whatever ``dtype`` (fp16/bf16 outputs are rounded once, at the end).
    """
    check_images(images)
    if not (dtype == torch.float32 or dtype == torch.float16 or dtype == torch.bfloat16 or dtype == torch.float64):
        raise TypeError(f"dtype: expected a floating dtype (float32, bfloat16, float16), got {dtype}")
    c = images.shape[1]
    if len(mean) != c or len(std) != c:
        raise ValueError(f"mean/std: expected {c} values each, got {len(mean)} and {len(std)}")
    for s in std:
        if s <= 0:
            raise ValueError(f"std: expected all values > 0, got {std}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    denom = 255.0 if images.dtype == torch.uint8 else 1.0
    std_t = torch.tensor(std, dtype=torch.float64)
    n, h, w = images.shape[0], images.shape[2], images.shape[3]
    # Work on NHWC rows with the per-channel constants tiled along W*C: the inner loop is then contiguous and
    # vectorises (a (1, C, 1, 1) broadcast over channels_last has an inner dimension of 3, much slower on
    # CPU). For a channels_last batch the reshape is a view.
    scale = (1.0 / (std_t * denom)).to(device=images.device, dtype=work).repeat(w)
    shift = (-torch.tensor(mean, dtype=torch.float64) / std_t).to(device=images.device, dtype=work).repeat(w)
    rows = images.permute(0, 2, 3, 1).reshape(n * h, w * c)
    # Same dtype: rows may be the caller's memory, so allocate; otherwise .to() already copied.
    out = rows * scale if rows.dtype == work else rows.to(work).mul_(scale)
    out = out.add_(shift).to(dtype)
    return out.view(n, h, w, c).permute(0, 3, 1, 2)
