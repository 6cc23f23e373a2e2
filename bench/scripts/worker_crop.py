"""Augmented loading with the crop in the loader's workers vs on the batch, in one run, rounds alternating.

    python bench/scripts/worker_crop.py                       # a synthetic 224 px npy cache, 2 workers, CPU
    python bench/scripts/worker_crop.py --cache PATH --crop 176 --rounds 5 --json out.json [--train]

What it reports (medians over rounds; each ratio taken within one round, the two paths alternating):
  load    img/s to a normalized float batch: ``CachedImageDataset(crop=RandomResizedCrop, flip=True)`` in 2
          DataLoader workers + Normalize, vs whole samples through 2 workers + ``imagenet_train`` on the batch
          in the main process (the current CPU path). (issue 26: >= 1.5x)
  bytes   uint8 bytes per image that leave the loader (what a device copy would send): crop^2 * 3 vs H * W * 3.
  train   with --train: small_cnn on CPU for --train-epochs epochs with ``--augment-in workers`` vs ``device``
          (wall seconds, seconds per epoch), and at a fixed 128 px vs ``--progressive 96:128:0:E-1``; with --val
          (a real cache's val split: the synthetic cache's labels are arbitrary) the final val top-1 of each.
  ffcv    not here: the bench harness's augmented load table has FFCV's loaders beside the crop in workers
          (``make bench-peers``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cachebuild.storage.cache import write_cache  # noqa: E402
from loaders import transforms as T  # noqa: E402
from loaders.collate import collate_batch  # noqa: E402
from loaders.dataset import CachedImageDataset, DatasetOptions  # noqa: E402
from loaders.sampler import CacheSampler  # noqa: E402
from loaders.worker_crop import RandomResizedCrop  # noqa: E402

__all__ = ["main"]


def _synthetic_cache(root: Path, n: int, side: int, storage: str = "npy") -> Path:
    """Smooth random pictures (upsampled noise): resampling costs what it costs on photos. ``storage``: the
    cache's kind (``jpeg`` for a compact cache)."""
    import cv2

    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (n, side // 8, side // 8, 3), dtype=np.uint8)
    images = np.stack([cv2.resize(s, (side, side), interpolation=cv2.INTER_CUBIC) for s in small])
    labels = np.arange(n) % 10
    write_cache(root, images, labels, [f"c{k}" for k in range(10)], storage=storage, shard_size=1000, replace=True)
    return root


def _loader(ds: CachedImageDataset, workers: int, batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch, sampler=CacheSampler(ds, seed=0), num_workers=workers,
                                       collate_fn=collate_batch, persistent_workers=workers > 0, prefetch_factor=4
                                       if workers else None)


def _epoch(dl: Any, tf: Any) -> tuple[float, int, int]:
    """(seconds, images, uint8 bytes of the loader's batches) of one epoch to normalized float batches."""
    t0 = time.perf_counter()
    n = nbytes = 0
    for x, _ in dl:
        nbytes += x.numel()
        tf(x.permute(0, 3, 1, 2))
        n += len(x)
    return time.perf_counter() - t0, n, nbytes


def _fit_row(cache: Path, val: Path | None, out: Path, epochs: int, crop: int, **kw: Any) -> dict[str, Any]:
    """One small_cnn run on CPU: wall seconds, seconds per epoch and (with a val cache) the final val top-1."""
    from loaders.train.config import TrainConfig
    from loaders.train.run.fit import fit

    t0 = time.perf_counter()
    summary = fit(TrainConfig(train=str(cache), val=str(val) if val else None, out=str(out), model="small_cnn",
                              epochs=epochs, batch_size=64, lr=0.05, warmup_epochs=1, workers=2, loader="dataloader",
                              device="cpu", amp="off", augment="imagenet", crop=crop, progress=False, overwrite=True,
                              **kw), echo=lambda m: None)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"wall_s": wall, "s_per_epoch": wall / epochs}
    if "val_top1" in summary:
        row["val_top1"] = summary["val_top1"]
    return row


def _train_row(cache: Path, val: Path | None, crop: int, tmp: Path, epochs: int, rounds: int = 2) -> dict[str, Any]:
    """small_cnn with the augmentation in the workers vs on the batch (``--augment-in workers|device``), the
    order alternating per round; ratio = device seconds / workers seconds within a round."""
    runs: dict[str, list[dict[str, Any]]] = {"workers": [], "device": []}
    for r in range(rounds):
        for where in ("workers", "device") if r % 2 == 0 else ("device", "workers"):
            runs[where].append(_fit_row(cache, val, tmp / where, epochs, crop, augment_in=where))
    return {"epochs": epochs, "crop": crop, "runs": runs,
            "ratios": [d["wall_s"] / w["wall_s"] for d, w in zip(runs["device"], runs["workers"], strict=True)]}


def _progressive_row(cache: Path, val: Path | None, tmp: Path, epochs: int) -> dict[str, Any]:
    """small_cnn for ``epochs`` epochs at a fixed 128 px vs a 96 -> 128 px ramp (crops in the workers)."""
    ramp = f"96:128:0:{epochs - 1}"
    return {"epochs": epochs, "ramp": ramp,
            "fixed_128": _fit_row(cache, val, tmp / "fixed", epochs, 128, augment_in="workers"),
            "progressive_96_128": _fit_row(cache, val, tmp / "ramp", epochs, 128, augment_in="workers",
                                           progressive=ramp)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, help="an npy/zarr/jpeg cache (default: a synthetic 224 px one)")
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--crop", type=int, default=176)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train", action="store_true")
    p.add_argument("--val", type=Path, help="with --train: a val cache, for the final val top-1 of each run")
    p.add_argument("--train-epochs", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cache = a.cache or _synthetic_cache(tmp / "cache", a.n, 224)
        fused = CachedImageDataset(cache, DatasetOptions(crop=RandomResizedCrop(a.crop), flip=True, in_memory=False))
        whole = CachedImageDataset(cache, DatasetOptions(in_memory=False))
        paths = {"workers": (_loader(fused, a.workers, a.batch), T.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD)),
                 "batch": (_loader(whole, a.workers, a.batch), T.imagenet_train(a.crop))}
        for dl, tf in paths.values():  # warm: workers started, page cache filled
            _epoch(dl, tf)
        rows: dict[str, list[float]] = {"workers": [], "batch": [], "ratio": []}
        per_image = {}
        for r in range(a.rounds):
            order = ("workers", "batch") if r % 2 == 0 else ("batch", "workers")
            for name in order:
                s, n, nbytes = _epoch(*paths[name])
                rows[name].append(n / s)
                per_image[name] = nbytes / n
            rows["ratio"].append(rows["workers"][-1] / rows["batch"][-1])
        result: dict[str, Any] = {
            "n": len(whole), "shape": list(whole.shape), "crop": a.crop, "workers": a.workers, "batch": a.batch,
            "img_s": {k: statistics.median(v) for k, v in rows.items() if k != "ratio"},
            "ratio_workers_over_batch": statistics.median(rows["ratio"]), "ratios": rows["ratio"],
            "bytes_per_image": per_image, "bytes_ratio": per_image["workers"] / per_image["batch"],
        }
        if a.train:
            result["train"] = _train_row(cache, a.val, a.crop, tmp, a.train_epochs)
            result["progressive"] = _progressive_row(cache, a.val, tmp, a.train_epochs)
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
