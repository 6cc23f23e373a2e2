"""Shared by the peer scripts (which run in the peers' own venvs and import nothing from the project):
argument parsing, the file list, the standard augmentation, epoch timing, the JSON answer."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "load"])
    ap.add_argument("--files", type=Path, help="JSON list of [path, label] (build)")
    ap.add_argument("--out", type=Path, help="where to build")
    ap.add_argument("--data", type=Path, help="what to load")
    ap.add_argument("--mode", default="raw")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--aug", default="0", help="load: 0 raw, 1 augmented, 0,1 both in this one process")
    ap.add_argument("--remote", default=None, help="load from this URL (peers that read URLs)")
    return ap.parse_args(argv)


def files(path: Path) -> list[tuple[str, int]]:
    return [(p, int(k)) for p, k in json.loads(path.read_text())]


def square(path: str, size: int) -> Any:
    """torchvision Resize(size) + CenterCrop(size) of the file with PIL, as a uint8 (size, size, 3) array."""
    import numpy as np
    import torchvision.transforms.functional as F
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(F.center_crop(F.resize(im.convert("RGB"), size), size))


def augment(size: int) -> Callable[[Any], Any]:
    """The standard augmentation on one uint8 CHW tensor: RandomResizedCrop + flip + float + normalize."""
    import torch
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def time_epochs(make_epoch: Callable[[], Iterable[Any]], epochs: int, n: int) -> list[float]:
    """img/s of each epoch (the first includes start-up: the harness leaves it out)."""
    rates = []
    for _ in range(epochs):
        seen = 0
        t0 = time.perf_counter()
        for batch in make_epoch():
            seen += len(batch[0])
        dt = time.perf_counter() - t0
        if seen != n:
            raise SystemExit(f"an epoch delivered {seen} samples, expected {n}")
        rates.append(seen / dt)
    return rates


def warm_then_time(build: Callable[[list[tuple[str, int]], Path], Any], items: list[tuple[str, int]],
                   out: Path) -> float:
    """Seconds of ``build(items, out)`` after an untimed warm-up build of the first 32 files elsewhere
    (imports, JIT compilation, first calls). Worker processes that the library starts inside each call
    are started inside the timed call too: these APIs have no pool to start beforehand."""
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="warmup-", dir=out.parent))
    try:
        build(items[:32], scratch / "data")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    t0 = time.perf_counter()
    build(items, out)
    return time.perf_counter() - t0


def load_groups(a: argparse.Namespace, epochs_of: Callable[[bool], list[float]]) -> None:
    """Answer the epochs of every group ``--aug`` names: both groups in one process pay the library's
    imports once (FFCV's 4.5 s: most of a small run's time)."""
    groups = {"augmented" if flag.strip() == "1" else "raw": epochs_of(flag.strip() == "1")
              for flag in a.aug.split(",")}
    answer(groups=groups)


def answer(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)
