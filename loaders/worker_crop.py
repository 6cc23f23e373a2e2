"""Crop + resize + flip (+ normalize) fused into the gather, in the DataLoader's workers (or its main process with
``num_workers=0``): a batch leaves the worker at its training size, and the device only normalizes.
On a CPU the device transforms would crop on the main process's cores, competing with the model, and on any
device they receive whole stored samples.

What to crop is said with the device transforms' own classes (``loaders.transforms``), so one
``RandomResizedCrop`` means one thing: ``DatasetOptions(crop=RandomResizedCrop(176, flip_p=0.5))`` for
training, ``CenterCrop(224)`` or ``Compose([Resize(256), CenterCrop(224)])`` for evaluation. Per sample:
boxes and flips from a counter-based hash of ``(seed, epoch, sample index)`` (:func:`uniforms`: the same
batch whatever the worker count, start method or resume position), drawn as torchvision's ``get_params``
step for step inside the valid box (:func:`draw_crops`); OpenCV's bilinear resize (:func:`resize_into`:
torchvision's ``antialias=False`` within one level), flipped in place; eval crops through the device
kernels, so they equal the device pipeline; with ``normalize`` one ``cv2.transform`` into float32.

:class:`CropPlan` is what a dataset holds when it crops: the crop, its seed, and the epoch and output size in
a small shared-memory tensor, so persistent workers see ``set_epoch`` / ``set_resolution`` at their next
batch. It reads the dataset only through :class:`StoredSamples`.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import cv2
import numpy as np
import torch

from loaders import transforms as T

__all__ = ["CenterCrop", "CropPlan", "EpochSampler", "RandomResizedCrop", "StoredSamples", "check_crop", "draw_crops",
           "flip_probability", "normalize_matrix", "progressive", "resize_into", "uniforms"]

_U = 23  # uniforms per sample: 10 scale tries, 10 ratio tries, top, left, flip (as the device transform)
_GATHER_CHUNK = 8  # stored samples read into scratch at a time: a few MB, in cache for the resize

#: The crop's class is the device transform's (``loaders.transforms.RandomResizedCrop``); this name is its
#: alias of the previous release, kept for one release.
RandomResizedCrop = T.RandomResizedCrop


def CenterCrop(size: int | Sequence[int], resize_size: int | None = None) -> T.Compose | T.CenterCrop:
    """The previous release's eval crop spec, kept for one release: ``Compose([Resize(resize_size),
    CenterCrop(size)])`` of ``loaders.transforms`` (``resize_size`` default ``round(size / 0.875)``; 0: the
    crop alone)."""
    short = min(_size2(size))
    resize = round(short / 0.875) if resize_size is None else int(resize_size)
    if resize < 0:
        raise ValueError(f"resize_size must be >= 0 or None, got {resize_size}")
    return T.Compose([T.Resize(resize), T.CenterCrop(size)]) if resize else T.CenterCrop(size)


def _size2(size: int | Sequence[int], name: str = "size") -> tuple[int, int]:
    s = (int(size), int(size)) if isinstance(size, (int, np.integer)) else tuple(int(v) for v in size)
    if len(s) == 1:
        s = (s[0], s[0])
    if len(s) != 2 or min(s) < 1:
        raise ValueError(f"{name} must be a positive int or (h, w), got {size!r}")
    return s[0], s[1]


def check_crop(crop: Any, flip: bool | float | None = None) -> tuple[Any, int, bool, float]:
    """``crop`` as the workers run it: (the ``RandomResizedCrop`` or ``CenterCrop`` module, the short side an
    eval crop resizes to first (0: none) and whether with antialias, the flip probability). ``flip`` is the
    previous release's ``DatasetOptions(flip=)``, the crop's ``flip_p`` now."""
    steps = list(crop.transforms) if isinstance(crop, T.Compose) else [crop]
    resize, antialias = 0, True
    if len(steps) == 2 and isinstance(steps[0], T.Resize) and isinstance(steps[1], T.CenterCrop):
        if len(steps[0].size) != 1:
            raise ValueError(f"crop: the workers resize the short side, Resize(s), got Resize({steps[0].size})")
        resize, antialias = int(steps[0].size[0]), steps[0].antialias
        steps = steps[1:]
    last = steps[0] if len(steps) == 1 else None
    if not isinstance(last, (T.RandomResizedCrop, T.CenterCrop)):
        raise TypeError(f"crop must be a loaders.transforms RandomResizedCrop, CenterCrop or Compose([Resize(s), "
                        f"CenterCrop(c)]), got {crop!r}; other device transforms run on the batch")
    flip_p = getattr(last, "flip_p", 0.0)
    if isinstance(last, T.RandomResizedCrop) and (last.antialias or last.generator is not None):
        raise ValueError("crop: the workers resample without antialias and draw from DatasetOptions(seed=): "
                         "use RandomResizedCrop(..., antialias=False, generator=None)")
    if flip is not None:
        p = flip_probability(flip)
        if p and not isinstance(last, T.RandomResizedCrop):
            raise ValueError("flip needs crop=RandomResizedCrop(...): eval crops do not flip")
        if flip_p and p and p != flip_p:
            raise ValueError(f"flip={flip!r} and the crop's flip_p={flip_p} disagree: give RandomResizedCrop(flip_p=)")
        flip_p = p or flip_p
    return last, resize, antialias, flip_p


def flip_probability(flip: bool | float) -> float:
    """``DatasetOptions(flip=)`` (the previous release's spelling of ``flip_p``) as a probability."""
    p = 0.5 if flip is True else float(flip)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip must be a bool or a probability in [0, 1], got {flip!r}")
    return p


def normalize_matrix(crop: Any, normalize: tuple[Sequence[float], Sequence[float]] | None) -> np.ndarray | None:
    """``normalize`` ((mean, std), 0-1 units as torchvision's ``Normalize``) checked against ``crop`` and made
    into the (3, 4) affine map of ``cv2.transform``: channel c of a pixel v becomes ``v / (255 std[c]) -
    mean[c] / std[c]``, i.e. ``(v / 255 - mean[c]) / std[c]`` within 1e-6 (float32 arithmetic). One map per
    crop beats a 256-entry ``cv2.LUT`` to float32."""
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
    """A dataset's crop in the workers: the crop module (``spec``), its flip probability and seed, and the epoch
    and output size, which live in a small shared-memory tensor (int64 [epoch, h, w]) that travels to DataLoader
    workers by handle, so persistent workers see :meth:`set_epoch` / :meth:`set_size` at their next batch. With
    ``normalize`` ((mean, std)) batches are float32, normalized in the workers too; without it uint8.
    ``schedule`` (epoch -> size, e.g. :func:`progressive`) sets the size at each :meth:`set_epoch`; it stays in
    the process that made the plan."""

    def __init__(self, crop: Any, seed: int = 0, normalize: tuple[Sequence[float], Sequence[float]] | None = None,
                 flip: bool | float | None = None) -> None:
        self.spec, self.resize, self.antialias, self.flip_p = check_crop(crop, flip)
        self.seed = int(seed)
        self.normalize = normalize
        self.matrix = normalize_matrix(crop, normalize)
        self.schedule: Callable[[int], int | Sequence[int]] | None = None
        h, w = self.base = _size2(self.spec.size)
        self._values = torch.tensor([0, h, w], dtype=torch.int64).share_memory_()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "schedule": None}  # a closure need not pickle: the size travels in _values

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
        if self.schedule is not None:
            self.set_size(self.schedule(int(epoch)))

    def set_size(self, size: int | Sequence[int]) -> None:
        self._values[1], self._values[2] = _size2(size)

    def resize_for(self, out: tuple[int, int]) -> int:
        """An eval crop's short-side resize for output ``out``, scaled with it under ``set_resolution``."""
        return round(self.resize * min(out) / min(self.base)) if self.resize else 0

    def gather(self, samples: StoredSamples, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Samples ``idx`` (int64 in [0, N)) of ``samples`` cropped into ``out`` (B, h, w, 3) of
        :attr:`output_dtype`, for the current epoch; the size is ``out``'s."""
        dt = self.output_dtype
        if out.ndim != 4 or out.shape[0] != len(idx) or out.shape[3] != 3 or out.dtype != dt:
            raise ValueError(f"out must be {dt}[{len(idx)}, h, w, 3], got {out.dtype}{list(out.shape)}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        if len(idx):
            _crop_batch(samples, idx, self, out)
        return out


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


def EpochSampler(data_source: Any, *, schedule: Callable[[int], int] | None = None, **kw: Any) -> Any:
    """The previous release's sampler that also set the crop's epoch and size, kept for one release:
    ``CacheSampler`` sets the dataset's epoch itself, and ``ds.set_resolution(schedule)`` its size per epoch."""
    from loaders.sampler import CacheSampler

    if schedule is not None:
        data_source.set_resolution(schedule)
    sampler = CacheSampler(data_source, **kw)
    sampler.set_epoch(sampler.epoch)
    return sampler


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


def draw_crops(spec: T.RandomResizedCrop, boxes: np.ndarray, shape: tuple[int, int], u: np.ndarray,
               flip_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Crops (N, 4) int64 (top, left, height, width) inside ``boxes`` (y0, x0, y1, x1) and flips (N,),
    from the uniforms ``u`` (N, 23): torchvision's ``get_params``, vectorised like the device transform."""
    y0, x0, hh, ww = _valid(boxes, *shape)
    h_f, w_f = hh.astype(np.float64), ww.astype(np.float64)
    lo, hi, r0, r1 = spec.scale_lo, spec.scale_hi, spec.ratio_lo, spec.ratio_hi
    area = (h_f * w_f)[:, None] * (lo + (hi - lo) * u[:, 0:10])
    aspect = np.exp(math.log(r0) + (math.log(r1) - math.log(r0)) * u[:, 10:20])
    cw = np.round(np.sqrt(area * aspect)).astype(np.int64)  # np.round: half to even, as Python's round()
    ch = np.round(np.sqrt(area / aspect)).astype(np.int64)
    valid = (cw > 0) & (cw <= ww[:, None]) & (ch > 0) & (ch <= hh[:, None])
    first = valid.argmax(axis=1)
    found = valid.any(axis=1)
    rows = np.arange(len(u))
    in_ratio = w_f / h_f
    fb_h = np.where(in_ratio < r0, np.round(w_f / r0).astype(np.int64), hh)
    fb_w = np.where(in_ratio > r1, np.round(h_f * r1).astype(np.int64), ww)
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
    if flip:  # in place (OpenCV swaps column pairs), not a copy from a negative-stride view
        _into(dst, cv2.flip(dst, 1, dst=dst))


def _into(dst: np.ndarray, res: np.ndarray) -> None:
    if res.ctypes.data != dst.ctypes.data:  # OpenCV allocated instead of writing in place
        np.copyto(dst, res)


def _center_into(src: np.ndarray, box: Sequence[int], dst: np.ndarray, resize: int, antialias: bool) -> None:
    """Eval: the valid box resized (short side ``resize``) and centre-cropped into ``dst`` with the device
    transforms' kernels, so it equals the device pipeline on a batch of that box."""
    from loaders.transforms import functional as TF

    y0, x0, y1, x1 = (int(v) for v in box)
    with warnings.catch_warnings():  # a read-only memory map: read here, never written
        warnings.simplefilter("ignore", UserWarning)
        x = torch.from_numpy(src[y0:y1, x0:x1]).permute(2, 0, 1)[None]
    if resize:
        x = TF.resize(x, [resize], antialias)
    x = TF.center_crop(x, [dst.shape[0], dst.shape[1]])
    dst[...] = x[0].permute(1, 2, 0).numpy()


_local = threading.local()


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """This thread's buffer of ``shape``: a DataLoader worker has one thread, and a dataset read from several
    threads at once still gives each its own scratch."""
    buf = getattr(_local, "buf", None)
    n = int(np.prod(shape))
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, dtype=np.uint8)
    return buf[:n].reshape(shape)


def _crop_batch(samples: StoredSamples, idx: np.ndarray, plan: CropPlan, out: np.ndarray) -> None:
    """Batch ``idx`` cropped into ``out`` (B, h, w, 3), a few samples at a time in ascending order: resized
    straight from views of the stored samples where there are some (in memory, local npy memory maps), else
    read into scratch first (zarr, JPEG, URLs). Under ``normalize`` each uint8 crop lands in a small buffer (in
    cache), is copied to float32 beside it and ``cv2.transform`` writes it into ``out``: every step of a sample
    in this thread, the GIL released in each, no batch-sized intermediate."""
    size = (out.shape[1], out.shape[2])
    boxes = samples.valid_boxes(idx)
    crops = flips = None
    if isinstance(plan.spec, T.RandomResizedCrop):
        crops, flips = draw_crops(plan.spec, boxes, samples.shape[:2], uniforms(plan.seed, plan.epoch, idx),
                                  plan.flip_p)
    resize, matrix = plan.resize_for(size), plan.matrix
    tmp = np.empty((*size, 3), dtype=np.uint8)  # a normalized sample's uint8 crop, in cache for the map
    ftmp = np.empty((*size, 3), dtype=np.float32) if matrix is not None else None
    order = np.argsort(idx, kind="stable")
    for lo in range(0, len(order), _GATHER_CHUNK):
        part = order[lo : lo + _GATHER_CHUNK]
        views = samples.sample_views(idx[part])
        rows = views if views is not None else samples.gather(idx[part], _scratch((len(part), *samples.shape)))
        for j, i in enumerate(part):
            dst = out[i] if matrix is None else tmp
            if crops is not None and flips is not None:
                resize_into(rows[j], crops[i], dst, bool(flips[i]))
            else:
                _center_into(rows[j], boxes[i], dst, resize, plan.antialias)
            if matrix is not None and ftmp is not None:
                np.copyto(ftmp, tmp)
                _into(out[i], cv2.transform(ftmp, matrix, dst=out[i]))
