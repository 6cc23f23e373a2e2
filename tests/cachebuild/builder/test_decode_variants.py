"""Decode variants against the reference torchvision's ``ImageFolder`` serves (PIL ``convert("RGB")``, then
the fit): formats with alpha, palettes, 16 bits, frames, and the DCT-reduced JPEG path at odd sizes."""

from __future__ import annotations

import functools
import io
import warnings

import cv2
import numpy as np
import pytest
import torchvision.transforms as T
from PIL import Image

from cachebuild.builder.sample import ResizeSpec, decode_into, letterbox, reduction
from cachebuild.samples.photos import photo_bank


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def _ours(data: bytes, spec: ResizeSpec) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    out = np.empty((spec.size, spec.size, 3), np.uint8)
    placed = decode_into(data, spec, out, path="x")
    return out, placed.box


def _pil_then_our_fit(data: bytes, spec: ResizeSpec) -> np.ndarray:
    """PIL's decode as torchvision's loader does it, then our own fit: isolates the decode."""
    with Image.open(io.BytesIO(data)) as im, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PIL's note on a palette PNG with a tRNS table
        rgb = np.ascontiguousarray(np.asarray(im.convert("RGB")))
    out = np.empty((spec.size, spec.size, 3), np.uint8)
    decode_into(rgb, spec, out)  # pixels: only the fit
    return out


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def _photo() -> tuple[np.ndarray, np.ndarray]:
    """A real photo (360 x 470) and an alpha plane with transparent, half and opaque regions."""
    photo = np.ascontiguousarray(photo_bank()[0][1][:360, :470])
    h, w = photo.shape[:2]
    alpha = np.zeros((h, w), np.uint8)
    alpha[:, w // 2 :] = 255
    alpha[h // 3 :, :] = 128
    return photo, alpha


def _variants() -> dict[str, bytes]:
    photo, alpha = _photo()
    pim, rgba = Image.fromarray(photo), Image.fromarray(np.dstack([photo, alpha]), "RGBA")
    frames = [rgba, Image.fromarray(np.dstack([255 - photo, alpha]), "RGBA")]
    pal = pim.convert("P", palette=Image.ADAPTIVE, colors=64)
    return {
        "png_rgba": _save(rgba, "PNG"),
        "png_la": _save(Image.fromarray(np.dstack([photo[..., 1], alpha]), "LA"), "PNG"),
        "png_palette_trns": _save(pal, "PNG", transparency=5),
        "png_rgba_as_palette": _save(rgba.convert("P"), "PNG"),
        "png_rgb48": cv2.imencode(".png", photo[..., ::-1].astype(np.uint16) * 257)[1].tobytes(),
        "bmp_rgba": cv2.imencode(".bmp", np.dstack([photo[..., ::-1], alpha]))[1].tobytes(),
        "webp_rgba": _save(rgba, "WEBP", quality=90),
        "webp_animated": _save(frames[0], "WEBP", save_all=True, append_images=frames[1:]),
        "tiff_multipage": _save(pim, "TIFF", save_all=True, append_images=[Image.fromarray(photo[::-1].copy())]),
        "tiff_cmyk": _save(pim.convert("CMYK"), "TIFF"),
        # these two decoded differently from PIL before (OpenCV premultiplied / recoloured transparency)
        "tiff_rgba": _save(rgba, "TIFF"),
        "tiff_rgba_lzw": _save(rgba, "TIFF", compression="tiff_lzw"),
        "gif_transparent_index": _save(pal, "GIF", transparency=5),
        "gif_from_rgba": _save(rgba, "GIF"),
        "gif_animated_alpha": _save(frames[0], "GIF", save_all=True, append_images=frames[1:], disposal=2),
    }


@pytest.mark.parametrize("kind", list(_variants()))
def test_decodes_like_pil_convert_rgb(kind: str) -> None:
    """Alpha is dropped, not composited; palettes, transparency indices and 16-bit RGB map as PIL maps them;
    a multi-frame file gives its first frame. Fails before the fix for TIFFs with unassociated alpha (9 dB:
    libtiff premultiplies) and GIFs with a transparent index (18-33 dB: OpenCV recolours those pixels)."""
    data = _variants()[kind]
    spec = ResizeSpec(224)
    ours, ref = _ours(data, spec)[0], _pil_then_our_fit(data, spec)
    assert np.array_equal(ours, ref), f"{kind}: {psnr(ours, ref):.1f} dB"


def test_16_bit_gray_is_scaled_not_clipped() -> None:
    """A deliberate difference, pinned: a 16-bit grayscale PNG/TIFF keeps its picture (OpenCV scales by
    1/256), where PIL's convert("RGB") of mode I;16 clips every value over 255 to white."""
    gray = _photo()[0][..., 1]
    for ext in (".png", ".tiff"):
        data = cv2.imencode(ext, gray.astype(np.uint16) * 257)[1].tobytes()
        ours, _ = _ours(data, ResizeSpec(224))
        expected = _pil_then_our_fit(cv2.imencode(".png", gray)[1].tobytes(), ResizeSpec(224))
        assert np.array_equal(ours, expected), ext
        assert _pil_then_our_fit(data, ResizeSpec(224)).mean() > 230  # PIL: nearly all white


def _pil_reference(pim: Image.Image, spec: ResizeSpec) -> np.ndarray:
    s, (w, h) = spec.size, pim.size
    if spec.fit == "crop":
        return np.asarray(T.CenterCrop(s)(T.Resize(s)(pim)))
    if spec.fit == "squash":
        return np.asarray(pim.resize((s, s), Image.BILINEAR))
    y0, x0, y1, x1 = letterbox(h, w, s)
    ref = np.zeros((s, s, 3), np.uint8)
    ref[y0:y1, x0:x1] = np.asarray(pim.resize((x1 - x0, y1 - y0), Image.BILINEAR))
    return ref


@functools.lru_cache(maxsize=1)
def _odd_jpegs() -> list[bytes]:
    """Ten photos at odd sizes 257-639 x 0.7-2x that (at 64 px) decode at 1/2 or 1/4 by the DCT."""
    rng, bank, out = np.random.default_rng(3), photo_bank(), []
    for k in range(10):
        h = int(rng.integers(4 * 64, 10 * 64)) | 1
        w = int(h * rng.uniform(0.7, 2.0)) | 1
        big = cv2.resize(bank[k % len(bank)][1], (w, h), interpolation=cv2.INTER_CUBIC)
        out.append(_save(Image.fromarray(big), "JPEG", quality=92))
    return out


@pytest.mark.parametrize(("fit", "floor"), [("crop", 43.0), ("squash", 48.0), ("pad", 48.0)])
def test_reduced_decode_of_odd_sizes_keeps_the_sources_geometry(fit: str, floor: float) -> None:
    """libjpeg's 1/r output is ceil(h/r) x ceil(w/r), its last row and column from a partial block. Fitting
    that as if it were the whole image stretched and shifted it: median PSNR against PIL measured crop
    38.7, squash 41.5, pad 39.1 dB before the fix (45.7, 53.9, 51.9 after; 49-81 dB for a full decode)."""
    spec = ResizeSpec(64, fit=fit)
    scores = []
    for data in _odd_jpegs():
        with Image.open(io.BytesIO(data)) as im:
            pim = im.convert("RGB")
        assert reduction(pim.height, pim.width, spec) > 1
        ours, box = _ours(data, spec)
        scores.append(psnr(ours, _pil_reference(pim, spec)))
        assert box == _ours(data, ResizeSpec(64, fit=fit, reduced_decode=False))[1]
    assert np.median(scores) >= floor, sorted(scores)
    assert min(scores) >= 33.0, sorted(scores)


def test_pad_box_is_the_sources_letterbox_whatever_the_decode_scale() -> None:
    """A 257 x 523 JPEG at 64 px decodes at 1/4 as 65 x 131, whose letterbox is 32 rows (31.8 rounded);
    the source's is 31 (31.4), as a full-scale decode gives. The box and the pixels must follow the source
    whatever the DCT scale: fails before the fix (box (16, 0, 48, 64))."""
    img = cv2.resize(photo_bank()[1][1], (523, 257), interpolation=cv2.INTER_AREA)
    data = _save(Image.fromarray(img), "JPEG", quality=92)
    spec = ResizeSpec(64, fit="pad")
    assert reduction(257, 523, spec) == 4
    out, box = _ours(data, spec)
    assert box == letterbox(257, 523, 64) == (16, 0, 47, 64)
    outside = np.ones((64, 64), bool)
    outside[box[0] : box[2], box[1] : box[3]] = False
    assert not out[outside].any()
    assert out[box[2] - 1].std() > 3  # the box's last row holds picture, not a zero pad
