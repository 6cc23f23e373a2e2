"""One source image -> one fixed S x S x 3 RGB uint8 sample, written into a caller's slot.

bytes -> header probe (size limit, truncation) -> ``cv2.imdecode`` (reduced DCT decode at 1/2, 1/4, 1/8
when the source is >= 4x/8x/16x what the fit needs) -> crop/squash/pad geometry -> antialiased resize -> RGB slot.

EXIF orientation is ignored (``IMREAD_IGNORE_ORIENTATION``), as torchvision's PIL-based ``ImageFolder``
ignores it: the cache holds the pixels a torchvision pipeline would have seen.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass

import cv2
import numpy as np

from cachebuild.errors import DecodeError

__all__ = ["FITS", "INTERPOLATIONS", "Placement", "ResizeSpec", "decode_into", "fit_into", "probe"]

FITS = ("crop", "squash", "pad")
INTERPOLATIONS = ("antialias", "area", "linear")
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's decompression-bomb error threshold (2 x MAX_IMAGE_PIXELS)

_REDUCED = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}
# OpenCV >= 4.10 decodes straight to RGB; reduced modes are BGR-only, so those are swapped after resizing.
_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)
_PIL_LIMIT_LOCK = threading.Lock()


@dataclass(frozen=True)
class ResizeSpec:
    size: int
    fit: str = "crop"
    interpolation: str = "antialias"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = True


@dataclass(frozen=True)
class Placement:
    """What became of one source: its original size and where its real pixels sit in the sample."""

    height: int
    width: int
    box: tuple[int, int, int, int]  # (y0, x0, y1, x1), end-exclusive; the whole sample unless fit=pad


def probe(data: bytes, max_pixels: int) -> tuple[int, int, str]:
    """(height, width, format) from the header alone; refuses empty, non-image, oversized and truncated data."""
    from PIL import Image

    if not data:
        raise ValueError("empty file (0 bytes)")
    try:
        # PIL's own bomb check would refuse at its fixed limit before ours is applied: lift it for the
        # header read only (under a lock, as it is a module global).
        with _PIL_LIMIT_LOCK:
            saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            try:
                with Image.open(io.BytesIO(data)) as im:
                    width, height = im.size
                    fmt = im.format or "?"
            finally:
                Image.MAX_IMAGE_PIXELS = saved
    except Image.UnidentifiedImageError:
        raise ValueError("not an image (unrecognised file header)") from None
    except Exception as e:  # PIL raises SyntaxError, OSError... for damaged headers
        raise ValueError(f"damaged image header ({type(e).__name__}: {e})") from None
    if width * height > max_pixels:
        raise ValueError(
            f"refused before decoding: {width}x{height} = {width * height:,} pixels is over the limit of "
            f"{max_pixels:,} (raise it with --max-pixels if the image is genuine)"
        )
    # OpenCV decodes a truncated JPEG without error and fills the rest with grey: check the end marker.
    if fmt == "JPEG" and b"\xff\xd9" not in data.rstrip(b"\x00\r\n\t ")[-16:]:
        raise ValueError("truncated JPEG (no end-of-image marker)")
    if fmt == "PNG" and b"IEND" not in data[-16:]:
        raise ValueError("truncated PNG (no IEND chunk)")
    return height, width, fmt


def _reduction(h: int, w: int, spec: ResizeSpec) -> int:
    """Largest JPEG DCT scale 1/r that leaves at least 2 S pixels along every side the fit needs.

    The margin of 2 is measured: reducing whenever the source is >= r S (no margin) leaves the final
    resize almost no filtering to do, and the cache drifts from torchvision's PIL pipeline (median PSNR
    36 dB at 96 px vs 49 dB with the margin, see tests/test_decode.py).
    """
    need = max(h, w) if spec.fit == "pad" else min(h, w)
    for r in (8, 4, 2):
        if need >= 2 * r * spec.size:
            return r
    return 1


def _store(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Interleave three (h, w) planes into ``out`` (h, w, 3): ``cv2.merge`` is ~25x faster than numpy's
    strided CHW -> HWC copy, and writes in place when ``out`` is contiguous."""
    if out.flags.c_contiguous and cv2.merge(planes, dst=out) is out:
        return
    out[...] = cv2.merge(planes)


def _resize_into(src: np.ndarray, out: np.ndarray, interpolation: str, bgr: bool) -> None:
    """Resize HWC ``src`` to ``out``'s (h, w), writing RGB (``bgr``: swap channels on the way)."""
    out_h, out_w = out.shape[:2]
    if src.shape[0] == out_h and src.shape[1] == out_w:
        res = src
    elif interpolation == "antialias":
        import torch
        import torch.nn.functional as F

        # Antialiased bilinear = PIL's resample=BILINEAR (torchvision's default). torch's uint8 kernel is
        # ~2x faster than cv2.INTER_AREA on fractional scales and closer to PIL; a contiguous input takes
        # its channels-last fast path. It returns planar CHW, interleaved by _store.
        t = torch.from_numpy(np.ascontiguousarray(src)).permute(2, 0, 1).unsqueeze(0)
        r = F.interpolate(t, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False)[0].numpy()
        _store([r[2], r[1], r[0]] if bgr else [r[0], r[1], r[2]], out)
        return
    else:
        flag = cv2.INTER_AREA if interpolation == "area" else cv2.INTER_LINEAR
        if interpolation == "area" and (out_h > src.shape[0] or out_w > src.shape[1]):
            flag = cv2.INTER_LINEAR  # INTER_AREA upscales like nearest
        res = cv2.resize(src, (out_w, out_h), interpolation=flag)
    if bgr:
        _store([res[..., 2], res[..., 1], res[..., 0]], out)
    else:
        out[...] = res


def fit_into(img: np.ndarray, spec: ResizeSpec, out: np.ndarray, *, bgr: bool = False) -> tuple[int, int, int, int]:
    """Crop/squash/pad ``img`` (H, W, 3) into ``out`` (S, S, 3); returns the valid box in ``out``."""
    h, w = img.shape[:2]
    s = spec.size
    if spec.fit == "squash":
        _resize_into(img, out, spec.interpolation, bgr)
        return (0, 0, s, s)
    if spec.fit == "crop":
        # torchvision Resize(S) + CenterCrop(S), done as crop-then-resize so only kept pixels are resized.
        if h <= w:
            nh, nw = s, int(s * w / h)
        else:
            nh, nw = int(s * h / w), s
        top, left = round((nh - s) / 2), round((nw - s) / 2)
        y0, x0 = round(top * h / nh), round(left * w / nw)
        y1, x1 = round((top + s) * h / nh), round((left + s) * w / nw)
        _resize_into(img[y0:y1, x0:x1], out, spec.interpolation, bgr)
        return (0, 0, s, s)
    # pad: letterbox, keep aspect, zeros around
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    y0, x0 = (s - nh) // 2, (s - nw) // 2
    out[...] = 0
    _resize_into(img, out[y0 : y0 + nh, x0 : x0 + nw], spec.interpolation, bgr)
    return (y0, x0, y0 + nh, x0 + nw)


def decode_into(data: bytes | np.ndarray, spec: ResizeSpec, out: np.ndarray, *, path: str = "") -> Placement:
    """Decode one source into ``out`` (S, S, 3) uint8 RGB; raises :class:`DecodeError` naming ``path``."""
    try:
        if isinstance(data, np.ndarray):  # already-decoded RGB pixels (CIFAR)
            h, w = data.shape[:2]
            box = fit_into(data, spec, out)
            return Placement(h, w, box)
        h, w, fmt = probe(data, spec.max_pixels)
        r = _reduction(h, w, spec) if spec.reduced_decode and fmt == "JPEG" else 1
        buf = np.frombuffer(data, dtype=np.uint8)
        if r > 1:
            img, bgr = cv2.imdecode(buf, _REDUCED[r] | cv2.IMREAD_IGNORE_ORIENTATION), True
        elif _RGB is not None:
            img, bgr = cv2.imdecode(buf, _RGB | cv2.IMREAD_IGNORE_ORIENTATION), False
        else:
            img, bgr = cv2.imdecode(buf, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION), True
        if img is None:
            raise ValueError(f"OpenCV could not decode this {fmt} file")
        box = fit_into(img, spec, out, bgr=bgr)
        return Placement(h, w, box)
    except DecodeError:
        raise
    except (ValueError, cv2.error) as e:
        raise DecodeError(path, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__) from None
