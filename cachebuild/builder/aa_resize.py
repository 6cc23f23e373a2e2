"""Antialiased bilinear resize of uint8 HWC images, bit for bit torch's uint8 CPU kernel, without torch.

``torch._C._nn._upsample_bilinear2d_aa`` on uint8 (the Pillow-SIMD port in ATen's UpSampleKernel*.cpp/.h)
works in integers: per axis it computes PIL's widened triangle weights in double, scales them to int16 at a
precision chosen from the largest weight (the most bits that keep ``2 x max`` under 2^15), and sums
``pixel x weight`` in int32 from ``1 << (precision - 1)``, shifts right and clamps to 0..255. It resamples
the width first into a uint8 intermediate, then the height; an axis whose size does not change is skipped
(both unchanged: a copy). Integer sums do not depend on their order, so the same tables give the same
bytes by any route: here each pass is one int32 sparse (CSR) x dense product in scipy's C kernel, then
the same shift and clamp. Importing this costs a fraction of importing torch in every build worker
(issue 36), and the kernel is loaded at the first resize, not at import (:func:`_csr_matvecs`);
``tests/cachebuild/builder/test_aa_resize.py`` compares it with torch across sizes and scales.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

import cv2
import numpy as np

__all__ = ["antialias_into"]


class _Pass(NamedTuple):
    """One axis's weights as an (n_out, n_in) CSR matrix: ATen's int16 weights, held as int32."""

    n_in: int
    n_out: int
    indptr: np.ndarray
    indices: np.ndarray
    weights: np.ndarray
    precision: int  # the weights' fixed-point bits: the shift after the sum


def _scale(n_in: int, n_out: int, opt_scale: float | None) -> float:
    # ATen's area_pixel_compute_scale (align_corners=False): the inverse of an explicit output/input scale
    return 1.0 / opt_scale if opt_scale is not None and opt_scale > 0.0 else n_in / n_out


@functools.lru_cache(maxsize=256)
def _pass(n_in: int, n_out: int, opt_scale: float | None) -> _Pass:
    """The int16 weight table of one axis, as ATen builds it for bilinear with antialias (every step in
    double, in its order, so the truncations and roundings land on the same side)."""
    scale = _scale(n_in, n_out, opt_scale)
    support = scale if scale >= 1.0 else 1.0  # (interp_size / 2) x scale, interp_size 2 for bilinear
    ksize = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(n_out, dtype=np.float64) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C casts truncate towards zero
    xsize = np.clip(np.minimum((center + support + 0.5).astype(np.int64), n_in) - xmin, 0, ksize)
    taps = np.arange(ksize)
    x = np.abs(((taps + xmin[:, None]) - center[:, None] + 0.5) * invscale)
    w = np.where((x < 1.0) & (taps < xsize[:, None]), 1.0 - x, 0.0)
    total = np.zeros(n_out)
    for j in range(ksize):  # summed tap by tap, as the C loop does (np.sum pairs terms up)
        total += w[:, j]
    w = np.divide(w, total[:, None], out=np.zeros_like(w), where=total[:, None] != 0.0)
    wt_max = float(w.max(initial=0.0))
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    wi = np.trunc(0.5 + w * float(1 << precision))  # weights are >= 0: C's (int)(0.5 + v)
    keep = taps < xsize[:, None]
    cols = (xmin[:, None] + taps)[keep]
    indptr = np.concatenate(([0], np.cumsum(keep.sum(axis=1)))).astype(np.int32)
    return _Pass(n_in, n_out, indptr, cols.astype(np.int32), wi[keep].astype(np.int32), precision)


@functools.cache
def _csr_matvecs() -> Any:
    """scipy's C kernel ``csr_matvecs``, loaded at the first resize (a pool build's parent never resizes).
    Where ``scipy.sparse`` is not imported yet, its extension module is loaded from its file alone: the
    package's ``__init__`` (its sparse-array classes and array-API layer) cost a fresh build worker 0.13-0.27 s
    for this one function (issue 36), against ~15 ms. Anything unexpected takes the ordinary import."""
    if "scipy.sparse" not in sys.modules:
        try:
            import scipy  # its __init__ loads no subpackage

            folder = Path(scipy.__file__).parent / "sparse"
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = folder / f"_sparsetools{suffix}"
                if path.is_file():
                    spec = importlib.util.spec_from_file_location("scipy.sparse._sparsetools", path)
                    if spec is None or spec.loader is None:
                        break
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                    return module.csr_matvecs
        except Exception:  # a layout this does not know: the ordinary import below
            pass
    from scipy.sparse import _sparsetools

    return _sparsetools.csr_matvecs


def _apply(p: _Pass, rows: np.ndarray) -> np.ndarray:
    """One pass along the first axis of 2-D uint8 ``rows``: ATen's rounded, shifted and clamped int32
    sums, as uint8 (int32 holds them exactly: at most 255 x 2^22)."""
    acc = np.full((p.n_out, rows.shape[1]), 1 << (p.precision - 1), np.int32)
    # scipy's CSR x dense kernel, accumulating into ``acc`` (scipy.sparse's ``@`` would start from zeros)
    _csr_matvecs()(p.n_out, p.n_in, rows.shape[1], p.indptr, p.indices, p.weights, rows.astype(np.int32).ravel(),
                   acc.ravel())
    np.right_shift(acc, p.precision, out=acc)
    return cv2.convertScaleAbs(acc)  # saturating cast to uint8; the sums are >= 0, the abs changes nothing


def antialias_into(src: np.ndarray, out: np.ndarray, scales: tuple[float | None, float | None] = (None, None)) -> None:
    """Resize HWC uint8 ``src`` into ``out`` (any HWC uint8 view, e.g. a letterbox window) as
    ``torch._C._nn._upsample_bilinear2d_aa(src, out.shape[:2], False, *scales)`` does on CPU.

    ``scales``: the explicit (height, width) output/input scale factors, or None for out/in.
    """
    h_in, w_in, c = src.shape
    h_out, w_out = out.shape[:2]
    if (h_in, w_in) == (h_out, w_out):
        out[...] = src
        return
    mid = src
    if w_in != w_out:
        # the width first, as the rows of the transposed image (cv2.transpose: a fast strided copy)
        cols = cv2.transpose(src).reshape(w_in, h_in * c)
        mid = cv2.transpose(_apply(_pass(w_in, w_out, scales[1]), cols).reshape(w_out, h_in, c))
    if h_in != h_out:
        mid = _apply(_pass(h_in, h_out, scales[0]), mid.reshape(h_in, w_out * c)).reshape(h_out, w_out, c)
    out[...] = mid
