"""Pixels: close to torchvision's PIL pipeline, ImageNet's quirks decoded, fits and limits honoured."""

from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image, ImageOps

from cachebuild.builder import sample as decode
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.builder.sample import (
    ANTIALIAS_FROM,
    ResizeSpec,
    _jpeg_or_png_size,
    _pil_size,
    _resize_into,
    decode_into,
    probe,
    reduction,
)
from cachebuild.errors import DecodeError
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def _torchvision_reference(path: Path, size: int) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(T.CenterCrop(size)(T.Resize(size)(im.convert("RGB"))))


@pytest.mark.parametrize("size", [224, 96, 64])
def test_crop_matches_torchvision_pil_resize_centercrop(imagenet_clean, tmp_path, size):
    plan = imagenet_plans(imagenet_clean["root"], "train")[0]
    cache = open_cache(build(plan, tmp_path / "c", BuildOptions(size=size, jobs=1)).path)
    images = cache.gather(np.arange(len(cache)))
    scores = [psnr(img, _torchvision_reference(Path(plan.root) / p, size))
              for img, p in zip(images, cache.paths(), strict=True)]
    assert np.median(scores) >= 40.0, sorted(scores)[:5]  # 42-49 dB measured
    assert min(scores) >= 24.0  # the worst single image: fine texture, a few px of crop offset
    # The large sources went through the reduced DCT decode and still match.
    large = [s for s, (h, w) in zip(scores, cache.sizes.tolist(), strict=True) if min(h, w) >= 4 * size]
    if size == 64:
        assert large and np.median(large) >= 38.0


def test_quirks_decode_like_pil(imagenet_tree, tmp_path):
    quirks = imagenet_tree["quirks"]
    assert set(quirks) >= {"cmyk", "png", "gray", "exif"}
    spec = ResizeSpec(size=128, fit="squash")
    out = np.empty((128, 128, 3), np.uint8)
    for kind, entry in quirks.items():
        path = Path(entry["path"])
        placed = decode_into(path.read_bytes(), spec, out, path=str(path))
        with Image.open(path) as im:  # PIL as ImageFolder opens it: no EXIF transpose
            ref = np.asarray(im.convert("RGB").resize((128, 128), Image.BILINEAR))
            assert (placed.height, placed.width) == (im.height, im.width)
        assert psnr(out, ref) > 30, kind
    # EXIF orientation is ignored, as torchvision's ImageFolder ignores it: the upright image differs.
    rotated = quirks["exif"]
    decode_into(Path(rotated["path"]).read_bytes(), spec, out)
    upright = np.asarray(Image.fromarray(rotated["upright"]).resize((128, 128), Image.BILINEAR))
    assert psnr(out, upright) < 25


# exif_transpose's method for each orientation, and the inverse that stores the upright picture that way
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}
_INVERSE = {**_TRANSPOSE, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def _stored_as(upright: Image.Image, orientation: int, fmt: str = "JPEG") -> bytes:
    """``upright`` stored turned, with the EXIF orientation that tells a viewer to turn it back."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored = upright.transpose(_INVERSE[orientation]) if orientation > 1 else upright
    stored.save(buf, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("fit", ["crop", "pad"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_apply_turns_samples_upright_as_pil_exif_transpose(imagenet_clean, orientation, fit):
    """``exif_orientation="apply"`` gives what torchvision's pipeline gives after ``ImageOps.exif_transpose``, for
    all eight orientations, on a large photo (decoded at a DCT scale: the turned axes' partial edge pixel must not
    shift the window) and a small one; "ignore" (the default) gives the stored pixels, as ImageFolder does."""
    big = next(e for e in imagenet_clean["train"] if e["kind"] == "large")
    with Image.open(big["path"]) as im:
        photos = [im.convert("RGB"), im.convert("RGB").resize((im.width // 5, im.height // 5))]
    for upright in photos:
        data = _stored_as(upright, orientation)
        turned = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        assert turned.size == upright.size
        out = np.empty((64, 64, 3), np.uint8)
        placed = decode_into(data, ResizeSpec(64, fit=fit, exif_orientation="apply"), out)
        assert (placed.height, placed.width) == (upright.height, upright.width)  # the upright size
        if fit == "crop":
            ref = np.asarray(T.CenterCrop(64)(T.Resize(64)(turned)))
        else:
            y0, x0, y1, x1 = placed.box
            ref = np.zeros_like(out)
            ref[y0:y1, x0:x1] = np.asarray(turned.resize((x1 - x0, y1 - y0), Image.BILINEAR))
        assert psnr(out, ref) >= 40, (orientation, upright.size, psnr(out, ref))  # 48-60 dB measured
        stored = np.empty_like(out)
        decode_into(data, ResizeSpec(64, fit=fit), stored)  # ignore: the stored pixels
        if orientation != 1:  # 1: the same pixels either way
            assert psnr(stored, ref) < psnr(out, ref) - 10, orientation


def test_exif_orientation_of_png_and_webp_is_read_as_pil_reads_it():
    upright = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    for fmt in ("PNG", "WEBP"):
        data = _stored_as(upright, 6, fmt)
        assert decode.exif_orientation(data, fmt) == 6
        out = np.empty((40, 40, 3), np.uint8)
        placed = decode_into(data, ResizeSpec(40, fit="squash", exif_orientation="apply"), out)
        assert (placed.height, placed.width) == (40, 60)
    plain = io.BytesIO()
    upright.save(plain, "PNG")
    assert decode.exif_orientation(plain.getvalue(), "PNG") == 1


def test_pad_records_the_valid_box(imagenet_clean, tmp_path):
    plan = imagenet_plans(imagenet_clean["root"], "val")[0]
    cache = open_cache(build(plan, tmp_path / "c", BuildOptions(size=64, fit="pad", jobs=1)).path)
    assert cache.boxes is not None and cache.boxes.shape == (len(cache), 4)
    images = cache.gather(np.arange(len(cache)))
    for img, (y0, x0, y1, x1), (h, w) in zip(images, cache.boxes.tolist(), cache.sizes.tolist(), strict=True):
        assert max(y1 - y0, x1 - x0) == 64
        assert abs((y1 - y0) / (x1 - x0) - h / w) < 0.05
        outside = np.ones((64, 64), bool)
        outside[y0:y1, x0:x1] = False
        assert not img[outside].any()
        assert img[y0:y1, x0:x1].std() > 5  # real pixels inside


def test_squash_keeps_every_pixel_row(imagenet_clean, tmp_path):
    path = Path(imagenet_clean["train"][0]["path"])
    out = np.empty((50, 50, 3), np.uint8)
    decode_into(path.read_bytes(), ResizeSpec(50, fit="squash"), out)
    with Image.open(path) as im:
        ref = np.asarray(im.convert("RGB").resize((50, 50), Image.BILINEAR))
    assert psnr(out, ref) > 30


def test_pixel_limit_is_a_parameter(imagenet_clean):
    path = Path(imagenet_clean["train"][0]["path"])
    out = np.empty((32, 32, 3), np.uint8)
    with pytest.raises(DecodeError, match="over the limit") as e:
        decode_into(path.read_bytes(), ResizeSpec(32, max_pixels=1000), out, path="x.JPEG")
    assert e.value.path == "x.JPEG"
    decode_into(path.read_bytes(), ResizeSpec(32, max_pixels=10**9), out)


def test_upscaling_small_sources(tmp_path):
    img = (np.arange(20 * 30 * 3) % 251).astype(np.uint8).reshape(20, 30, 3)
    out = np.empty((64, 64, 3), np.uint8)
    placed = decode_into(img, ResizeSpec(64, fit="crop"), out)
    assert (placed.height, placed.width) == (20, 30) and placed.box == (0, 0, 64, 64)
    same = np.empty((20, 20, 3), np.uint8)
    decode_into(img[:, :20].copy(), ResizeSpec(20), same)
    assert np.array_equal(same, img[:, :20])  # native size: an exact copy


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def test_header_shortcut_agrees_with_pil():
    """The JPEG SOF / PNG IHDR shortcut reads the same size as PIL for every JPEG flavour, and skips a
    frame header hidden in an APP segment (an EXIF thumbnail is a whole JPEG inside APP1)."""
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 451, 3), dtype=np.uint8))
    cases = [_jpeg(photo.convert(mode), **kw) for mode in ("RGB", "L", "CMYK")
             for kw in ({}, {"progressive": True}, {"optimize": True}, {"subsampling": 0},
                        {"restart_marker_blocks": 1})]
    thumb = _jpeg(photo.resize((40, 30)))
    app1 = b"Exif\x00\x00" + thumb
    cases.append(cases[0][:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + cases[0][2:])
    png = io.BytesIO()
    photo.save(png, "PNG")
    cases.append(png.getvalue())
    for data in cases:
        assert _jpeg_or_png_size(data) is not None
        assert _jpeg_or_png_size(data)[:2] == _pil_size(data)[:2] == (300, 451)
    # what it does not know goes to PIL: other formats, no frame before the scan, garbage
    gif = io.BytesIO()
    photo.convert("P").save(gif, "GIF")
    for data in (gif.getvalue(), b"\xff\xd8\xff\xda\x00\x02", b"\xff\xd8garbage", b"hello"):
        assert _jpeg_or_png_size(data) is None
    assert probe(gif.getvalue(), 10**9) == (300, 451, "GIF")


def _decode_or_reason(data: bytes, spec: ResizeSpec) -> np.ndarray | str:
    out = np.empty((spec.size, spec.size, 3), np.uint8)
    try:
        decode_into(data, spec, out)
    except DecodeError as e:
        return e.reason
    return out


def test_jpegs_go_through_turbojpeg_with_opencvs_pixels(imagenet_tree, monkeypatch):
    """JPEG decodes, full-scale and DCT-reduced, take simplejpeg (libjpeg-turbo's TurboJPEG API) for speed.
    The cache must hold exactly what OpenCV decodes, for every JPEG flavour and every file of a tree with
    ImageNet's quirks and broken files; what simplejpeg refuses (any libjpeg warning: damaged data) goes to
    OpenCV as before."""
    files = sorted(p for p in Path(imagenet_tree["root"]).rglob("*") if p.is_file() and p.suffix == ".JPEG")
    photo = Image.open(files[0]).convert("RGB")
    flavours = [_jpeg(photo.convert(mode), **kw) for mode in ("RGB", "L", "CMYK")
                for kw in ({}, {"progressive": True}, {"optimize": True}, {"subsampling": 0},
                           {"restart_marker_blocks": 1})]
    scan = flavours[0].index(b"\xff\xda")  # damaged scans libjpeg only warns about: OpenCV decodes them
    damaged = [flavours[0][: scan + 3000] + b"\xff\xd9",
               flavours[0][: scan + 2000] + b"\x00" * 300 + flavours[0][scan + 2300 :]]
    sources = flavours + damaged + [p.read_bytes() for p in files]
    specs = [ResizeSpec(224), ResizeSpec(160, fit="pad"), ResizeSpec(200, fit="squash"), ResizeSpec(64),
             ResizeSpec(32, fit="pad")]  # 64 and 32: decoded at 1/2, 1/4 or 1/8
    real_turbo = decode._turbo_rgb
    taken = {"fast": 0, "refused": 0}
    scales: set[int] = set()

    def counting(data: bytes, h: int, w: int, r: int):
        img = real_turbo(data, h, w, r)
        taken["fast" if img is not None else "refused"] += 1
        if img is not None:
            scales.add(r)
        return img

    monkeypatch.setattr(decode, "_turbo_rgb", counting)
    fast = [_decode_or_reason(d, spec) for spec in specs for d in sources]
    monkeypatch.setattr(decode, "_turbo_rgb", lambda data, h, w, r: None)  # OpenCV alone, as before
    for a, b in zip(fast, [_decode_or_reason(d, spec) for spec in specs for d in sources], strict=True):
        assert (a == b) if isinstance(a, str) else (not isinstance(b, str) and np.array_equal(a, b))
    assert taken["fast"] >= len(specs) * (len(flavours) + len(files) // 2)  # CMYK too: libjpeg-turbo converts
    assert taken["refused"] >= len(specs) * len(damaged)
    assert scales == {1, 2, 4, 8}


def test_opencv_without_rgb_decoding_gives_the_same_pixels(imagenet_clean, monkeypatch):
    """OpenCV < 4.11 has no IMREAD_COLOR_RGB: the BGR decode + swap must give the same cache, at full and
    DCT-reduced scale."""
    import cv2

    paths = sorted(Path(imagenet_clean["train_dir"]).rglob("*.JPEG"))[:12]
    specs = [ResizeSpec(size=64), ResizeSpec(size=160, fit="pad")]  # 64: most sources decode reduced

    def decode_all() -> list[np.ndarray]:
        outs = []
        for spec in specs:
            for p in paths:
                out = np.empty((spec.size, spec.size, 3), np.uint8)
                decode_into(p.read_bytes(), spec, out)
                outs.append(out)
        return outs

    direct = decode_all()
    bgr = {r: cv2.IMREAD_IGNORE_ORIENTATION | {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2,
                                               4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}[r]
           for r in decode._DECODE_FLAGS}
    monkeypatch.setattr(decode, "_RGB_DIRECT", False)
    monkeypatch.setattr(decode, "_DECODE_FLAGS", bgr)
    assert any(reduction(*cv2.imread(str(p)).shape[:2], specs[0]) > 1 for p in paths)
    for a, b in zip(direct, decode_all(), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("src_hw", [(150, 180), (224, 300), (300, 300), (447, 460), (448, 448), (900, 700)])
def test_antialias_policy(src_hw: tuple[int, int]) -> None:
    """"antialias" is torch's antialias kernel (PIL's filter: the reference's) from ANTIALIAS_FROM x downscale,
    OpenCV's bilinear below it; for upscales the two are one filter, PIL's bilinear (within rounding)."""
    src = np.random.default_rng(sum(src_hw)).integers(0, 256, (*src_hw, 3), dtype=np.uint8)
    out = np.empty((224, 224, 3), np.uint8)
    _resize_into(src, (0.0, 0.0, float(src_hw[0]), float(src_hw[1])), out, "antialias")
    x = torch.from_numpy(src).permute(2, 0, 1)[None]
    aa = torch.nn.functional.interpolate(x, size=(224, 224), mode="bilinear", antialias=True)[0].permute(1, 2, 0)
    linear = cv2.resize(src, (224, 224), interpolation=cv2.INTER_LINEAR)
    pil = np.asarray(Image.fromarray(src).resize((224, 224), Image.BILINEAR))
    if max(src_hw) / 224 >= ANTIALIAS_FROM:
        assert np.array_equal(out, aa.numpy())
        assert np.abs(out.astype(int) - pil).max() <= 1
    else:
        assert np.abs(out.astype(int) - linear).max() <= 1
        if max(src_hw) > 224:  # a downscale by the unwidened filter: a noise image shows it
            assert np.abs(out.astype(int) - pil).max() > 8
    if max(src_hw) <= 224:  # an upscale: bilinear with or without antialiasing is one filter
        assert np.abs(out.astype(int) - pil).max() <= 1
