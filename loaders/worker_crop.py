"""Crop + resize + flip fused into the gather, in the loader's workers (DataLoader processes or
``ThreadLoader`` threads), so a batch leaves the worker at its training size and the device only normalizes.

Why: the device transforms (``loaders.transforms``) crop a batch of whole stored samples on one device;
on CPU that is the main process's cores, competing with the model, and on any device it sends the
whole stored sample (a 176 px crop of a 224 px sample is 0.62x the bytes). Here each worker crops the
samples of its own batch, in parallel, straight into the (smaller) batch buffer: the reused batch ring
slot of a DataLoader worker, a pooled buffer of a ``ThreadLoader``.

Three parts:

* :class:`RandomResizedCrop` / :class:`CenterCrop`: what to crop (picklable specs, no state).
* :func:`draw_crops`: the boxes and flips of a batch, from a counter-based hash of
  ``(seed, epoch, sample index)`` (splitmix64): the same batch whatever the worker count, fork or
  spawn, or the position a resumed epoch starts at. The draw follows torchvision's
  ``RandomResizedCrop.get_params`` step for step (10 tries, the centre fallback), as the device
  transform does, inside each sample's valid box (``--fit pad`` caches).
* :func:`resize_into`: one box of a stored sample resized into its output slot with OpenCV's bilinear
  ``INTER_LINEAR`` (half-pixel centres, no antialias: torchvision's ``resized_crop(...,
  antialias=False)`` within one level), flipped on the way when asked. Eval crops use the device
  path's own kernels (``functional.resize`` with antialias + ``center_crop``) on one sample, so they
  equal ``imagenet_eval`` on the batch. With ``normalize`` (training on a CPU) each crop then becomes its
  normalized float32 slot of the batch (a float32 copy, then one ``cv2.transform`` by
  :func:`normalize_matrix`), in the same thread.

:class:`CropPlan` is what a dataset holds when it crops (``DatasetOptions(crop=...)``, ``set_crop``): the spec,
flip and seed, and the epoch and output size in a small shared-memory tensor, so persistent DataLoader workers
(fork or spawn: the tensor travels by handle) see ``set_epoch`` / ``set_resolution`` of the main process at
their next batch. Change them between epochs, not while one is being loaded. It reads the dataset only through
:class:`StoredSamples`, the dataset's public reading methods (``gather``, ``sample_views``, ``valid_boxes``).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import cv2
import numpy as np
import torch

from loaders.sampler import CacheSampler

__all__ = [
    "CenterCrop",
    "CropPlan",
    "CropSpec",
    "EpochSampler",
    "RandomResizedCrop",
    "StoredSamples",
    "crop_output_bytes",
    "draw_crops",
    "flip_probability",
    "normalize_matrix",
    "progressive",
    "resize_into",
]

_U = 23  # uniforms per sample: 10 scale tries, 10 ratio tries, top, left, flip (as the device transform)
_GATHER_CHUNK = 8  # stored samples read into scratch at a time: a few MB, stays in cache for the resize


def _size2(size: int | Sequence[int], name: str = "size") -> tuple[int, int]:
    s = (int(size), int(size)) if isinstance(size, (int, np.integer)) else tuple(int(v) for v in size)
    if len(s) != 2 or min(s) < 1:
        raise ValueError(f"{name} must be a positive int or (h, w), got {size!r}")
    return s[0], s[1]


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` drawn per sample in the workers."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)

    def __post_init__(self) -> None:
        _size2(self.size)
        if not (0 < self.scale[0] <= self.scale[1]) or not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"scale and ratio must be (lo, hi) with 0 < lo <= hi, got {self.scale}, {self.ratio}")


@dataclass(frozen=True)
class CenterCrop:
    """Eval: resize the shorter side to ``resize_size`` (default ``round(size / 0.875)``, as
    ``imagenet_eval``; 0: no resize), then the centre ``size`` crop."""

    size: int | tuple[int, int]
    resize_size: int | None = None

    def __post_init__(self) -> None:
        _size2(self.size)
        if self.resize_size is not None and self.resize_size < 0:
            raise ValueError(f"resize_size must be >= 0 or None, got {self.resize_size}")

    def resize_for(self, out: tuple[int, int]) -> int:
        """The short-side resize for output ``out`` (scaled with it under ``set_resolution``)."""
        base = _size2(self.size)
        if self.resize_size is None:
            return round(min(out) / 0.875)
        return round(self.resize_size * min(out) / min(base)) if self.resize_size else 0


CropSpec = RandomResizedCrop | CenterCrop


def flip_probability(crop: CropSpec | None, flip: bool | float) -> float:
    """``flip`` as a probability, checked against ``crop`` (only a ``RandomResizedCrop`` flips)."""
    if crop is not None and not isinstance(crop, (RandomResizedCrop, CenterCrop)):
        raise TypeError(f"crop must be a loaders.worker_crop RandomResizedCrop or CenterCrop, got {crop!r} "
                        "(the device transforms of loaders.transforms run on the batch, not here)")
    flip_p = 0.5 if flip is True else float(flip)
    if not 0.0 <= flip_p <= 1.0:
        raise ValueError(f"flip must be a bool or a probability in [0, 1], got {flip!r}")
    if flip_p and not isinstance(crop, RandomResizedCrop):
        raise ValueError("flip needs crop=RandomResizedCrop(...): eval crops do not flip")
    return flip_p


def normalize_matrix(crop: CropSpec | None, normalize: tuple[Sequence[float], Sequence[float]] | None
                     ) -> np.ndarray | None:
    """``normalize`` ((mean, std), 0-1 units as torchvision's ``Normalize``) checked against ``crop`` and made
    into the (3, 4) affine map of ``cv2.transform``: channel c of a pixel v becomes ``v / (255 std[c]) -
    mean[c] / std[c]``, i.e. ``(v / 255 - mean[c]) / std[c]`` within 1e-6 (float32 arithmetic). Measured per 224 px
    crop on one core: a float32 copy and this map 0.058 ms, a 256-entry ``cv2.LUT`` to float32 0.108 ms
    (``bench/scripts/augment_profile.py``); OpenCV releases the GIL: threads normalize in parallel."""
    if normalize is None:
        return None
    if crop is None:
        raise ValueError("normalize needs crop=RandomResizedCrop(...) or CenterCrop(...): it runs in the workers")
    try:
        mean, std = (np.asarray(v, dtype=np.float64).reshape(-1) for v in normalize)
    except (TypeError, ValueError):
        raise ValueError(f"normalize must be (mean, std) of 3 values each, got {normalize!r}") from None
    if mean.shape != (3,) or std.shape != (3,) or not (std > 0).all():
        raise ValueError(f"normalize must be (mean, std) of 3 values each, std > 0, got {normalize!r}")
    m = np.zeros((3, 4), dtype=np.float64)
    m[[0, 1, 2], [0, 1, 2]] = 1.0 / (255.0 * std)
    m[:, 3] = -mean / std
    return m


class StoredSamples(Protocol):
    """What a :class:`CropPlan` crops from (a :class:`~loaders.dataset.CachedImageDataset`)."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def valid_boxes(self, indices: Any) -> np.ndarray: ...

    def sample_views(self, indices: Any) -> Sequence[np.ndarray] | None: ...

    def gather(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray: ...


class CropPlan:
    """A dataset's crop in the workers: what to crop (``spec``), the flip probability and the seed, and the
    epoch and output size, which live in a small shared-memory tensor (int64 [epoch, h, w]) that travels to
    DataLoader workers by handle, so persistent workers see :meth:`set_epoch` / :meth:`set_size` of the main
    process at their next batch. With ``normalize`` ((mean, std)) the batch is float32, normalized in the
    workers too (:func:`normalize_matrix`), for training on the CPU; without it uint8."""

    def __init__(self, spec: CropSpec, flip: bool | float = False, seed: int = 0,
                 normalize: tuple[Sequence[float], Sequence[float]] | None = None) -> None:
        self.flip_p = flip_probability(spec, flip)
        self.spec = spec
        self.seed = int(seed)
        self.normalize = normalize
        self.matrix = normalize_matrix(spec, normalize)
        h, w = _size2(spec.size)
        self._values = torch.tensor([0, h, w], dtype=torch.int64).share_memory_()

    def __repr__(self) -> str:
        return f"CropPlan({self.spec!r}, flip={self.flip_p}, seed={self.seed}, epoch={self.epoch}, size={self.size})"

    @property
    def epoch(self) -> int:
        return int(self._values[0])

    @property
    def size(self) -> tuple[int, int]:
        """(h, w) of the crops from the next batch on."""
        return int(self._values[1]), int(self._values[2])

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (*self.size, 3)

    @property
    def output_dtype(self) -> np.dtype:
        """uint8, or float32 under ``normalize``."""
        return np.dtype(np.uint8 if self.matrix is None else np.float32)

    def set_epoch(self, epoch: int) -> None:
        self._values[0] = int(epoch)

    def set_size(self, size: int | Sequence[int]) -> None:
        self._values[1], self._values[2] = _size2(size)

    def gather(self, samples: StoredSamples, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Samples ``idx`` (int64 in [0, N)) of ``samples`` cropped into ``out`` (B, h, w, 3) of
        :attr:`output_dtype`, for the current epoch; the size is ``out``'s. Ascending sample order, each
        sample resized (flipped, normalized) into its slot."""
        dt = self.output_dtype
        if out.ndim != 4 or out.shape[0] != len(idx) or out.shape[3] != 3 or out.dtype != dt:
            raise ValueError(f"out must be {dt}[{len(idx)}, h, w, 3], got {out.dtype}{list(out.shape)}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if len(idx):
            _crop_batch(samples, idx, self.spec, self.flip_p, self.seed, self.epoch, out, self.matrix)
        return out

    def whole_boxes(self, n: int, shape: tuple[int, ...]) -> np.ndarray:
        """Boxes of a cropped batch of ``shape`` (B, h, w, 3): every output pixel is valid."""
        return np.tile(np.array([0, 0, shape[1], shape[2]], dtype=np.int32), (n, 1))


def progressive(low: int, high: int, start_epoch: int, end_epoch: int, step: int = 32) -> Callable[[int], int]:
    """FFCV's progressive resizing: ``low`` px until ``start_epoch``, then linearly up to ``high`` at
    ``end_epoch`` (rounded down to a multiple of ``step``), ``high`` after."""
    if low < 1 or high < low or end_epoch < start_epoch or step < 1:
        raise ValueError(f"progressive needs 1 <= low <= high and start <= end, got {low}, {high}, "
                         f"{start_epoch}, {end_epoch}")

    def size_at(epoch: int) -> int:
        if epoch <= start_epoch or end_epoch == start_epoch:
            return low if epoch < end_epoch else high
        if epoch >= end_epoch:
            return high
        s = low + (high - low) * (epoch - start_epoch) / (end_epoch - start_epoch)
        return max(low, int(s) // step * step)

    return size_at


# ---------------------------------------------------------------------------- boxes


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arrays wrap on overflow, as the hash wants)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, epoch: int, idx: np.ndarray, k: int = _U) -> np.ndarray:
    """float64 (len(idx), k) in [0, 1), a pure function of (seed, epoch, sample index, column)."""
    with np.errstate(over="ignore"):
        head = _mix64(np.array([seed & (2**64 - 1)], dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        head = _mix64(head + np.uint64(epoch & (2**64 - 1)))
        key = _mix64(head + np.asarray(idx, dtype=np.int64).astype(np.uint64))
        cols = np.arange(1, k + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        bits = _mix64(key[:, None] + cols[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _valid(boxes: np.ndarray, h: int, w: int) -> tuple[np.ndarray, ...]:
    """(y0, x0, height, width) int64 of each valid box, clamped to the sample as the device path does."""
    b = boxes.astype(np.int64)
    y0, x0 = np.clip(b[:, 0], 0, h - 1), np.clip(b[:, 1], 0, w - 1)
    return y0, x0, np.maximum(np.minimum(b[:, 2], h) - y0, 1), np.maximum(np.minimum(b[:, 3], w) - x0, 1)


def draw_crops(spec: RandomResizedCrop, boxes: np.ndarray, shape: tuple[int, int], u: np.ndarray,
               flip_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Crops (N, 4) int64 (top, left, height, width) inside ``boxes`` (y0, x0, y1, x1) and flips (N,),
    from the uniforms ``u`` (N, 23): torchvision's ``get_params``, vectorised like the device transform."""
    y0, x0, hh, ww = _valid(boxes, *shape)
    h_f, w_f = hh.astype(np.float64), ww.astype(np.float64)
    lo, hi = spec.scale
    rlo, rhi = math.log(spec.ratio[0]), math.log(spec.ratio[1])
    area = (h_f * w_f)[:, None] * (lo + (hi - lo) * u[:, 0:10])
    aspect = np.exp(rlo + (rhi - rlo) * u[:, 10:20])
    cw = np.round(np.sqrt(area * aspect)).astype(np.int64)  # np.round: half to even, as Python's round()
    ch = np.round(np.sqrt(area / aspect)).astype(np.int64)
    valid = (cw > 0) & (cw <= ww[:, None]) & (ch > 0) & (ch <= hh[:, None])
    first = valid.argmax(axis=1)
    found = valid.any(axis=1)
    rows = np.arange(len(u))
    in_ratio = w_f / h_f
    fb_h = np.where(in_ratio < spec.ratio[0], np.round(w_f / spec.ratio[0]).astype(np.int64), hh)
    fb_w = np.where(in_ratio > spec.ratio[1], np.round(h_f * spec.ratio[1]).astype(np.int64), ww)
    crop_h = np.where(found, ch[rows, first], fb_h)
    crop_w = np.where(found, cw[rows, first], fb_w)
    span_h, span_w = hh - crop_h, ww - crop_w
    top = np.where(found, np.minimum(np.floor(u[:, 20] * (span_h + 1)).astype(np.int64), span_h), span_h // 2)
    left = np.where(found, np.minimum(np.floor(u[:, 21] * (span_w + 1)).astype(np.int64), span_w), span_w // 2)
    return np.stack([y0 + top, x0 + left, crop_h, crop_w], axis=1), u[:, 22] < flip_p


# ---------------------------------------------------------------------------- pixels


def resize_into(src: np.ndarray, crop: Sequence[int], dst: np.ndarray, flip: bool) -> None:
    """Box ``crop`` (top, left, height, width) of ``src`` (H, W, 3) bilinearly resized into ``dst``
    (h, w, 3, C-contiguous), mirrored left-right when ``flip``."""
    t, l, h, w = (int(v) for v in crop)
    win = src[t : t + h, l : l + w]
    oh, ow = dst.shape[0], dst.shape[1]
    if (h, w) == (oh, ow):
        np.copyto(dst, win)
    else:
        _into(dst, cv2.resize(win, (ow, oh), dst=dst, interpolation=cv2.INTER_LINEAR))
    if flip:  # in place (OpenCV swaps column pairs): 10x a copy from a negative-stride numpy view
        _into(dst, cv2.flip(dst, 1, dst=dst))


def _into(dst: np.ndarray, res: np.ndarray) -> None:
    if res.ctypes.data != dst.ctypes.data:  # OpenCV allocated instead of writing in place
        np.copyto(dst, res)


def _center_into(src: np.ndarray, box: Sequence[int], dst: np.ndarray, resize_size: int) -> None:
    """Eval: the valid box resized (short side ``resize_size``, antialiased) and centre-cropped into ``dst``,
    with the device transforms' kernels, so it equals ``imagenet_eval`` on a batch of that box."""
    from loaders.transforms import functional as TF

    y0, x0, y1, x1 = (int(v) for v in box)
    with warnings.catch_warnings():  # a read-only memory map: read here, never written
        warnings.simplefilter("ignore", UserWarning)
        x = torch.from_numpy(src[y0:y1, x0:x1]).permute(2, 0, 1)[None]
    if resize_size:
        x = TF.resize(x, [resize_size])
    x = TF.center_crop(x, [dst.shape[0], dst.shape[1]])
    dst[...] = x[0].permute(1, 2, 0).numpy()


_local = threading.local()


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread buffer of ``shape`` (ThreadLoader threads gather at once; DataLoader workers have one)."""
    buf = getattr(_local, "buf", None)
    n = int(np.prod(shape))
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, dtype=np.uint8)
    return buf[:n].reshape(shape)


def _crop_batch(samples: StoredSamples, idx: np.ndarray, spec: CropSpec, flip_p: float, seed: int, epoch: int,
                out: np.ndarray, matrix: np.ndarray | None = None) -> None:
    """Batch ``idx`` cropped into ``out`` (B, h, w, 3), a few samples at a time in ascending order: resized
    straight from views of the stored samples where there are some (in memory, local npy memory maps), else
    read into scratch first (zarr, JPEG, URLs). With ``matrix`` each uint8 crop lands in a small per-call
    buffer (in cache), is copied to float32 beside it and ``cv2.transform`` writes its normalized pixels into
    ``out``: every step of a sample in this thread, the GIL released in each, no batch-sized intermediate."""
    size = (out.shape[1], out.shape[2])
    boxes = samples.valid_boxes(idx)
    if isinstance(spec, RandomResizedCrop):
        crops, flips = draw_crops(spec, boxes, samples.shape[:2], uniforms(seed, epoch, idx), flip_p)
        resize_for = 0
    else:
        crops, flips = None, np.zeros(len(idx), dtype=bool)
        resize_for = spec.resize_for(size)
    tmp = np.empty((*size, 3), dtype=np.uint8)  # a normalized sample's uint8 crop, in cache for the map
    ftmp = np.empty((*size, 3), dtype=np.float32) if matrix is not None else None
    order = np.argsort(idx, kind="stable")
    for lo in range(0, len(order), _GATHER_CHUNK):
        part = order[lo : lo + _GATHER_CHUNK]
        views = samples.sample_views(idx[part])
        rows = views if views is not None else samples.gather(idx[part], _scratch((len(part), *samples.shape)))
        for j, i in enumerate(part):
            dst = out[i] if matrix is None else tmp
            if crops is not None:
                resize_into(rows[j], crops[i], dst, bool(flips[i]))
            else:
                _center_into(rows[j], boxes[i], dst, resize_for)
            if matrix is not None and ftmp is not None:
                np.copyto(ftmp, tmp)
                _into(out[i], cv2.transform(ftmp, matrix, dst=out[i]))


def crop_output_bytes(size: int | Sequence[int]) -> int:
    """Bytes of one output image (what a batch sends to the device per sample)."""
    h, w = _size2(size)
    return h * w * 3


# ---------------------------------------------------------------------------- epochs


class EpochSampler(CacheSampler):
    """A :class:`~loaders.sampler.CacheSampler` whose ``set_epoch`` (and a resumed state) also sets the
    dataset's crop epoch and, with ``schedule`` (epoch -> size, e.g. :func:`progressive`), its resolution:
    loops that call ``sampler.set_epoch(epoch)`` need nothing else."""

    def __init__(self, data_source: Any, *, schedule: Callable[[int], int] | None = None, **kw: Any) -> None:
        super().__init__(data_source, **kw)
        self.crop_dataset = data_source
        self.schedule = schedule
        self._sync()

    def _sync(self) -> None:
        ds = self.crop_dataset
        if getattr(ds, "crop", None) is None:
            return
        ds.set_epoch(self.epoch)
        if self.schedule is not None:
            ds.set_resolution(int(self.schedule(self.epoch)))

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._sync()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._sync()
