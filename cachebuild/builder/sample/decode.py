"""One source image -> one fixed S x S x 3 RGB uint8 sample, written into a caller's slot.

bytes -> header probe (size limit, truncation) -> ``cv2.imdecode`` (reduced DCT decode at 1/2, 1/4, 1/8
when the source is >= 4x/8x/16x what the fit needs) -> crop/squash/pad geometry -> resize (antialiased from
2x downscale, bilinear below: see ``ANTIALIAS_FROM``) -> RGB slot. The header probe is
:mod:`cachebuild.builder.sample.probe`, the geometry (recipe, crop window, letterbox, DCT scale)
:mod:`cachebuild.builder.sample.geometry`: neither imports OpenCV, so a build's parent never does.

EXIF orientation is ignored (``IMREAD_IGNORE_ORIENTATION``), as torchvision's PIL-based ``ImageFolder``
ignores it: the cache holds the pixels a torchvision pipeline would have seen.
"""

from __future__ import annotations

import io
import math
import sys
from typing import Any

import cv2
import numpy as np

from cachebuild.builder.sample.aa_resize import antialias_into
from cachebuild.builder.sample.buffers import thread_buffer
from cachebuild.builder.sample.geometry import ANTIALIAS_FROM, Placement, ResizeSpec, crop_window, letterbox, reduction
from cachebuild.builder.sample.probe import PIL_LIMIT_LOCK, probe
from cachebuild.errors import DecodeError

__all__ = ["decode_into", "fit_into"]

# imdecode flags, full or DCT-reduced by 1/r. OpenCV >= 4.11 gives RGB straight from libjpeg; older
# versions (still found in prebuilt images) decode BGR, swapped with one cvtColor pass.
_RGB_DIRECT = hasattr(cv2, "IMREAD_COLOR_RGB")
_DECODE_FLAGS = {
    r: ((flag & ~cv2.IMREAD_COLOR) | cv2.IMREAD_COLOR_RGB if _RGB_DIRECT else flag) | cv2.IMREAD_IGNORE_ORIENTATION
    for r, flag in {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                    8: cv2.IMREAD_REDUCED_COLOR_8}.items()
}


def _torch_kernel() -> Any:
    """torch's antialiased kernel where this process has imported torch already (a build worker that was
    told to, or a caller that uses torch anyway), else None: this module never imports it."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch._C._nn._upsample_bilinear2d_aa


# Where OpenCV's pixels differ from PIL's ``convert("RGB")``, the reference torchvision's loader applies:
# a GIF's transparent pixels (OpenCV paints them another colour: 18 dB; OpenCV < 4.11 reads no GIF at all)
# and a TIFF with unassociated alpha (libtiff's RGBA reader premultiplies: half-transparent pixels came out
# darker, transparent ones black: 9 dB). Those files are decoded by PIL (tests/test_decode_variants.py).
_STRAIGHT_ALPHA_MODES = frozenset({"RGBA", "LA", "PA"})


def _pil_rgb(data: bytes, fmt: str) -> np.ndarray | None:
    """RGB pixels of a GIF or a straight-alpha TIFF as torchvision's loader decodes them (PIL, first frame,
    alpha dropped); None leaves every other file to OpenCV. Our ``max_pixels`` was checked already, so
    PIL's own bomb check is lifted for the header read, as in the probe's."""
    if fmt not in ("GIF", "TIFF"):
        return None
    from PIL import Image

    with PIL_LIMIT_LOCK:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            im = Image.open(io.BytesIO(data))
        finally:
            Image.MAX_IMAGE_PIXELS = saved
    with im:
        if fmt == "TIFF" and im.mode not in _STRAIGHT_ALPHA_MODES:
            return None
        try:
            return np.asarray(im.convert("RGB"))
        except Exception as e:  # PIL raises OSError, SyntaxError... for damaged data
            raise ValueError(f"damaged {fmt} data ({type(e).__name__}: {e})") from None



def _antialias_into(src: np.ndarray, out: np.ndarray, extent: tuple[float, float] | None = None) -> None:
    """Antialiased bilinear (PIL's resample=BILINEAR, torchvision's default) of HWC ``src`` into ``out``.

    The bytes of torch's uint8 CPU kernel (``_upsample_bilinear2d_aa``, which caches built before held),
    computed without torch (:mod:`cachebuild.builder.sample.aa_resize`): importing torch cost every build worker
    ~1.9 s of CPU (issue 36). ``extent``: the (h, w) in ``src`` pixels, from its top-left corner, that
    ``out`` spans, when not all of ``src`` (a DCT-reduced decode, see :func:`_fit_reduced`); rows and
    columns past it only feed the filter at the far edge.
    """
    h, w = out.shape[:2]
    scales = (None, None) if extent is None else (h / extent[0], w / extent[1])
    kernel = _torch_kernel()
    if kernel is None:
        antialias_into(src, out, scales)
        return
    torch = sys.modules["torch"]
    x = torch.from_numpy(src[None]).permute(0, 3, 1, 2)  # NHWC views: torch reads the crop view, writes the slot
    if out.flags.c_contiguous:
        kernel(x, [h, w], False, *scales, out=torch.from_numpy(out[None]).permute(0, 3, 1, 2))
    else:  # a letterbox window inside the slot
        out[...] = kernel(x, [h, w], False, *scales)[0].permute(1, 2, 0).numpy()


def _linear_into(src: np.ndarray, out: np.ndarray) -> None:
    """Plain bilinear (half-pixel centres, as PIL and torch): cv2's fixed-point kernel, in place when it can."""
    size = (out.shape[1], out.shape[0])
    if out.flags.c_contiguous:
        cv2.resize(src, size, dst=out, interpolation=cv2.INTER_LINEAR)
    else:
        out[...] = cv2.resize(src, size, interpolation=cv2.INTER_LINEAR)


def _resize_into(src: np.ndarray, out: np.ndarray, interpolation: str) -> None:
    """Resize HWC ``src`` to ``out``'s (h, w)."""
    out_h, out_w = out.shape[:2]
    if src.shape[0] == out_h and src.shape[1] == out_w:
        out[...] = src
    elif interpolation == "antialias":
        # PIL's antialiased bilinear widens its triangle filter to the downscale factor f; for f <= 1 it
        # *is* plain bilinear, which cv2 computes in ~0.6x the time of torch's antialias kernel; up to
        # ANTIALIAS_FROM the difference is small (see there).
        if max(src.shape[0] / out_h, src.shape[1] / out_w) < ANTIALIAS_FROM:
            _linear_into(src, out)
        else:
            _antialias_into(src, out)
    else:
        flag = cv2.INTER_AREA if interpolation == "area" else cv2.INTER_LINEAR
        if interpolation == "area" and (out_h > src.shape[0] or out_w > src.shape[1]):
            flag = cv2.INTER_LINEAR  # INTER_AREA upscales like nearest
        out[...] = cv2.resize(src, (out_w, out_h), interpolation=flag)



def _fit_reduced(img: np.ndarray, h: int, w: int, r: int, spec: ResizeSpec,
                 out: np.ndarray) -> tuple[int, int, int, int]:
    """:func:`fit_into` for ``img``, the 1/``r`` DCT-scaled decode of an h x w JPEG, with the geometry of the
    h x w image. libjpeg's scaled output is ceil(h / r) x ceil(w / r), its last row and column decoded from
    a partial block, so the real image spans only h / r x w / r of it. Fitting the ceil-sized array as if
    it were the image (as before) stretched it by up to (r - 1) / r px and shifted the crop: median PSNR
    against torchvision 38 dB on odd-sized photos against 47 dB on multiples of 8 (tests/test_decode_variants.py).
    Here the window is placed in fractional reduced pixels and the resize is told the true scale; only the
    start of a crop's long side is still rounded, to a whole reduced pixel. Antialias only: it is the kernel
    every reduced decode reaches (the reduction leaves >= 2x downscale, ``ANTIALIAS_FROM``)."""
    s = spec.size
    if spec.fit == "pad":
        box = letterbox(h, w, s)  # from the source's size: the same box as a full-scale decode
        out[...] = 0
        _antialias_into(img, out[box[0] : box[2], box[1] : box[3]], (h / r, w / r))
        return box
    if spec.fit == "squash":
        _antialias_into(img, out, (h / r, w / r))
        return (0, 0, s, s)
    # crop: torchvision's Resize(S) + CenterCrop(S) window, unrounded, in reduced pixels
    nh, nw = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)
    top, left = round((nh - s) / 2), round((nw - s) / 2)
    fy0, fx0, fh, fw = top * h / nh / r, left * w / nw / r, s * h / nh / r, s * w / nw / r
    y0, x0 = round(fy0), round(fx0)
    # one output pixel's worth of rows/columns past the window, when the image has them: the filter's support
    y1 = min(img.shape[0], math.ceil(y0 + fh * (1 + 1 / s)))
    x1 = min(img.shape[1], math.ceil(x0 + fw * (1 + 1 / s)))
    _antialias_into(img[y0:y1, x0:x1], out, (fh, fw))
    return (0, 0, s, s)


def fit_into(img: np.ndarray, spec: ResizeSpec, out: np.ndarray) -> tuple[int, int, int, int]:
    """Crop/squash/pad ``img`` (H, W, 3) into ``out`` (S, S, 3); returns the valid box in ``out``."""
    h, w = img.shape[:2]
    s = spec.size
    if spec.fit == "squash":
        _resize_into(img, out, spec.interpolation)
        return (0, 0, s, s)
    if spec.fit == "crop":
        y0, x0, y1, x1 = crop_window(h, w, s)
        _resize_into(img[y0:y1, x0:x1], out, spec.interpolation)
        return (0, 0, s, s)
    # pad: letterbox, keep aspect, zeros around
    box = letterbox(h, w, s)
    out[...] = 0
    _resize_into(img, out[box[0] : box[2], box[1] : box[3]], spec.interpolation)
    return box


def _turbo_rgb(data: bytes, h: int, w: int, r: int) -> np.ndarray | None:
    """RGB decode at DCT scale 1/``r`` through libjpeg-turbo's TurboJPEG API (simplejpeg) into a reused
    buffer, or None to leave the file to OpenCV. The same libjpeg-turbo decode as ``cv2.imdecode`` (islow
    DCT, fancy upsampling, the same scaled IDCTs as ``IMREAD_REDUCED_*``), so the same pixels
    (tests/test_decode.py), but faster: 0.56 against 0.65 ms for a 430 x 360 photo at full scale, 3.35
    against 3.80 ms for the bench's sources decoded at 1/2 and 1/4 (no copy of the input, no fresh output
    array per image). ``strict``: any libjpeg warning (damaged data) returns None, and OpenCV handles the
    file exactly as before; so does anything else it refuses."""
    import simplejpeg

    oh, ow = -(-h // r), -(-w // r)  # libjpeg's scaled output size: ceil
    buf = thread_buffer("decoded", oh * ow * 3, np.uint8)
    try:
        if r == 1:
            img = simplejpeg.decode_jpeg(data, "RGB", buffer=buf, strict=True)
        else:  # the largest scale with at least these sides and a factor of at least r: exactly 1/r
            img = simplejpeg.decode_jpeg(data, "RGB", min_height=oh, min_width=ow, min_factor=r, buffer=buf,
                                         strict=True)
    except ValueError:
        return None
    return img if img.shape[:2] == (oh, ow) else None


def decode_into(data: bytes | np.ndarray, spec: ResizeSpec, out: np.ndarray, *, path: str = "") -> Placement:
    """Decode one source into ``out`` (S, S, 3) uint8 RGB; raises :class:`DecodeError` naming ``path``."""
    try:
        if isinstance(data, np.ndarray):  # already-decoded RGB pixels (CIFAR)
            h, w = data.shape[:2]
            box = fit_into(data, spec, out)
            return Placement(h, w, box)
        h, w, fmt = probe(data, spec.max_pixels)
        r = reduction(h, w, spec) if spec.reduced_decode and fmt == "JPEG" else 1
        img = _turbo_rgb(data, h, w, r) if fmt == "JPEG" else _pil_rgb(data, fmt)
        if img is None:
            img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), _DECODE_FLAGS[r])
            if img is None:
                raise ValueError(f"OpenCV could not decode this {fmt} file")
            if not _RGB_DIRECT:
                img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if r > 1 and spec.interpolation == "antialias" and img.shape[:2] == (-(-h // r), -(-w // r)):
            box = _fit_reduced(img, h, w, r, spec, out)
        else:
            box = fit_into(img, spec, out)
        return Placement(h, w, box)
    except DecodeError:
        raise
    except (ValueError, cv2.error) as e:
        raise DecodeError(path, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__) from None
    except Exception as e:  # anything else one file triggers (a kernel's RuntimeError...) is that file's skip
        text = str(e).strip()
        raise DecodeError(path, f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}") from None
