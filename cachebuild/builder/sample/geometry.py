"""What a sample is made of, without decoding anything: the resize recipe (:class:`ResizeSpec`), where a
source's pixels land (:class:`Placement`), torchvision's crop window, the letterbox, and the DCT scale a JPEG
is decoded at. No OpenCV here: the build's parent process plans and records with these, and only its workers
import the decoder (:mod:`cachebuild.builder.sample.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ANTIALIAS_FROM", "DEFAULT_MAX_PIXELS", "FITS", "INTERPOLATIONS", "TORCH_RESIZE_FROM", "Placement",
           "ResizeSpec", "crop_window", "letterbox", "reduction"]

FITS = ("crop", "squash", "pad")
INTERPOLATIONS = ("antialias", "area", "linear")
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's decompression-bomb error threshold (2 x MAX_IMAGE_PIXELS)

# "antialias" resizes with PIL's widened triangle filter from this downscale factor on, and with plain
# bilinear below it. Measured on the real-photo sample at 224 px (sources ~400x335, so most downscale by
# 1.1-1.6x): the resize went from 0.27 to 0.11 ms a sample (build 0.64x -> 0.73x bare decode, CPU time,
# one process), median PSNR against torchvision's PIL Resize + CenterCrop from 47 to 41 dB; at 96 and
# 64 px nearly every source downscales >= 2x and nothing changes. 1.5 measured 0.70x and 44 dB.
ANTIALIAS_FROM = 2.0
# The same bytes come from torch's kernel and from aa_resize; torch's AVX2 kernel is ~1.5x faster a call
# but importing torch costs a worker ~1.8 s of CPU. Measured on every fifth bench photo (issue 36, CPU time,
# one process, alternating, load ~4): aa_resize adds 0.048 ms a sample at 224 px and 0.047 at 64 px (it
# added ~0.25 before its float32 passes), so torch pays from ~37,000 samples a worker; from this many
# planned samples a worker, workers import torch at their start (block._init_worker) and resize with it.
TORCH_RESIZE_FROM = 40_000


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



def reduction(h: int, w: int, spec: ResizeSpec) -> int:
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


def crop_window(h: int, w: int, s: int) -> tuple[int, int, int, int]:
    """The source window ``(y0, x0, y1, x1)`` that torchvision's Resize(S) + CenterCrop(S) keeps of an h x w
    image: cropping it first, then resizing to S x S, resizes only the kept pixels. Shared by the CPU and
    GPU build paths, so both keep the same pixels."""
    if h <= w:
        nh, nw = s, int(s * w / h)
    else:
        nh, nw = int(s * h / w), s
    top, left = round((nh - s) / 2), round((nw - s) / 2)
    y0, x0 = round(top * h / nh), round(left * w / nw)
    y1, x1 = round((top + s) * h / nh), round((left + s) * w / nw)
    return y0, x0, max(y1, y0 + 1), max(x1, x0 + 1)  # a 1-pixel-thin image still gives one row or column


def letterbox(h: int, w: int, s: int) -> tuple[int, int, int, int]:
    """Where ``--fit pad`` puts an h x w image in its S x S sample: ``(y0, x0, y1, x1)``, aspect kept."""
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    y0, x0 = (s - nh) // 2, (s - nw) // 2
    return y0, x0, y0 + nh, x0 + nw

