"""Resize quality: PSNR of cachebuild's samples against torchvision's pipeline on the same files.

The reference is what an ``ImageFolder`` + ``Resize(S)`` + ``CenterCrop(S)`` pipeline serves: PIL's
``convert("RGB")``, then its antialiased bilinear resize and centre crop. cachebuild's decode (the function
its build workers call, ``cachebuild.builder.sample.decode_into``, ``--fit crop``) is measured twice: as built by
default (JPEGs at least 4x the target decoded DCT-reduced first) and with ``reduced_decode=False`` (every
JPEG decoded at full scale), so the cost of the reduced decode shows in the same run. One process, no
timing: these are properties of the pixels.

    python bench/scripts/quality.py --n 1000 --sizes 64,96,224 --json bench-out/quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cachebuild.builder.sample import ResizeSpec, decode_into, probe, reduction  # noqa: E402

__all__ = ["main", "psnr"]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def _summary(values: list[float]) -> dict[str, float]:
    v = np.asarray(values)
    return {"median": round(float(np.median(v)), 2), "p10": round(float(np.percentile(v, 10)), 2),
            "min": round(float(v.min()), 2)}


def measure(files: list[Path], size: int) -> dict[str, Any]:
    """Per-file PSNR against torchvision at ``size`` for the default build and a full-scale decode."""
    from PIL import Image
    from torchvision.transforms import CenterCrop, Compose, Resize

    reference = Compose([Resize(size), CenterCrop(size)])
    out = np.empty((size, size, 3), np.uint8)
    scores: dict[str, list[float]] = {"default": [], "full_decode": []}
    reduced = 0
    for f in files:
        data = f.read_bytes()
        with Image.open(f) as im:
            ref = np.asarray(reference(im.convert("RGB")))
        for name, spec in (("default", ResizeSpec(size)), ("full_decode", ResizeSpec(size, reduced_decode=False))):
            decode_into(data, spec, out, path=str(f))
            scores[name].append(psnr(out, ref))
        h, w, fmt = probe(data, ResizeSpec(size).max_pixels)
        reduced += fmt == "JPEG" and reduction(h, w, ResizeSpec(size)) > 1
    return {"files": len(files), "decoded_reduced": reduced, **{k: _summary(v) for k, v in scores.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000, help="source photos (the built-in sample's generator)")
    p.add_argument("--sizes", default="64,96,224")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    from cachebuild.samples.imagenet_layout import write_imagenet

    res: dict[str, Any] = {"n": a.n, "reference": "PIL convert('RGB') + torchvision Resize(S) + CenterCrop(S)",
                           "fit": "crop"}
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        info = write_imagenet(Path(tmp) / "src", n_classes=10, train_per_class=max(1, a.n // 10), val_per_class=0)
        files = sorted(Path(info["train_dir"]).rglob("*.JPEG"))
        for size in (int(s) for s in a.sizes.split(",")):
            res[f"psnr_db_{size}"] = got = measure(files, size)
            print(f"{size} px: default median {got['default']['median']:.1f} dB (p10 {got['default']['p10']:.1f}, "
                  f"min {got['default']['min']:.1f}); full decode median {got['full_decode']['median']:.1f} dB; "
                  f"{got['decoded_reduced']} of {got['files']} decoded DCT-reduced", flush=True)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
