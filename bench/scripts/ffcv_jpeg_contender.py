"""FFCV's JPEG field as a contender for bench_compact.py: run with a separate venv's python where ``ffcv``
is installed (FFCV is never a dependency of cachebuild; this script imports nothing from the project):

    $FFCV_PYTHON bench/scripts/ffcv_jpeg_contender.py --images imgs.npy --labels labels.npy --json out.json

It writes a ``.beton`` of the same uint8 (N, S, S, 3) samples the compact cache holds, with
``RGBImageField(write_mode='jpg', jpeg_quality=90)`` (FFCV encodes with OpenCV, 4:2:0) + ``IntField``, then
times ``Loader(order=RANDOM, os_cache=True, drop_last=False)`` with ``SimpleRGBImageDecoder`` + ``ToTensor``:
uint8 NHWC batches on CPU, every JPEG decoded at its stored size like the compact cache's decode-on-read.
img/s is the median of the epochs after the first (the first includes numba's compilation).
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
    """(image, label) by index, the shape ``DatasetWriter.from_indexed_dataset`` wants."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.ascontiguousarray(self.images[i]), int(self.labels[i])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="uint8 (N, S, S, 3) .npy")
    p.add_argument("--labels", type=Path, required=True, help="int (N,) .npy")
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)

    from importlib.metadata import version

    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor
    from ffcv.writer import DatasetWriter

    images = np.load(a.images, mmap_mode="r")
    labels = np.load(a.labels)
    n = len(images)
    tmp = Path(tempfile.mkdtemp(prefix="ffcv-jpeg-"))
    try:
        beton = tmp / "jpeg.beton"
        t0 = time.perf_counter()
        field = RGBImageField(write_mode="jpg", jpeg_quality=a.quality)
        DatasetWriter(str(beton), {"image": field, "label": IntField()}, num_workers=a.workers).from_indexed_dataset(
            _Pairs(images, labels))
        write_s = time.perf_counter() - t0
        with open(beton, "rb") as f:  # in the page cache, as the compact cache
            while f.read(16 << 20):
                pass
        loader = Loader(str(beton), batch_size=a.batch, num_workers=a.workers, order=OrderOption.RANDOM,
                        os_cache=True, drop_last=False, seed=0,
                        pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]})
        rates = []
        shape = None
        for _ in range(a.epochs):
            t0 = time.perf_counter()
            seen = 0
            for ims, _labs in loader:
                seen += len(ims)
                shape = [list(ims.shape), str(ims.dtype)]
            if seen != n:
                raise RuntimeError(f"expected {n} samples, got {seen}")
            rates.append(seen / (time.perf_counter() - t0))
        out = {"n": n, "img_s": statistics.median(rates[1:] if len(rates) > 1 else rates),
               "epochs": [round(r) for r in rates], "beton_bytes": beton.stat().st_size, "write_s": write_s,
               "batch": a.batch, "workers": a.workers, "batch_shape": shape,
               "versions": {"ffcv": version("ffcv"), "numpy": np.__version__, "python": sys.version.split()[0]}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
