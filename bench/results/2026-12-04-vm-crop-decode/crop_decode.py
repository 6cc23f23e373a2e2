"""Issue 36's last decode lever, measured: decode only the crop window (libjpeg-turbo 3's tj3SetCroppingRegion)
against the build's full decode (simplejpeg), and what relaxing byte identity (fast IDCT, fast upsampling)
would buy. A record of how the figures in this folder were taken, not part of the tool.

    pip install turbojpeg==0.0.2   # pybind11 bindings whose wheel ships libturbojpeg 3.0 (used here through ctypes)
    python bench/results/2026-12-04-vm-crop-decode/crop_decode.py --src bench/work/jpegs-5000/train > crop_decode.json

Photos the build decodes at full scale (r = 1), the default crop fit at 224 px: the window torchvision's
Resize + CenterCrop keeps (``crop_window``), padded by 16 px (one iMCU: fancy upsampling reads its neighbours),
its left edge rounded down to the iMCU width as libjpeg-turbo requires.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import time
from ctypes import Structure, c_int, c_size_t, c_void_p
from pathlib import Path

import numpy as np
import simplejpeg

from cachebuild.builder.sample.geometry import ResizeSpec, crop_window, reduction
from cachebuild.builder.sample.probe import probe

MCU_WIDTH = [8, 16, 16, 8, 8, 32, 8]  # by TJPARAM_SUBSAMP


class Region(Structure):
    _fields_ = [("x", c_int), ("y", c_int), ("w", c_int), ("h", c_int)]


def _turbojpeg3() -> ctypes.CDLL:
    import turbojpeg  # type: ignore[import-not-found]  # not a dependency: its bundled library, next to it

    libs = os.path.join(os.path.dirname(turbojpeg.__file__), "turbojpeg.libs", "libturbojpeg*")
    lib = ctypes.CDLL(glob.glob(libs)[0])
    lib.tj3Init.restype, lib.tj3Init.argtypes = c_void_p, [c_int]
    lib.tj3DecompressHeader.argtypes = [c_void_p, c_void_p, c_size_t]
    lib.tj3Get.argtypes = [c_void_p, c_int]
    lib.tj3SetCroppingRegion.argtypes = [c_void_p, Region]
    lib.tj3Decompress8.argtypes = [c_void_p, c_void_p, c_size_t, c_void_p, c_int, c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    lib = _turbojpeg3()
    tj = lib.tj3Init(1)  # TJINIT_DECOMPRESS
    spec = ResizeSpec(224)
    datas = [f.read_bytes() for f in sorted(a.src.rglob("*.JPEG"))]
    jobs = []
    for d in datas:
        h, w, _ = probe(d, spec.max_pixels)
        if reduction(h, w, spec) == 1:
            jobs.append((d, h, w, crop_window(h, w, 224)))
    buf = np.empty(64 << 20, np.uint8)

    def decode(d: bytes, h: int, w: int, win: tuple[int, int, int, int] | None) -> np.ndarray:
        lib.tj3DecompressHeader(tj, d, len(d))
        if win is None:
            px0, py0, px1, py1 = 0, 0, w, h
        else:
            y0, x0, y1, x1 = win
            mw = MCU_WIDTH[lib.tj3Get(tj, 4)]  # TJPARAM_SUBSAMP
            px0, py0, px1, py1 = max(0, (x0 - 16) // mw * mw), max(0, y0 - 16), min(w, x1 + 16), min(h, y1 + 16)
        region = Region(0, 0, 0, 0) if win is None else Region(px0, py0, px1 - px0, py1 - py0)
        assert lib.tj3SetCroppingRegion(tj, region) == 0
        out = buf[: (py1 - py0) * (px1 - px0) * 3].reshape(py1 - py0, px1 - px0, 3)
        assert lib.tj3Decompress8(tj, d, len(d), out.ctypes.data, (px1 - px0) * 3, 0) == 0  # TJPF_RGB
        return out if win is None else out[win[0] - py0 : win[2] - py0, win[1] - px0 : win[3] - px0]

    differ = sum(not np.array_equal(decode(d, h, w, win), simplejpeg.decode_jpeg(d, "RGB")[y0:y1, x0:x1])
                 for d, h, w, win in jobs for y0, x0, y1, x1 in [win])
    skipped = statistics.mean(
        1 - (min(w, x1 + 16) - max(0, x0 - 16)) * (min(h, y1 + 16) - max(0, y0 - 16)) / (h * w)
        for _, h, w, (y0, x0, y1, x1) in jobs)
    ways = {
        "simplejpeg full (the build's decode)": lambda d, h, w, win: simplejpeg.decode_jpeg(d, "RGB", buffer=buf,
                                                                                            strict=True),
        "libturbojpeg 3 full (ctypes)": lambda d, h, w, win: decode(d, h, w, None),
        "libturbojpeg 3 crop window (ctypes)": decode,
        "simplejpeg full, fastdct + fastupsample (other pixels)": lambda d, h, w, win: simplejpeg.decode_jpeg(
            d, "RGB", buffer=buf, fastdct=True, fastupsample=True),
    }
    ms: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(a.rounds + 1):  # the first round warms up, not kept
        for k, f in ways.items():
            t = time.perf_counter()
            for j in jobs:
                f(*j)
            ms[k].append((time.perf_counter() - t) / len(jobs) * 1e3)
    fast = [simplejpeg.decode_jpeg(d, "RGB", fastdct=True, fastupsample=True).astype(np.float64) for d, *_ in jobs]
    psnr = [10 * np.log10(255**2 / max(1e-12, float(np.mean((f - simplejpeg.decode_jpeg(d, "RGB")) ** 2))))
            for f, (d, *_) in zip(fast, jobs, strict=True)]
    print(json.dumps({
        "photos": len(datas), "decoded_at_full_scale": len(jobs), "load_average_at_start": os.getloadavg()[0],
        "crop_windows_differing_from_the_full_decode": differ, "decoded_pixels_outside_the_padded_window": skipped,
        "ms_per_photo_median": {k: statistics.median(v[1:]) for k, v in ms.items()},
        "ms_per_photo_rounds": {k: v[1:] for k, v in ms.items()},
        "fast_decode_psnr_db_median_against_the_accurate_decode": statistics.median(psnr),
    }, indent=1))


if __name__ == "__main__":
    main()
