"""Training-step benchmark: whole epochs of the same model fed by three input pipelines, side by side.

    python bench/bench_train.py                    # ~400 real-photo JPEGs, 128 px cache, 112 px crops, CPU
    python bench/bench_train.py --n 1000 --json out.json

Contenders (one process run, same JPEGs, same model and crop, the same number of optimizer steps):
  ImageFolder+PIL   torchvision ImageFolder: PIL decode + RandomResizedCrop + flip + ToTensor + Normalize
                    per image in DataLoader workers (the plain pipeline)
  scripted v1       per-image PIL decode + Resize((S, S)) to a fixed size in the workers, then torchvision
                    v1 transforms (RandomResizedCrop, flip, Normalize) jit-scripted on the whole batch
                    on the device (the classic "device transforms" fix; note that v1 draws ONE crop and
                    ONE flip for the whole batch)
  cachebuild        cache -> CachedImageDataset -> DataLoader (workers, collate_batch) -> device_loader
                    -> per-sample imagenet_train() device transforms
  cachebuild thr    the same with FastLoader (threads, no worker processes)
Each reports whole-epoch seconds (worker start-up included), img/s, and the data-wait share (time
blocked on the next batch / step time). Then ``fit()`` (what ``cachebuild train`` runs) on the same
cache for the CPU demo model, and, with CUDA, resnet50 at batch 256, bf16, 224 px (img/s, data wait).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loaders.train.loop import EpochResult, train_one_epoch
from loaders.train.models import build_model

__all__ = ["main"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def make_data(root: Path, n: int, size: int, jobs: int) -> tuple[Path, Path, float]:
    """JPEGs in an ImageFolder tree (cachebuild.samples.write_imagenet) and their cache at ``size``."""
    from cachebuild.pipeline import BuildOptions, build
    from cachebuild.samples.imagenet_layout import write_imagenet
    from cachebuild.sources.folder import folder_plan

    n_classes = 10
    info = write_imagenet(root / "jpeg", n_classes=n_classes, train_per_class=max(1, n // n_classes),
                          val_per_class=0)
    train_dir = Path(info["train_dir"])
    res = build(folder_plan(train_dir, dataset="bench", split="train"), root / "cache",
                BuildOptions(size=size, jobs=jobs, progress=False))
    return train_dir, res.path, res.images_per_second


def _model(name: str, n_classes: int, crop: int, device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, n_classes, image_size=crop).to(device)


def _run(model: nn.Module, batches: Iterable[Any], n_batches: int, device: torch.device,
         transform: Any = None, amp_dtype: torch.dtype | None = None) -> EpochResult:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return train_one_epoch(model, batches, opt, transform=transform, num_batches=n_batches, device=device,
                           amp_dtype=amp_dtype)


def _row(name: str, wall: float, res: EpochResult) -> dict[str, Any]:
    return {"pipeline": name, "epoch_s": round(wall, 2), "img_s": round(res.samples / wall, 1),
            "data_wait": round(res.data_wait_share, 3), "images": res.samples}


def bench_pipelines(train_dir: Path, cache: Path, args: argparse.Namespace, device: torch.device) -> list[dict]:
    import torchvision
    import torchvision.transforms as T1
    from torch.utils.data import DataLoader

    from loaders import transforms as CT
    from loaders.dataset import CachedImageDataset, collate_batch
    from loaders.device import FastLoader, device_loader
    from loaders.sampler import CacheSampler

    crop, bs, workers = args.crop, args.batch_size, args.workers
    dl_kw: dict[str, Any] = {"num_workers": workers, "pin_memory": device.type == "cuda", "drop_last": True}
    if workers:
        dl_kw["prefetch_factor"] = 4
    rows = []

    def timed(name: str, make_batches: Any, n_batches: int, transform: Any = None) -> None:
        model = _model(args.model, 10, crop, device, args.seed)
        warm = min(2, n_batches)  # page cache, kernels, lazy imports
        _run(model, itertools.islice(make_batches(warmup=True), warm), warm, device, transform)
        model = _model(args.model, 10, crop, device, args.seed)
        t0 = time.perf_counter()
        res = _run(model, make_batches(warmup=False), n_batches, device, transform)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(_row(name, time.perf_counter() - t0, res))
        print(f"  {name:18s} {rows[-1]['epoch_s']:7.2f} s  {rows[-1]['img_s']:8.1f} img/s  "
              f"data wait {rows[-1]['data_wait']:.1%}", flush=True)

    # 1. The plain pipeline.
    plain = torchvision.datasets.ImageFolder(str(train_dir), transform=T1.Compose([
        T1.RandomResizedCrop(crop), T1.RandomHorizontalFlip(), T1.ToTensor(), T1.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ]))
    n_batches = len(plain) // bs

    def plain_batches(warmup: bool) -> Iterable[Any]:
        dl = DataLoader(plain, batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(0), **dl_kw)
        return ((x.to(device).contiguous(memory_format=torch.channels_last), y.to(device)) for x, y in dl)

    timed("ImageFolder+PIL", plain_batches, n_batches)

    # 2. Fixed-size per-image decode in workers, v1 transforms scripted on the batch.
    fixed = torchvision.datasets.ImageFolder(str(train_dir), transform=T1.Compose([
        T1.Resize((args.size, args.size)), T1.PILToTensor(),
    ]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated in torch 2.14; this is the classic recipe
        scripted = torch.jit.script(nn.Sequential(
            T1.RandomResizedCrop(crop, antialias=True), T1.RandomHorizontalFlip(),
            T1.ConvertImageDtype(torch.float32), T1.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ).to(device))

    def fixed_batches(warmup: bool) -> Iterable[Any]:
        dl = DataLoader(fixed, batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(0), **dl_kw)
        return ((x.to(device, non_blocking=True), y.to(device)) for x, y in dl)

    def v1(x: torch.Tensor) -> torch.Tensor:
        return scripted(x).contiguous(memory_format=torch.channels_last)

    timed("scripted v1", fixed_batches, n_batches, v1)

    # 3. cachebuild: cache -> loader -> device transforms.
    ds = CachedImageDataset(cache, in_memory=False)
    tf = CT.imagenet_train(crop).to(device)

    def cache_batches(warmup: bool) -> Iterable[Any]:
        sampler = CacheSampler(ds, shuffle=True, seed=0, drop_last=True)
        dl = DataLoader(ds, batch_size=bs, sampler=sampler, collate_fn=collate_batch, **dl_kw)
        return device_loader(dl, device)

    timed("cachebuild", cache_batches, len(ds) // bs, tf)

    def thread_batches(warmup: bool) -> Iterable[Any]:
        fl = FastLoader(ds, bs, sampler=CacheSampler(ds, shuffle=True, seed=0), drop_last=True,
                        num_threads=max(1, workers), pin_memory=device.type == "cuda")
        return device_loader(fl, device)

    timed("cachebuild thr", thread_batches, len(ds) // bs, tf)
    return rows


def bench_fit(cache: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The CLI's own loop on the same cache (the demo model on CPU): its printed figures."""
    from loaders.train.run import TrainConfig, fit

    summary = fit(TrainConfig(train=str(cache), out=str(out), model=args.model, epochs=args.fit_epochs,
                              batch_size=args.batch_size, workers=args.workers, device=args.device,
                              crop=args.crop, amp="off", log_every=0, progress=False, seed=args.seed),
                  echo=lambda _m: None)
    return {k: summary[k] for k in ("img_per_s", "data_wait", "mean_img_per_s", "mean_data_wait", "train_loss")}


def bench_cuda_resnet50(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """resnet50, batch 256, bf16 autocast, 224 px crops from a 256 px cache: img/s and data wait."""
    from torch.utils.data import DataLoader

    from cachebuild.format import write_cache
    from loaders import transforms as CT
    from loaders.dataset import CachedImageDataset, collate_batch
    from loaders.device import device_loader
    from loaders.sampler import CacheSampler

    dev = torch.device("cuda")
    n, bs = args.cuda_images, 256
    g = torch.Generator().manual_seed(0)
    imgs = torch.randint(0, 256, (n, 256, 256, 3), dtype=torch.uint8, generator=g).numpy()
    labels = torch.randint(0, 1000, (n,), generator=g).numpy()
    path = root / "cache256"
    write_cache(path, imgs, labels, [f"c{i}" for i in range(1000)], replace=True)
    ds = CachedImageDataset(path, in_memory=True)
    dl = DataLoader(ds, batch_size=bs, sampler=CacheSampler(ds, seed=0), collate_fn=collate_batch,
                    num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=args.workers > 0)
    model = build_model("resnet50", 1000).to(dev)
    tf = CT.imagenet_train(224).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n_batches = n // bs
    train_one_epoch(model, device_loader(dl, dev), opt, transform=tf, amp_dtype=torch.bfloat16,
                    num_batches=n_batches)  # warm-up: cuDNN autotune, workers
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = train_one_epoch(model, device_loader(dl, dev), opt, transform=tf, amp_dtype=torch.bfloat16,
                          num_batches=n_batches)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"model": "resnet50", "batch": bs, "amp": "bf16", "crop": 224, "images": res.samples,
            "img_s": round(res.samples / wall, 1), "data_wait": round(res.data_wait_share, 3),
            "gpu": torch.cuda.get_device_name(dev)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=400, help="JPEGs to write and train on (10 classes)")
    p.add_argument("--size", type=int, default=128, help="cache side (and the fixed size of 'scripted v1')")
    p.add_argument("--crop", type=int, default=112, help="training resolution")
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers / FastLoader threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fit-epochs", type=int, default=2, help="epochs of the fit() run (0: skip it)")
    p.add_argument("--cuda-images", type=int, default=5120, help="images of the CUDA resnet50 run")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA resnet50 run even when CUDA exists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", type=Path, default=None, help="work folder (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))

    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        root = args.root or Path(tmp)
        t0 = time.perf_counter()
        train_dir, cache, build_ips = make_data(root, args.n, args.size, jobs=max(1, args.workers))
        print(f"data: {args.n} JPEGs + cache {args.size}px in {time.perf_counter() - t0:.1f}s "
              f"(build {build_ips:.0f} img/s); model {args.model}, crop {args.crop}, batch {args.batch_size}, "
              f"{args.workers} workers, torch threads {torch.get_num_threads()}, {device}", flush=True)
        results: dict[str, Any] = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]},
        }
        results["pipelines"] = bench_pipelines(train_dir, cache, args, device)
        base = results["pipelines"][0]["epoch_s"]
        for r in results["pipelines"]:
            r["speedup_vs_imagefolder"] = round(base / r["epoch_s"], 2)
        if args.fit_epochs:
            results["fit"] = bench_fit(cache, root / "run", args)
            f = results["fit"]
            print(f"  fit() {args.model} x{args.fit_epochs} epochs: {f['mean_img_per_s']:.1f} img/s, "
                  f"data wait {f['mean_data_wait']:.1%}", flush=True)
        if torch.cuda.is_available() and not args.no_cuda:
            results["cuda_resnet50"] = bench_cuda_resnet50(root, args)
            print(f"  cuda resnet50: {results['cuda_resnet50']}", flush=True)

    print()
    print("| pipeline | epoch s | img/s | data wait | vs ImageFolder |")
    print("|---|---:|---:|---:|---:|")
    for r in results["pipelines"]:
        print(f"| {r['pipeline']} | {r['epoch_s']:.2f} | {r['img_s']:.1f} | {r['data_wait']:.1%} | "
              f"{r['speedup_vs_imagefolder']:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
