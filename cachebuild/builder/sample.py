"""One source file -> one fixed S x S x 3 RGB uint8 sample, written into a caller's slot.

bytes -> header probe (size limit, truncation) -> decode (a JPEG at DCT scale 1/2, 1/4 or 1/8 when the source
is at least 4x, 8x or 16x what the fit needs) -> the fit's window of the source -> resize into the slot.

The reference is torchvision's PIL pipeline, ``Resize(S)`` + ``CenterCrop(S)`` (``--fit crop``): PIL's
antialiased bilinear, whose triangle filter widens with the downscale factor. Here the window that pipeline
keeps is computed exactly, in fractional source pixels, and resampled by two well-kept kernels:

- downscales under :data:`ANTIALIAS_FROM` (most photos to 224 px): OpenCV's bilinear ``warpAffine`` of the
  exact window. PIL's filter is within one source pixel of plain bilinear there, and this is ~3x cheaper;
- larger downscales: torch's antialiased bilinear (``torch.nn.functional.interpolate(antialias=True)``, the
  kernel of torchvision's tensor ``resize``: PIL's filter) of the window rounded to whole pixels. torch is
  imported at the first such sample.

``cachebuild parity`` and the tests hold the median PSNR against the reference at >= 40 dB. What shapes these
pixels is :data:`PIXEL_RECIPE`, recorded in the build key: a cache made by an earlier recipe still reads and
verifies, and ``status`` and ``--update`` name it.

EXIF orientation is ignored by default, as torchvision's PIL-based ``ImageFolder`` ignores it; with
``exif_orientation="apply"`` the decoded pixels are turned upright first, as PIL's ``ImageOps.exif_transpose``
turns them (the tag read by PIL, so JPEG, PNG, WebP and TIFF, and XMP's orientation, count as there), and the
recorded size is the upright one.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import simplejpeg

from cachebuild.errors import DecodeError

__all__ = ["ANTIALIAS_FROM", "DEFAULT_MAX_PIXELS", "EXIF_ORIENTATIONS", "FITS", "INTERPOLATIONS", "PIXEL_RECIPE",
           "Placement", "ResizeSpec", "decode_into", "exif_orientation", "letterbox", "one_thread_each", "orient",
           "pixel_tools", "probe", "reduction", "scaled_window", "window"]

FITS = ("crop", "squash", "pad")
INTERPOLATIONS = ("antialias", "area", "linear")
EXIF_ORIENTATIONS = ("ignore", "apply")
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's decompression-bomb error threshold (2 x MAX_IMAGE_PIXELS)
ANTIALIAS_FROM = 2.0  # "antialias": the downscale factor from which the filter widens with the factor
# The version of how a source file becomes a sample's pixels (decode, window, kernels). Caches without it
# were made by recipe 1: PIL's filter from a copy of torch's kernel, windows rounded to whole pixels.
PIXEL_RECIPE = 2


def pixel_tools() -> dict[str, str]:
    """The versions of the libraries whose code makes a sample's pixels (the manifest's ``tool`` records them)."""
    from importlib.metadata import version

    return {"opencv": cv2.__version__, "simplejpeg": version("simplejpeg"), "torch": version("torch")}


@dataclass(frozen=True)
class ResizeSpec:
    size: int
    fit: str = "crop"
    interpolation: str = "antialias"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = True
    exif_orientation: str = "ignore"  # or "apply"


@dataclass(frozen=True)
class Placement:
    """What became of one source: its original size and where its real pixels sit in the sample."""

    height: int
    width: int
    box: tuple[int, int, int, int]  # (y0, x0, y1, x1), end-exclusive; the whole sample unless fit=pad


# ------------------------------------------------------------------------------------------------ header

# PIL's bomb limit is a module global: lifted under this lock for header reads
PIL_LIMIT_LOCK = threading.Lock()
# JPEG start-of-frame markers (baseline, extended, progressive, lossless...): C0-CF except DHT, JPG, DAC.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_or_png_size(data: bytes) -> tuple[int, int, str] | None:
    """(height, width, format) read straight from a JPEG SOF or PNG IHDR; None leaves the file to PIL, whose
    generic open parses tables a size does not need. Anything unusual (no SOF before the scan, a zero height
    that a DNL marker would define later, other formats) goes to PIL, which also names the damage."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big"), "PNG"
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            height, width = int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
            return (height, width, "JPEG") if height and width else None
        if marker in (0xDA, 0xD9):  # scan or end of image before any frame header
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


@contextlib.contextmanager
def _pil_unlimited() -> Iterator[None]:
    """PIL's own bomb check off (ours, ``max_pixels``, is applied from the header), under a lock."""
    from PIL import Image

    with PIL_LIMIT_LOCK:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _pil_size(data: bytes) -> tuple[int, int, str]:
    from PIL import Image

    try:
        with _pil_unlimited(), Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            return height, width, im.format or "?"
    except Image.UnidentifiedImageError:
        raise ValueError("not an image (unrecognised file header)") from None
    except Exception as e:  # PIL raises SyntaxError, OSError... for damaged headers
        raise ValueError(f"damaged image header ({type(e).__name__}: {e})") from None


def probe(data: bytes, max_pixels: int) -> tuple[int, int, str]:
    """(height, width, format) from the header alone; refuses empty, non-image, oversized and truncated data."""
    if not data:
        raise ValueError("empty file (0 bytes)")
    height, width, fmt = _jpeg_or_png_size(data) or _pil_size(data)
    if width * height > max_pixels:
        raise ValueError(
            f"refused before decoding: {width}x{height} = {width * height:,} pixels is over the limit of "
            f"{max_pixels:,} (raise it with --max-pixels if the image is genuine)"
        )
    # OpenCV decodes a truncated JPEG without error and fills the rest with grey: check the end marker
    # (after any trailing padding; the common case is decided on the last 16 bytes without a copy).
    eoi = b"\xff\xd9"
    if fmt in ("JPEG", "MPO") and eoi not in data[-16:] and eoi not in data.rstrip(b"\x00\r\n\t ")[-16:]:
        raise ValueError("truncated JPEG (no end-of-image marker)")
    if fmt == "PNG":
        if b"IEND" not in data[-16:]:
            raise ValueError("truncated PNG (no IEND chunk)")
        _check_png_chunks(data)
    return height, width, fmt


def _check_png_chunks(data: bytes) -> None:
    """Every chunk must fit in the file: OpenCV allocates what a chunk's length field declares before reading
    it, so a 4 KB file declaring a 2 GB IDAT would cost 2 GB of memory."""
    pos, n = 8, len(data)
    while pos + 8 <= n:
        length = int.from_bytes(data[pos : pos + 4], "big")
        if pos + 12 + length > n:
            kind = data[pos + 4 : pos + 8].decode("latin-1")
            raise ValueError(f"damaged PNG: chunk {kind!r} declares {length:,} bytes past the end of the file")
        if data[pos + 4 : pos + 8] == b"IEND":
            return
        pos += 12 + length


# ---------------------------------------------------------------------------------------------- geometry

def reduction(h: int, w: int, spec: ResizeSpec) -> int:
    """Largest JPEG DCT scale 1/r that leaves at least 2 S pixels along every side the fit needs: with less
    margin the final resize has almost no filtering left to do, and the sample drifts from the reference."""
    need = max(h, w) if spec.fit == "pad" else min(h, w)
    for r in (8, 4, 2):
        if need >= 2 * r * spec.size:
            return r
    return 1


def window(h: int, w: int, spec: ResizeSpec) -> tuple[float, float, float, float]:
    """The part ``(y0, x0, y1, x1)`` of an h x w source, in fractional pixels, that becomes the sample: for
    ``crop`` what torchvision's ``Resize(S)`` + ``CenterCrop(S)`` keeps, else the whole source."""
    if spec.fit != "crop":
        return 0.0, 0.0, float(h), float(w)
    s = spec.size
    nh, nw = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)  # Resize(S)'s size
    top, left = round((nh - s) / 2), round((nw - s) / 2)  # CenterCrop's offsets in it
    return top * h / nh, left * w / nw, (top + s) * h / nh, (left + s) * w / nw


def letterbox(h: int, w: int, s: int) -> tuple[int, int, int, int]:
    """Where ``--fit pad`` puts an h x w image in its S x S sample: ``(y0, x0, y1, x1)``, aspect kept."""
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    y0, x0 = (s - nh) // 2, (s - nw) // 2
    return y0, x0, y0 + nh, x0 + nw


# ------------------------------------------------------------------------------------------------ resize

class _Threads(threading.local):
    decoded: np.ndarray | None = None  # this thread's decode buffer, reused (a fresh one is page-faulted in)


_HERE = _Threads()
_REUSE_BYTES = 32 << 20  # larger decodes get an array of their own: a rare giant image keeps no memory behind
# Inside one_thread_each: [torch's thread count before it], or [-1] while torch is not imported; else empty.
_TORCH_THREADS: list[int] = []
_TORCH_LOCK = threading.Lock()


@contextlib.contextmanager
def one_thread_each() -> Iterator[None]:
    """OpenCV and torch on one thread each for the ``with`` block, then as they were: the build's
    parallelism is its ``--jobs`` workers, and a kernel's own threads on top of them only contend (torch's
    spin up for every small image)."""
    saved = cv2.getNumThreads()
    cv2.setNumThreads(1)
    torch = sys.modules.get("torch")
    _TORCH_THREADS[:] = [torch.get_num_threads()] if torch is not None else [-1]
    if torch is not None:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(saved)
        torch, before = sys.modules.get("torch"), _TORCH_THREADS[:1]
        if torch is not None and before and before[0] > 0:
            torch.set_num_threads(before[0])
        _TORCH_THREADS.clear()


def _torch() -> Any:
    """torch, imported at the first antialiased downscale; within :func:`one_thread_each` it then runs on
    one thread, its count before restored when the block ends."""
    import torch

    with _TORCH_LOCK:
        if _TORCH_THREADS[:1] == [-1]:
            _TORCH_THREADS[0] = torch.get_num_threads()
            torch.set_num_threads(1)
    return torch


def scaled_window(win: tuple[float, float, float, float], oh: int, ow: int) -> tuple[float, float, int, int]:
    """(sy, sx, top, left): the scale that makes the window ``win`` ``oh`` x ``ow``, and where the window
    starts in the image so scaled, in whole pixels (a window's offsets there are whole: CenterCrop's)."""
    y0, x0, y1, x1 = win
    sy, sx = oh / (y1 - y0), ow / (x1 - x0)
    return sy, sx, round(y0 * sy), round(x0 * sx)


def _short(n: int, scale: float, want: int) -> int:
    """How many rows ``n`` input rows lack for torch to give ``want`` output rows at ``scale`` (its output has
    ``floor(n * scale)`` rows, computed in doubles as here)."""
    k = 0
    while math.floor((n + k) * scale) < want:
        k += 1
    return k


def _resize_into(img: np.ndarray, win: tuple[float, float, float, float], out: np.ndarray, how: str) -> None:
    """The window ``win`` (y0, x0, y1, x1, fractional pixels of ``img``) of HWC ``img`` resized into ``out``."""
    y0, x0, y1, x1 = win
    oh, ow = out.shape[:2]
    factor = max((y1 - y0) / oh, (x1 - x0) / ow)
    if how == "linear" or (how == "antialias" and factor < ANTIALIAS_FROM):
        sy, sx = (y1 - y0) / oh, (x1 - x0) / ow  # output pixel centre -> source position, half-pixel centres
        m = np.array([[sx, 0.0, x0 + 0.5 * sx - 0.5], [0.0, sy, y0 + 0.5 * sy - 0.5]])
        flags = cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP
        if out.flags.c_contiguous:
            cv2.warpAffine(img, m, (ow, oh), dst=out, flags=flags, borderMode=cv2.BORDER_REPLICATE)
        else:  # a letterbox window inside the slot
            out[...] = cv2.warpAffine(img, m, (ow, oh), flags=flags, borderMode=cv2.BORDER_REPLICATE)
        return
    if how == "area":  # OpenCV's pixel-area average, of the window in whole pixels; it upscales like nearest
        ya, xa = min(round(y0), img.shape[0] - 1), min(round(x0), img.shape[1] - 1)
        src = img[ya : max(ya + 1, round(y1)), xa : max(xa + 1, round(x1))]
        flag = cv2.INTER_AREA if src.shape[0] >= oh and src.shape[1] >= ow else cv2.INTER_LINEAR
        out[...] = cv2.resize(src, (ow, oh), interpolation=flag)
        return
    # As the reference does: the whole image resized at the window's scale by torch's kernel, then the window
    # cut out of the result (torchvision's CenterCrop of its Resize)
    sy, sx, top, left = scaled_window(win, oh, ow)
    short = (_short(img.shape[0], sy, top + oh), _short(img.shape[1], sx, left + ow))
    if any(short):  # an extent that rounds past the image's edge: its last row or column again
        img = np.pad(img, ((0, short[0]), (0, short[1]), (0, 0)), mode="edge")
    torch = _torch()
    x = torch.from_numpy(img).permute(2, 0, 1)[None]  # an NCHW view of the HWC pixels: torch's fast layout
    y = torch.nn.functional.interpolate(x, scale_factor=(sy, sx), mode="bilinear", antialias=True,
                                        recompute_scale_factor=False)
    out[...] = y[0, :, top : top + oh, left : left + ow].permute(1, 2, 0).numpy()


# ------------------------------------------------------------------------------------------- orientation

# PNG chunks PIL takes an orientation from (eXIf, ImageMagick's exif profile, XMP): without any, PIL would decode
# the whole image to look for one, so their names are searched for first.
_PNG_EXIF_CHUNKS = (b"eXIf", b"Raw profile type exif", b"XML:com.adobe.xmp")


def exif_orientation(data: bytes, fmt: str) -> int:
    """The EXIF orientation (1-8) PIL's ``ImageOps.exif_transpose`` would apply to this file; 1 when it has none,
    0 when its EXIF cannot be read (PIL's transpose would leave such a file as stored)."""
    if fmt == "PNG" and not any(name in data for name in _PNG_EXIF_CHUNKS):
        return 1
    from PIL import Image

    try:
        with _pil_unlimited():  # PIL's bomb check runs when a file is opened; the exif is read after the lock
            im = Image.open(io.BytesIO(data))
        with im:
            value = im.getexif().get(0x0112, 1)
    except Exception:  # a damaged EXIF block tells no orientation; the decode decides whether the image is good
        return 0
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


# orientation -> (transposed, rows flipped, columns flipped): what PIL's exif_transpose does to the stored pixels
# (the transpose first, then the flips of the upright image's axes)
_TURNS = {1: (False, False, False), 2: (False, False, True), 3: (False, True, True), 4: (False, True, False),
          5: (True, False, False), 6: (True, False, True), 7: (True, True, True), 8: (True, True, False)}


def orient(img: np.ndarray, orientation: int) -> np.ndarray:
    """``img`` (H, W, C) turned upright for EXIF ``orientation``, as PIL's ``exif_transpose`` turns it."""
    transposed, flip_rows, flip_cols = _TURNS[orientation]
    out = img.transpose(1, 0, 2) if transposed else img
    out = out[::-1] if flip_rows else out
    return np.ascontiguousarray(out[:, ::-1] if flip_cols else out)


def _stored_window(win: tuple[float, float, float, float], h: int, w: int,
                   orientation: int) -> tuple[float, float, float, float]:
    """The window ``win`` of the upright h x w image, in the stored image's frame. A sample is resized from the
    pixels as stored and turned afterwards: resampling commutes with flips and transposes, and a reduced (DCT
    scaled) decode keeps its partial edge pixel at the far end, where the geometry expects it."""
    transposed, flip_rows, flip_cols = _TURNS[orientation]
    y0, x0, y1, x1 = win
    if flip_rows:
        y0, y1 = h - y1, h - y0
    if flip_cols:
        x0, x1 = w - x1, w - x0
    return (x0, y0, x1, y1) if transposed else (y0, x0, y1, x1)


# ------------------------------------------------------------------------------------------------ decode

# imdecode flags, full or DCT-reduced by 1/r. OpenCV >= 4.11 gives RGB straight from libjpeg; older
# versions decode BGR, swapped with one cvtColor pass.
_RGB_DIRECT = hasattr(cv2, "IMREAD_COLOR_RGB")
_DECODE_FLAGS = {
    r: ((flag & ~cv2.IMREAD_COLOR) | cv2.IMREAD_COLOR_RGB if _RGB_DIRECT else flag) | cv2.IMREAD_IGNORE_ORIENTATION
    for r, flag in {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                    8: cv2.IMREAD_REDUCED_COLOR_8}.items()
}
# Where OpenCV's pixels differ from PIL's ``convert("RGB")``, the reference's loader: a GIF's transparent
# pixels (OpenCV paints them another colour) and a TIFF with unassociated alpha (libtiff premultiplies).
_STRAIGHT_ALPHA_MODES = frozenset({"RGBA", "LA", "PA"})


def _pil_rgb(data: bytes, fmt: str) -> np.ndarray | None:
    """RGB pixels of a GIF or a straight-alpha TIFF as torchvision's loader decodes them (PIL, first frame,
    alpha dropped); None leaves every other file to OpenCV."""
    if fmt not in ("GIF", "TIFF"):
        return None
    from PIL import Image

    with _pil_unlimited():
        im = Image.open(io.BytesIO(data))
    with im:
        if fmt == "TIFF" and im.mode not in _STRAIGHT_ALPHA_MODES:
            return None
        try:
            return np.asarray(im.convert("RGB"))
        except Exception as e:  # PIL raises OSError, SyntaxError... for damaged data
            raise ValueError(f"damaged {fmt} data ({type(e).__name__}: {e})") from None


def _turbo_rgb(data: bytes, h: int, w: int, r: int) -> np.ndarray | None:
    """RGB decode at DCT scale 1/``r`` by libjpeg-turbo (simplejpeg) into this thread's reused buffer, or None
    to leave the file to OpenCV: the same decoder and settings as ``cv2.imdecode`` (islow DCT, fancy
    upsampling, the same scaled IDCTs), so the same pixels, without a copy of the input or a fresh output
    array per image. ``strict``: any libjpeg warning (damaged data) leaves the file to OpenCV."""
    oh, ow = -(-h // r), -(-w // r)  # libjpeg's scaled output size: ceil
    n = oh * ow * 3
    buf = _HERE.decoded
    if n > _REUSE_BYTES:
        buf = np.empty(n, np.uint8)
    elif buf is None or buf.size < n:
        buf = _HERE.decoded = np.empty(max(n, 1 << 20), np.uint8)
    try:
        if r == 1:
            img = simplejpeg.decode_jpeg(data, "RGB", buffer=buf[:n], strict=True)
        else:  # the largest scale with at least these sides and a factor of at least r: exactly 1/r
            img = simplejpeg.decode_jpeg(data, "RGB", min_height=oh, min_width=ow, min_factor=r, buffer=buf[:n],
                                         strict=True)
    except ValueError:
        return None
    return img if img.shape[:2] == (oh, ow) else None


def _decode(data: bytes, h: int, w: int, fmt: str, r: int) -> np.ndarray:
    img = _turbo_rgb(data, h, w, r) if fmt == "JPEG" else _pil_rgb(data, fmt)
    if img is None:
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), _DECODE_FLAGS[r])
        if img is None:
            raise ValueError(f"OpenCV could not decode this {fmt} file")
        if not _RGB_DIRECT:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return img


def decode_into(data: bytes | np.ndarray, spec: ResizeSpec, out: np.ndarray, *, path: str = "") -> Placement:
    """Decode one source (encoded bytes, or RGB pixels already decoded) into ``out`` (S, S, 3) uint8 RGB;
    raises :class:`DecodeError` naming ``path``."""
    try:
        turn = 1
        if isinstance(data, np.ndarray):  # already-decoded RGB pixels (CIFAR, peers' raw fields)
            img, (h, w), r = data, data.shape[:2], 1
        else:
            h, w, fmt = probe(data, spec.max_pixels)
            r = reduction(h, w, spec) if spec.reduced_decode and fmt == "JPEG" else 1
            img = _decode(data, h, w, fmt, r)
            if spec.exif_orientation == "apply":
                turn = exif_orientation(data, fmt) or 1
        # a DCT-scaled decode is ceil(h / r) x ceil(w / r), of which the image spans h / r x w / r
        ih, iw = img.shape[:2]
        ky, kx = (1 / r, 1 / r) if (ih, iw) == (-(-h // r), -(-w // r)) else (ih / h, iw / w)
        uh, uw = (w, h) if _TURNS[turn][0] else (h, w)  # the upright size
        y0, x0, y1, x1 = _stored_window(window(uh, uw, spec), uh, uw, turn)
        win = (y0 * ky, x0 * kx, y1 * ky, x1 * kx)
        s = spec.size
        box = letterbox(uh, uw, s) if spec.fit == "pad" else (0, 0, s, s)
        if spec.fit == "pad":
            out[...] = 0
        region = out[box[0] : box[2], box[1] : box[3]]
        if turn == 1:
            _resize_into(img, win, region, spec.interpolation)
        else:
            stored = np.empty((region.shape[1], region.shape[0], 3) if _TURNS[turn][0] else region.shape, np.uint8)
            _resize_into(img, win, stored, spec.interpolation)
            region[...] = orient(stored, turn)
        return Placement(uh, uw, box)
    except DecodeError:
        raise
    except (ValueError, cv2.error) as e:
        raise DecodeError(path, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__) from None
    except Exception as e:  # anything else one file triggers (a kernel's RuntimeError...) is that file's skip
        text = str(e).strip()
        raise DecodeError(path, f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}") from None

