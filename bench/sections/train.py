"""Train section: whole epochs of one small model fed by each input pipeline, and where a step's time goes.

Every step is cut into four timed parts: waiting for the next batch (data wait), host-to-device copy,
transforms on the device (for the pipelines that do them there) and forward + backward + optimizer
step; on CUDA each part ends with a synchronize so that it holds its own kernels. Same model
initialisation, same files (the cache holds the JPEGs in ImageFolder order), same batch size and
workers for every contender; one short warm-up epoch (worker start-up, lazy imports) is left out.
The losses of every step are kept: the training curves.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from bench.sections.load import MEAN, STD, NaiveNpy
from bench.stats import ratio, summary

__all__ = ["pipelines", "run_train", "timed_epoch"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_epoch(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Any], device: torch.device,
                transform: Callable[[torch.Tensor], torch.Tensor] | None, amp: torch.dtype | None = None,
                max_steps: int | None = None) -> dict[str, Any]:
    """One epoch (or ``max_steps``); seconds per part, samples, and the loss of every step."""
    parts = {"data_wait": 0.0, "h2d": 0.0, "transforms": 0.0, "fwd_bwd": 0.0}
    losses: list[float] = []
    samples = 0
    loss_fn = nn.CrossEntropyLoss()
    it = iter(batches)
    t_start = time.perf_counter()
    while max_steps is None or len(losses) < max_steps:
        t0 = time.perf_counter()
        try:
            x, y = next(it)[:2]
        except StopIteration:
            break
        t1 = time.perf_counter()
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if x.dtype == torch.uint8 and x.ndim == 4 and x.shape[-1] == 3:
            x = x.permute(0, 3, 1, 2)  # NHWC cache batch -> channels_last NCHW view
        _sync(device)
        t2 = time.perf_counter()
        if transform is not None:
            x = transform(x)
        x = x.contiguous(memory_format=torch.channels_last)
        _sync(device)
        t3 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))  # a sync on CUDA too: the step is done
        t4 = time.perf_counter()
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[k] += dt
        samples += len(y)
    return {"seconds": time.perf_counter() - t_start, "samples": samples, "parts": parts, "losses": losses}


def pipelines(cfg: dict[str, Any], src: Path, outputs: dict[str, Path], indices: np.ndarray, crop: int,
              device: torch.device) -> dict[str, tuple[str, Callable[[], Iterable[Any]], Any]]:
    """key -> (label, make an epoch's batches, transform on the device or None)."""
    import torchvision
    import torchvision.transforms as T
    from torchvision.transforms import v2

    from loaders import transforms as CT
    from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch

    b, w = cfg["batch"], cfg["workers"]
    pin = device.type == "cuda"
    kw: dict[str, Any] = {"num_workers": w, "persistent_workers": w > 0, "pin_memory": pin, "drop_last": True}
    if w:
        kw["prefetch_factor"] = 4
    idx = indices.tolist()
    out: dict[str, tuple[str, Callable[[], Iterable[Any]], Any]] = {}

    def loader(ds: Any, **extra: Any) -> Callable[[], Iterable[Any]]:
        dl = DataLoader(Subset(ds, idx), batch_size=b, shuffle=True, **kw, **extra)
        return lambda: dl

    plain = torchvision.datasets.ImageFolder(str(src), T.Compose([
        T.RandomResizedCrop(crop), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]))
    out["imagefolder_pil"] = ("1. ImageFolder + PIL RandomResizedCrop + flip + ToTensor + Normalize", loader(plain),
                              None)
    fixed = torchvision.datasets.ImageFolder(str(src), T.Compose([T.Resize((crop, crop)), T.PILToTensor()]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated from torch 2.14: the classic recipe
        scripted = torch.jit.script(nn.Sequential(T.RandomHorizontalFlip(), T.ConvertImageDtype(torch.float32),
                                                  T.Normalize(MEAN, STD)).to(device))
    out["scriptable"] = ("2. seed-style: PIL Resize((crop, crop)) in workers, scripted v1 flip + ConvertImageDtype + "
                         "Normalize on the batch", loader(fixed), scripted)
    if "naive_npy" in outputs:
        per_sample = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip(),
                                 v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
        out["naive_npy"] = ("3. naive npy cache + torchvision v2 augmentation per sample in workers",
                            loader(NaiveNpy(outputs["naive_npy"], per_sample)), None)
    if "cachebuild_npy" in outputs:
        ds = CachedImageDataset(outputs["cachebuild_npy"])
        tf = CT.imagenet_train(crop).to(device)
        out["cachebuild_dataloader"] = ("4. cachebuild npy: DataLoader + collate_batch, imagenet_train() on the batch",
                                        loader(ds, collate_fn=collate_batch), tf)
        from loaders.worker_crop import RandomResizedCrop

        cropped = CachedImageDataset(outputs["cachebuild_npy"],
                                     DatasetOptions(crop=RandomResizedCrop(crop), flip=True, seed=0))
        out["cachebuild_crop_in_workers"] = ("4. cachebuild npy: DataLoader + collate_batch, RandomResizedCrop + flip "
                                             "in the workers (crop=), Normalize on the batch",
                                             loader(cropped, collate_fn=collate_batch),
                                             CT.Normalize(CT.IMAGENET_MEAN, CT.IMAGENET_STD).to(device))
    return out


def run_train(cfg: dict[str, Any], src: Path, outputs: dict[str, Path], log: Callable[[str], None], *,
              device: torch.device | None = None, model_name: str | None = None, crop: int | None = None,
              amp: torch.dtype | None = None, n: int | None = None, epochs: int | None = None) -> dict[str, Any]:
    from loaders.train.models import build_model

    device = device or torch.device("cpu")
    model_name = model_name or cfg["train_model"]
    crop = crop or cfg["train_crop"]
    epochs = epochs or cfg["epochs"]
    total = len(np.load(outputs["naive_npy"] / "labels.npy")) if "naive_npy" in outputs else cfg["n"]
    n = min(n or cfg["train_n"], total)
    indices = np.linspace(0, total - 1, n).round().astype(np.int64)  # every class, the same files for all
    made = pipelines(cfg, src, outputs, indices, crop, device)
    rows: dict[str, Any] = {}
    for key in list(made):
        label, make, tf = made.pop(key)  # its workers end with it
        torch.manual_seed(0)
        model = build_model(model_name, 10, image_size=crop).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["train_lr"], momentum=0.9)
        timed_epoch(model, opt, make(), device, tf, amp, max_steps=2)  # warm-up: workers, kernels
        torch.manual_seed(0)
        model = build_model(model_name, 10, image_size=crop).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["train_lr"], momentum=0.9)
        runs = [timed_epoch(model, opt, make(), device, tf, amp) for _ in range(epochs)]
        steps = sum(len(r["losses"]) for r in runs)
        rows[key] = {
            "label": label,
            "epoch_s": summary([r["seconds"] for r in runs], 3),
            "img_s": summary([r["samples"] / r["seconds"] for r in runs], 1),
            "data_wait_share": summary([r["parts"]["data_wait"] / r["seconds"] for r in runs], 3),
            "step_ms": {k: round(1e3 * sum(r["parts"][k] for r in runs) / steps, 2) for k in runs[0]["parts"]},
            "losses": [round(v, 4) for r in runs for v in r["losses"]],
        }
        log(f"  train {key:24s} {rows[key]['epoch_s']['median']:7.2f} s/epoch  "
            f"data wait {rows[key]['data_wait_share']['median']:.1%}")
    base = rows.get("imagefolder_pil", {}).get("img_s")
    for r in rows.values():
        r["x_imagefolder"] = ratio(r["img_s"], base)
    return {"model": model_name, "crop": crop, "images": n, "batch": cfg["batch"], "workers": cfg["workers"],
            "epochs": epochs, "warmup": "2 steps per contender, left out", "device": str(device),
            "amp": str(amp).replace("torch.", "") if amp else "off", "contenders": rows}
