"""Real photographs shipped inside PyPI wheels, and the crops the sample datasets are cut from.

No data set can be downloaded where cachebuild is tested, so the sample trees are made from the colour
photographs that ``scikit-image`` and ``scikit-learn`` carry inside their wheels. Class ``k`` always draws its
pictures from one photograph (or one region of it), with a random crop position, scale, aspect, flip and a mild
colour jitter, so the classes are learnable and no two samples are equal.
"""

from __future__ import annotations

import functools
import math

import cv2
import numpy as np

from cachebuild.errors import CacheBuildError

__all__ = ["class_region", "imagenet_like_size", "photo_bank", "render_sample"]

# skimage.data loaders that read a colour photograph bundled with the wheel (no pooch download).
_SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
                   "stereo_motorcycle")


@functools.lru_cache(maxsize=1)
def _load_bank() -> tuple[tuple[str, np.ndarray], ...]:
    try:  # both: without scikit-learn's two photos every class would be cut from another photo
        import skimage.data
        from sklearn.datasets import load_sample_images
    except ImportError:
        raise CacheBuildError("the sample photos ship in scikit-image and scikit-learn: "
                              "pip install 'cachebuild[samples]'") from None
    photos: list[tuple[str, np.ndarray]] = []
    for name in _SKIMAGE_PHOTOS:
        img = getattr(skimage.data, name)()
        if isinstance(img, tuple):  # stereo_motorcycle -> (left, right, disparity)
            img = img[0]
        photos.append((name, img))
    bunch = load_sample_images()
    for fname, img in zip(bunch.filenames, bunch.images, strict=True):
        stem = fname.replace("\\", "/").rsplit("/", 1)[-1].rsplit(".", 1)[0]
        photos.append((stem, img))
    out = []
    for name, img in photos:
        arr = np.ascontiguousarray(np.asarray(img, dtype=np.uint8)[..., :3])
        if arr.ndim != 3 or arr.shape[2] != 3:
            continue
        arr.setflags(write=False)
        out.append((name, arr))
    return tuple(out)


def photo_bank() -> list[tuple[str, np.ndarray]]:
    """Named RGB uint8 ``(H, W, 3)`` photographs that load offline, in a fixed order.

    Order: astronaut, chelsea, coffee, rocket, hubble_deep_field, retina, immunohistochemistry,
    stereo_motorcycle (left view) from scikit-image, then china and flower from scikit-learn.
    The arrays are shared and read-only.
    """
    return list(_load_bank())


def class_region(k: int, bank: list[tuple[str, np.ndarray]]) -> tuple[int, tuple[int, int, int, int]]:
    """Which photo and which ``(x, y, w, h)`` region of it class ``k`` is drawn from.

    Classes ``0..P-1`` use whole photos; the next ``4P`` use the quadrants of each photo (2x2 grid),
    the next ``9P`` the cells of a 3x3 grid, and so on, so any class count gets distinct sources.
    """
    if k < 0:
        raise ValueError(f"class index must be >= 0, got {k}")
    n_photos = len(bank)
    photo, rank = k % n_photos, k // n_photos
    grid = 1
    while rank >= grid * grid:
        rank -= grid * grid
        grid += 1
    h, w = bank[photo][1].shape[:2]
    row, col = divmod(rank, grid)
    x0, x1 = (col * w) // grid, ((col + 1) * w) // grid
    y0, y1 = (row * h) // grid, ((row + 1) * h) // grid
    return photo, (x0, y0, x1 - x0, y1 - y0)


def _class_tint(k: int) -> np.ndarray:
    """A fixed per-class RGB gain around 1 (golden-angle hues, so neighbours differ)."""
    hue = (k * 0.618033988749895) % 1.0
    phases = np.array([0.0, 1.0 / 3.0, 2.0 / 3.0])
    return (1.0 + 0.5 * np.cos(2.0 * math.pi * (hue - phases))).astype(np.float32)


def render_sample(bank: list[tuple[str, np.ndarray]], k: int, out_w: int, out_h: int, rng: np.random.Generator, *,
                  scale: tuple[float, float] = (0.35, 1.0), tint: float = 0.0, jitter: float = 0.1) -> np.ndarray:
    """One ``(out_h, out_w, 3)`` uint8 RGB picture of class ``k``.

    A random crop of the class's region (area fraction in ``scale`` of the largest crop with the
    output aspect, aspect wobble of +-10 %, random position), resized (area on downscale, cubic on
    upscale), flipped left-right half the time, then brightness / contrast / saturation jitter of
    ``+-jitter`` and, if ``tint > 0``, a fixed class colour cast mixed in at that strength.
    """
    if out_w < 1 or out_h < 1:
        raise ValueError(f"output size must be positive, got {out_w}x{out_h}")
    photo_idx, (rx, ry, rw, rh) = class_region(k, bank)
    photo = bank[photo_idx][1]
    aspect = (out_w / out_h) * math.exp(rng.uniform(-0.1, 0.1))
    # Largest crop of this aspect inside the region, then a random fraction of its area.
    max_w = min(rw, rh * aspect)
    frac = rng.uniform(*scale)
    cw = max(1, min(rw, round(max_w * math.sqrt(frac))))
    ch = max(1, min(rh, round(cw / aspect)))
    x = rx + int(rng.integers(0, rw - cw + 1))
    y = ry + int(rng.integers(0, rh - ch + 1))
    crop = photo[y : y + ch, x : x + cw]
    interp = cv2.INTER_AREA if (out_w <= cw and out_h <= ch) else cv2.INTER_CUBIC
    img = cv2.resize(crop, (out_w, out_h), interpolation=interp).astype(np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    b, c, s = (1.0 + rng.uniform(-jitter, jitter, size=3)).tolist()
    gray = img @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    img = gray[..., None] + s * (img - gray[..., None])  # saturation
    img = float(gray.mean()) + c * (img - float(gray.mean()))  # contrast
    img = img * b  # brightness
    if tint > 0.0:
        img = img * ((1.0 - tint) + tint * _class_tint(k))
    return np.ascontiguousarray(np.clip(np.rint(img), 0, 255).astype(np.uint8))


def imagenet_like_size(rng: np.random.Generator, kind: str = "normal") -> tuple[int, int]:
    """A ``(width, height)`` drawn like ILSVRC2012 train images.

    ``normal``: long side 500 px one time in five, else 300-500 px; aspect (w/h) from 3:4 portrait to
    16:9 landscape, weighted towards 4:3 and 3:2 (mean about 400x330; with
    the large and small ones :func:`write_imagenet` mixes in, about 430x355). ``large``: long side
    1000-2000 px (exercises reduced-size decoding). ``small``: short side 64-223 px (below 224).
    """
    aspects = np.array([0.75, 1.0, 1.25, 4.0 / 3.0, 1.5, 16.0 / 9.0])
    weights = np.array([0.2, 0.07, 0.08, 0.35, 0.22, 0.08])
    aspect = float(rng.choice(aspects, p=weights / weights.sum()))
    if kind == "normal":
        long_side = 500 if rng.random() < 0.2 else int(rng.integers(300, 501))
    elif kind == "large":
        long_side = int(rng.integers(1000, 2001))
    elif kind == "small":
        short_side = int(rng.integers(64, 224))
        long_side = max(short_side, round(short_side * max(aspect, 1.0 / aspect)))
        if aspect >= 1.0:
            return long_side, short_side
        return short_side, long_side
    else:
        raise ValueError(f"kind must be 'normal', 'large' or 'small', got {kind!r}")
    if aspect >= 1.0:
        return long_side, max(1, round(long_side / aspect))
    return max(1, round(long_side * aspect)), long_side
