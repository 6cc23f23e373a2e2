"""FFCV contender for bench_load.py: run with a separate venv's python where ``ffcv`` is installed.

FFCV is an optional benchmark contender, never a dependency of cachebuild; this script imports nothing
from the project so that it runs in its own virtual environment:

    /tmp/ffcv-venv/bin/python bench/ffcv_contender.py --images imgs.npy --labels labels.npy --json out.json

It writes a ``.beton`` (``RGBImageField(write_mode='raw')`` + ``IntField``) from the uint8 (N, H, W, 3)
array, then times ``Loader(order=RANDOM, os_cache=True)`` with ``SimpleRGBImageDecoder`` + ``ToTensor``
delivering uint8 NHWC batches on CPU (no ``ToDevice``), ``drop_last=False`` so every epoch delivers all N
samples like bench_load's contenders. img/s is the median of the epochs after the first (the first
includes numba's compilation), as in bench_load's ``run_epochs``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


class _Pairs:
    """Indexable (image, label) view of the arrays, the shape ``DatasetWriter.from_indexed_dataset`` wants."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.ascontiguousarray(self.images[i]), int(self.labels[i])


def write_beton(path: Path, images: np.ndarray, labels: np.ndarray, workers: int) -> float:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    t0 = time.perf_counter()
    writer = DatasetWriter(str(path), {"image": RGBImageField(write_mode="raw"), "label": IntField()},
                           num_workers=workers)
    writer.from_indexed_dataset(_Pairs(images, labels))
    return time.perf_counter() - t0


def time_loader(path: Path, n: int, batch: int, workers: int, epochs: int) -> dict[str, Any]:
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor

    loader = Loader(str(path), batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, os_cache=True,
                    drop_last=False, seed=0,
                    pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]})
    rates = []
    shape = dtype = None
    for _ in range(epochs):
        t0 = time.perf_counter()
        seen = 0
        for ims, _labs in loader:
            seen += len(ims)
            shape, dtype = tuple(ims.shape), str(ims.dtype)
        dt = time.perf_counter() - t0
        if seen != n:
            raise RuntimeError(f"expected {n} samples, got {seen}")
        rates.append(seen / dt)
    return {"img_s": statistics.median(rates) if len(rates) < 3 else statistics.median(rates[1:]),
            "epochs": [round(r) for r in rates], "batch": batch, "workers": workers,
            "batch_shape": shape, "batch_dtype": dtype}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="uint8 (N, H, W, 3) .npy")
    p.add_argument("--labels", type=Path, required=True, help="int (N,) .npy")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--also-batch", type=int, nargs="*", default=[64], help="further batch sizes (each its own Loader)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--beton", type=Path, default=None, help="where to write the .beton (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from importlib.metadata import version

    import numba
    import torch

    images = np.load(args.images, mmap_mode="r")
    labels = np.load(args.labels)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise SystemExit(f"--images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    n = len(images)
    tmp = None
    if args.beton is None:
        tmp = Path(tempfile.mkdtemp(prefix="ffcv_contender-"))
        beton = tmp / "raw.beton"
    else:
        beton = args.beton
    try:
        write_s = write_beton(beton, images, labels, args.workers)
        print(f"ffcv {version('ffcv')}, numba {numba.__version__}, "
              f"torch {torch.__version__}, numpy {np.__version__}: wrote {n} raw {images.shape[1:]} images "
              f"to .beton ({beton.stat().st_size / 1e9:.2f} GB) in {write_s:.1f}s", flush=True)
        with open(beton, "rb") as f:  # page cache warm, as bench_load's warm()
            while f.read(16 << 20):
                pass
        results = {}
        for b in dict.fromkeys([args.batch, *args.also_batch]):
            r = time_loader(beton, n, b, args.workers, args.epochs)
            results[f"batch {b}"] = r
            print(f"  ffcv: Loader raw ({args.workers} workers, batch {b}) {r['img_s']:9.0f} img/s  "
                  f"epochs {r['epochs']}  batch {r['batch_shape']} {r['batch_dtype']}", flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {"n": n, "image_shape": list(images.shape[1:]), "beton_write_s": write_s, "results": results,
           "versions": {"ffcv": version("ffcv"), "numba": numba.__version__,
                        "torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0]}}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
