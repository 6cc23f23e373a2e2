"""Load throughput: shuffled uint8 batches delivered to the training loop, contenders side by side.

    python bench/bench_load.py                       # ~6,000 samples at 224 (0.9 GB per cache), CPU
    python bench/bench_load.py --n 8000 --json out.json

Contenders (same process run, same files, page cache warm unless marked cold):
  bare gather        numpy fancy index of the memmapped shards at the batch's sorted indices, 1 thread,
                     no reordering: the memory-bandwidth yardstick of the issue
  reference gather   CacheReader.read(batch): the same plus a scatter back to the requested order
  gather 1 thread    CachedImageDataset.gather into a reused buffer, 1 thread
  FastLoader         background threads gathering into reused / pinned buffers (the fast path)
  DataLoader         torch DataLoader, 2 workers, __getitems__ + collate_batch (the standard path):
                     batches handed over through each worker's ring of reused shared-memory slots
  DataLoader fresh   same with ring_slots=0: a fresh shared-memory batch per step (the path before the ring)
  DataLoader dflt    same as DataLoader with torch's default_collate (stacks per sample)
                     (the three DataLoader rows run interleaved, epoch by epoch, for a fair comparison)
  ImageFolder+PIL    torchvision ImageFolder + RandomResizedCrop + ToTensor + Normalize, 2 workers, on
                     the JPEGs the cache images come from
  ffcv (optional)    FFCV Loader on a raw .beton of the same images (bench/ffcv_contender.py), run with a
                     separate venv's python given by --ffcv-python or $FFCV_PYTHON; FFCV is never a
                     dependency of the project
Cold figures drop the cache files from the page cache with posix_fadvise(DONTNEED) (no root needed;
a VM's host may still cache the disk), and try /proc/sys/vm/drop_caches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from cachebuild.format import open_cache, write_cache
from loaders.dataset import CachedImageDataset, collate_batch
from loaders.device import FastLoader, device_loader
from loaders.sampler import CacheSampler

__all__ = ["main"]


def make_jpegs(root: Path, count: int) -> Path:
    """Real-photo JPEGs in an ImageFolder tree (cachebuild.samples.write_imagenet)."""
    from cachebuild.samples.imagenet_layout import write_imagenet

    n_classes = 10
    info = write_imagenet(root, n_classes=n_classes, train_per_class=max(1, count // n_classes), val_per_class=0)
    return Path(info["train_dir"])


def decode_to_cache_images(train_dir: Path, size: int, n: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Decode the JPEGs (resize short side, center crop) and tile them to ``n`` samples."""
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    files = [(f, k) for k, c in enumerate(classes) for f in sorted((train_dir / c).iterdir())]
    base, lab = [], []
    for f, k in files:
        img = cv2.imread(str(f), cv2.IMREAD_COLOR)
        if img is None:
            continue
        h, w = img.shape[:2]
        s = size / min(h, w)
        img = cv2.resize(img, (max(size, round(w * s)), max(size, round(h * s))), interpolation=cv2.INTER_AREA)
        h, w = img.shape[:2]
        y, x = (h - size) // 2, (w - size) // 2
        base.append(cv2.cvtColor(img[y : y + size, x : x + size], cv2.COLOR_BGR2RGB))
        lab.append(k)
    reps = np.arange(n) % len(base)
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    for i, r in enumerate(reps):
        images[i] = base[r]
    return images, np.asarray(lab, dtype=np.int64)[reps], classes


def cache_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def warm(path: Path) -> None:
    for p in cache_files(path):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def drop_cache(path: Path) -> str:
    for p in cache_files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise only (drop_caches not permitted)"


def epoch_rate(make_iter: Callable[[int], Iterable[Any]], n_items: int, e: int) -> float:
    """img/s of epoch ``e``; ``make_iter(e)`` returns the batches; the first element is the images."""
    t0 = time.perf_counter()
    seen = 0
    for batch in make_iter(e):
        seen += len(batch[0])
    dt = time.perf_counter() - t0
    if seen != n_items:
        raise RuntimeError(f"expected {n_items} samples, got {seen}")
    return seen / dt


def summarize(rates: list[float]) -> dict[str, Any]:
    """Median img/s, leaving out the first (warm-up) epoch when there are 3 or more."""
    return {"img_s": statistics.median(rates) if len(rates) < 3 else statistics.median(rates[1:]),
            "epochs": [round(r) for r in rates]}


def run_epochs(make_iter: Callable[[int], Iterable[Any]], n_items: int, epochs: int) -> dict[str, Any]:
    return summarize([epoch_rate(make_iter, n_items, e) for e in range(epochs)])


def run_interleaved(makes: dict[str, Callable[[int], Iterable[Any]]], n_items: int,
                    epochs: int) -> dict[str, dict[str, Any]]:
    """Like run_epochs for several contenders, alternating them epoch by epoch (same machine drift)."""
    rates: dict[str, list[float]] = {k: [] for k in makes}
    for e in range(epochs):
        for name, make in makes.items():
            rates[name].append(epoch_rate(make, n_items, e))
    return {k: summarize(v) for k, v in rates.items()}


def bench_cache(path: Path, args: argparse.Namespace, results: dict[str, Any], tag: str) -> None:
    ds = CachedImageDataset(path)
    n, b = len(ds), args.batch
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    reader = open_cache(path)
    pin = torch.cuda.is_available()

    def batches_of(epoch: int) -> list[np.ndarray]:
        sampler.set_epoch(epoch)
        order = sampler.rank_indices()
        return [order[i : i + b] for i in range(0, n, b)]

    starts = reader.shard_starts

    def bare(e: int) -> Iterable[Any]:
        for idx in batches_of(e):
            idx = np.sort(idx)
            if reader.manifest.storage == "zarr":
                yield (reader.images.get_orthogonal_selection((idx,)),)
                continue
            shard_of = np.searchsorted(starts, idx, side="right") - 1
            yield (np.concatenate([reader.images[s][idx[shard_of == s] - starts[s]] for s in np.unique(shard_of)]),)

    def reference(e: int) -> Iterable[Any]:
        for idx in batches_of(e):
            yield (reader.read(idx),)

    buf = np.empty((b, *ds.shape), dtype=np.uint8)

    def gather1(e: int) -> Iterable[Any]:
        for idx in batches_of(e):
            yield (ds.gather(idx, out=buf[: len(idx)]),)

    def fast(e: int) -> Iterable[Any]:
        sampler.set_epoch(e)
        return device_loader(FastLoader(ds, b, sampler=sampler, num_threads=args.threads, pin_memory=pin),
                             "cuda" if pin else "cpu")

    dl = torch.utils.data.DataLoader(ds, batch_size=b, sampler=sampler, num_workers=args.workers,
                                     collate_fn=collate_batch, pin_memory=pin, persistent_workers=True)
    dl_fresh = torch.utils.data.DataLoader(CachedImageDataset(path, ring_slots=0), batch_size=b, sampler=sampler,
                                           num_workers=args.workers, collate_fn=collate_batch, pin_memory=pin,
                                           persistent_workers=True)
    dl_default = torch.utils.data.DataLoader(ds, batch_size=b, sampler=sampler, num_workers=args.workers,
                                             pin_memory=pin, persistent_workers=True)

    def via(loader: Any) -> Callable[[int], Iterable[Any]]:
        def it(e: int) -> Iterable[Any]:
            sampler.set_epoch(e)
            return device_loader(loader, "cuda" if pin else "cpu")
        return it

    contenders = [
        ("bare memmap gather (1 thread)", bare),
        ("reference gather (1 thread)", reference),
        ("gather 1 thread", gather1),
        (f"FastLoader ({args.threads} threads)", fast),
        (f"DataLoader {args.workers} workers", via(dl)),
        (f"DataLoader {args.workers} workers, ring_slots=0 (fresh batches)", via(dl_fresh)),
        (f"DataLoader {args.workers} workers, default_collate", via(dl_default)),
    ]
    def record(name: str, r: dict[str, Any]) -> None:
        results[f"{tag}: {name}"] = r
        print(f"  {tag}: {name:42s} {r['img_s']:9.0f} img/s  epochs {r['epochs']}", flush=True)

    warm(path)
    for name, make in contenders[:4]:
        # zarr's own API reads a whole chunk per random sample (~200 img/s): one epoch is enough.
        slow = tag == "zarr" and make in (reference, bare)
        record(name, run_epochs(make, n, 1 if slow else args.epochs))
    for name, r in run_interleaved(dict(contenders[4:]), n, args.epochs).items():
        record(name, r)
    del dl, dl_fresh, dl_default
    if args.cold:
        for name, make in contenders[:1] + contenders[3:5]:
            how = drop_cache(path)
            r = run_epochs(make, n, 1)
            results[f"{tag} cold: {name}"] = {**r, "how": how}
            print(f"  {tag} cold: {name:37s} {r['img_s']:9.0f} img/s  ({how})", flush=True)


def bench_imagefolder(train_dir: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    from torchvision import datasets, transforms

    tf = transforms.Compose([
        transforms.RandomResizedCrop(args.size),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(str(train_dir), transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                     persistent_workers=True)
    r = run_epochs(lambda e: dl, len(ds), 2)
    results["ImageFolder+PIL RRC"] = r
    print(f"  {'ImageFolder+PIL RandomResizedCrop':50s} {r['img_s']:9.0f} img/s  epochs {r['epochs']}", flush=True)


def bench_ffcv(python: str, images: Path, labels: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Run bench/ffcv_contender.py with the FFCV venv's python on the same images; add its rows."""
    out = images.parent / "ffcv.json"
    cmd = [python, str(Path(__file__).with_name("ffcv_contender.py")), "--images", str(images), "--labels",
           str(labels), "--batch", str(args.batch), "--also-batch", "64", "--epochs", str(args.epochs),
           "--workers", str(args.workers), "--beton", str(images.parent / "raw.beton"), "--json", str(out)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        print(f"FFCV: contender failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}", flush=True)
        return
    rep = json.loads(out.read_text())
    for r in rep["results"].values():
        name = f"ffcv: Loader raw ({r['workers']} workers, batch {r['batch']})"
        results[name] = {"img_s": r["img_s"], "epochs": r["epochs"], "versions": rep["versions"]}
        print(f"  {name:50s} {r['img_s']:9.0f} img/s  epochs {r['epochs']}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=6000, help="samples per cache")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--jpegs", type=int, default=800, help="JPEGs for the ImageFolder contender")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--shard-size", type=int, default=1024)
    p.add_argument("--storage", nargs="+", default=["npy", "zarr"], choices=["npy", "zarr"])
    p.add_argument("--no-cold", dest="cold", action="store_false")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--ffcv-python", default=os.environ.get("FFCV_PYTHON"),
                   help="python of a venv with ffcv installed (default $FFCV_PYTHON); FFCV skipped when unset")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench_load-", dir=args.workdir))
    results: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        train_dir = make_jpegs(work / "jpegs", args.jpegs)
        images, labels, classes = decode_to_cache_images(train_dir, args.size, args.n)
        for st in args.storage:
            write_cache(work / f"cache-{st}", images, labels, classes, storage=st, shard_size=args.shard_size)
        nbytes = images.nbytes
        if args.ffcv_python:  # the same images and labels the caches were built from, for the FFCV contender
            np.save(work / "ffcv-images.npy", images)
            np.save(work / "ffcv-labels.npy", labels)
        del images
        print(f"setup {time.perf_counter() - t0:.1f}s: {args.n} samples at {args.size} = {nbytes / 1e9:.2f} GB "
              f"per cache; torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}",
              flush=True)
        bench_imagefolder(train_dir, args, results)
        for st in args.storage:
            bench_cache(work / f"cache-{st}", args, results, st)
        if args.ffcv_python:
            bench_ffcv(args.ffcv_python, work / "ffcv-images.npy", work / "ffcv-labels.npy", args, results)
        else:
            print("FFCV: not measured (set --ffcv-python)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    per = nbytes / args.n
    pil = results["ImageFolder+PIL RRC"]["img_s"]
    print(f"\n{'contender':60s} {'img/s':>9s} {'GB/s':>6s} {'x bare':>6s} {'x PIL':>7s}")
    for k, r in results.items():
        ref_key = k.split(":")[0].replace(" cold", "") + ": bare memmap gather (1 thread)"
        ref = results.get(ref_key, {}).get("img_s")
        r["GB_s"] = r["img_s"] * per / 1e9
        r["x_bare_gather"] = r["img_s"] / ref if ref else None
        r["x_imagefolder"] = r["img_s"] / pil
        xr = f"{r['x_bare_gather']:6.2f}" if ref else "     -"
        print(f"{k:60s} {r['img_s']:9.0f} {r['GB_s']:6.2f} {xr} {r['x_imagefolder']:7.1f}")
    for st in args.storage:
        dl_row = f"{st}: DataLoader {args.workers} workers"
        ring, fresh = results.get(dl_row), results.get(f"{dl_row}, ring_slots=0 (fresh batches)")
        if ring and fresh:
            print(f"{st}: DataLoader batch ring / fresh batches = {ring['img_s'] / fresh['img_s']:.2f}x")
    fast = {k: r["img_s"] for k, r in results.items() if "FastLoader" in k and "cold" not in k}
    ffcv = {k: r["img_s"] for k, r in results.items() if k.startswith("ffcv:")}
    ratios = {f"{fk} batch {args.batch} / {k}": fv / v for fk, fv in fast.items() for k, v in ffcv.items()}
    for k, v in ratios.items():
        print(f"FastLoader / FFCV: {k} = {v:.2f}x")
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "sample_bytes": per, "results": results}
    if ratios:
        out["fastloader_over_ffcv"] = ratios
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
