"""Antialiased bilinear resize of uint8 HWC images, bit for bit torch's uint8 CPU kernel, without torch.

``torch._C._nn._upsample_bilinear2d_aa`` on uint8 (the Pillow-SIMD port in ATen's UpSampleKernel*.cpp/.h)
works in integers: per axis it computes PIL's widened triangle weights in double, scales them to int16 at a
precision chosen from the largest weight (the most bits that keep ``2 x max`` under 2^15), and sums
``pixel x weight`` in int32 from ``1 << (precision - 1)``, shifts right and clamps to 0..255. It resamples
the width first into a uint8 intermediate, then the height; an axis whose size does not change is skipped
(both unchanged: a copy). Integer sums do not depend on their order, so the same tables give the same
bytes by any route: here each pass is one sparse (CSR) x dense product in scipy's C kernel, in float32
where every partial sum is an integer below 2^24 times a power of two (exact, so a truncating cast is
the shift: :func:`_apply`), else in int32 with ATen's shift and clamp. The width pass runs on the rows of
the image transposed as 2-D uint8, ``(h, w x c) -> (w x c, h)``, seen as ``(w, c x h)``: one column's
channels a row, so both axes use the same kind of table (a square image's two are one); it goes through
the image a tile of rows at a time (:data:`TILE_ROWS`), each thread's float32 work arrays reused. A 1-byte
transpose is a fast copy, where one of 3-byte pixels was the slowest step. The tables are built with
whole-array numpy operations (:func:`_pass`): a build meets many image sizes, so most are built, not
looked up. Importing this costs a fraction of importing torch in every build worker (issue 36), and
the kernel is loaded at the first resize, not at import (:func:`_csr_matvecs`);
``tests/cachebuild/builder/test_aa_resize.py`` compares it with torch across sizes, scales, both number
paths and strided sources and windows.
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

from cachebuild.builder.sample.buffers import thread_buffer

__all__ = ["antialias_into"]

# The width pass runs over this many source rows at a time: a tile's float32 copy (~0.3 MB for a 500 px wide
# source) stays in the core's cache through its conversion, product and rounding, where the whole image's
# (~3 MB) did not; 32-64 rows were ~16% faster a call than untiled on the bench's photos (issue 36).
TILE_ROWS = 48


def _scratch(name: str, rows: int, cols: int) -> np.ndarray:
    """A (rows, cols) float32 work array of this thread's (:mod:`~cachebuild.builder.sample.buffers`),
    its contents undefined."""
    return thread_buffer(f"aa_{name}", rows * cols, np.float32).reshape(rows, cols)


def _scale(n_in: int, n_out: int, opt_scale: float | None) -> float:
    # ATen's area_pixel_compute_scale (align_corners=False): the inverse of an explicit output/input scale
    return 1.0 / opt_scale if opt_scale is not None and opt_scale > 0.0 else n_in / n_out


class _Pass(NamedTuple):
    """One axis's weights as an (n_out, n_in) CSR matrix. ``weights``: ATen's int16 weights as int32, or
    where ``exact`` as float32 and scaled by ``2^-precision`` (see :func:`_apply`)."""

    n_in: int
    n_out: int
    indptr: np.ndarray
    indices: np.ndarray
    weights: np.ndarray
    precision: int  # the weights' fixed-point bits: the shift after the sum
    exact: bool  # float32 gives ATen's sums exactly, and none passes 255 after the shift


@functools.lru_cache(maxsize=1024)  # a square image's two axes share one
def _pass(n_in: int, n_out: int, opt_scale: float | None) -> _Pass:
    """The int16 weight table of one axis, as ATen builds it for bilinear with antialias
    (``_compute_indices_weights_aa``, ``_compute_int16_weights_aa``): every step is the same double
    operation in the same order, so the truncations and roundings land on the same side."""
    scale = _scale(n_in, n_out, opt_scale)
    support = scale if scale >= 1.0 else 1.0  # (interp_size / 2) x scale, interp_size 2 for bilinear
    ksize = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = np.arange(0.5, n_out, dtype=np.float64)  # i + 0.5, exact
    center *= scale
    ends = center + np.array([[-support], [support]])  # center - support and center + support
    ends += 0.5
    xmin, counts = ends.astype(np.int64)  # C casts truncate towards zero
    np.maximum(xmin, 0, out=xmin)
    np.minimum(counts, n_in, out=counts)
    counts -= xmin
    np.minimum(np.maximum(counts, 0, out=counts), ksize, out=counts)  # (np.clip costs 3x as much)
    # taps along the first axis, outputs along the second: a sum over axis 0 adds tap after tap, as the
    # C loop does (a sum along a contiguous axis would pair terms up)
    taps = np.arange(ksize)[:, None]
    x = (taps + xmin) - center
    x += 0.5
    if invscale != 1.0:
        x *= invscale
    np.abs(x, out=x)
    w = np.subtract(1.0, x, out=x)
    np.maximum(w, 0.0, out=w)  # the triangle: 1 - |x| where |x| < 1, else 0
    keep = taps < counts  # taps past an output's count weigh 0
    w *= keep
    total = w.sum(axis=0)
    np.divide(w, total, out=w, where=total != 0.0)  # a zero sum (no taps) keeps its zeros
    wt_max = float(w.max(initial=0.0))
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    w *= float(1 << precision)
    w += 0.5  # weights are >= 0: C's (int)(0.5 + v) is the truncation below
    # the largest int32 sum ATen can reach: 255 under every weight, from 1 << (precision - 1); float32
    # holds every integer up to 2^24, and where no sum can pass 255 after the shift, the clamp is a no-op
    # (only a table of some 260 taps could: then, as for every large precision, int32)
    worst = 255 * int(np.trunc(w).sum(axis=0).max(initial=0.0)) + (1 << (precision - 1))
    exact = worst < 1 << 24 and worst >> precision <= 255
    # CSR in row order: the (tap, output) arrays transposed; the weights' truncation in the cast
    keep = keep.T
    wi = w.T.astype(np.int32)[keep]
    indptr = np.zeros(n_out + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    if exact:
        wi = wi.astype(np.float32)
        wi *= np.float32(2.0**-precision)  # 2^-p x an int16: exact
    return _Pass(n_in, n_out, indptr, (taps.T + xmin[:, None]).astype(np.int32)[keep], wi, precision, exact)


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


def _apply(p: _Pass, rows: np.ndarray, dst: np.ndarray | None = None) -> np.ndarray:
    """One pass along the first axis of 2-D uint8 ``rows``: ATen's rounded, shifted and clamped sums, as
    uint8 (into ``dst`` where given; returned)."""
    n_vecs = rows.shape[1]
    if dst is None:
        dst = np.empty((p.n_out, n_vecs), np.uint8)
    kernel = _csr_matvecs()  # scipy's CSR x dense kernel: accumulates into its last argument
    if p.exact:
        # Exact in float32: the weights are ATen's int16 ones times 2^-p and the sum starts from 0.5,
        # ATen's 1 << (p - 1) times 2^-p, so every partial sum is (a non-negative integer no larger than
        # ATen's sum, below 2^24: see _pass) x 2^-p, which float32 holds exactly; no product or addition
        # rounds, whatever the order, fused or not. The sum is then ATen's int32 sum x 2^-p, and its
        # truncation (a C cast of a value >= 0) is ATen's shift: one pass, no int32 array.
        acc = _scratch("acc", p.n_out, n_vecs)
        acc.fill(0.5)
        x = cv2.add(rows, 0, dst=_scratch("x", p.n_in, n_vecs), dtype=cv2.CV_32F)  # (numpy's astype is slower)
        kernel(p.n_out, p.n_in, n_vecs, p.indptr, p.indices, p.weights, x.ravel(), acc.ravel())
        np.copyto(dst, acc, casting="unsafe")
        return dst
    iacc = np.full((p.n_out, n_vecs), 1 << (p.precision - 1), np.int32)  # int32 holds 255 x 2^22 sums
    kernel(p.n_out, p.n_in, n_vecs, p.indptr, p.indices, p.weights, rows.astype(np.int32).ravel(), iacc.ravel())
    np.right_shift(iacc, p.precision, out=iacc)
    return cv2.convertScaleAbs(iacc, dst)  # saturating cast to uint8; the sums are >= 0, the abs changes nothing


def _rows(a: np.ndarray) -> np.ndarray:
    """HWC ``a`` as 2-D ``(h, w x c)``: a view where each row's pixels are contiguous (a crop window)."""
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2])


def _width_pass(p: _Pass, rows: np.ndarray, c: int) -> np.ndarray:
    """The width pass of 2-D ``(h, w x c)`` uint8 ``rows``: ``(h, w' x c)``, one tile of rows at a time.

    A tile is transposed as 2-D uint8, ``(t, w x c) -> (w x c, t)``: row x of its ``(w, c x t)`` view holds
    column x's channels one after the other, so one CSR product on those rows resamples them all; its
    ``(w' x c, t)`` view transposes back into the tile's ``(t, w' x c)`` rows. Rows are independent in this
    pass, so tiles give the same bytes as the whole image at once."""
    h = rows.shape[0]
    mid = np.empty((h, p.n_out * c), np.uint8)
    for y0 in range(0, h, TILE_ROWS):
        tile = rows[y0 : y0 + TILE_ROWS]
        t = tile.shape[0]
        resampled = _apply(p, cv2.transpose(tile).reshape(p.n_in, c * t)).reshape(p.n_out * c, t)
        target = mid[y0 : y0 + t]  # whole rows of a C-contiguous array: contiguous, written in place
        cv2.transpose(resampled, dst=target)
    return mid


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
    mid = _rows(src)
    if w_in != w_out:
        mid = _width_pass(_pass(w_in, w_out, scales[1]), mid, c)
    if h_in == h_out:
        out[...] = mid.reshape(h_out, w_out, c)
    elif out.strides[1:] == (c, 1):  # each row's pixels contiguous (a letterbox window): written in place
        _apply(_pass(h_in, h_out, scales[0]), mid, _rows(out))
    else:
        out[...] = _apply(_pass(h_in, h_out, scales[0]), mid).reshape(h_out, w_out, c)
