"""Train a timm model from a cachebuild cache: our loader and device transforms, timm's model zoo and Mixup.

    pip install "cachebuild[timm]"
    python examples/timm_train.py /caches/in-224/train --val /caches/in-224/val --model resnet50 \\
        --epochs 90 --batch-size 256 --mixup 0.8 --cutmix 1.0 --smoothing 0.1

The data path is the one ``cachebuild train`` uses: ``CachedImageDataset`` (memory-mapped uint8 NHWC) ->
``CacheSampler`` (shuffled, DDP-sharded, resumable) -> ``DataLoader(collate_fn=collate_batch)`` (whole
batches, no per-sample collation) -> ``device_loader`` (pinned copy, NCHW channels_last view) ->
``imagenet_train`` on the device (per-sample RandomResizedCrop + flip + Normalize) -> ``timm.data.Mixup``
(``--mix timm``, the default) or our ``MixUpCutMix`` (``--mix ours``) -> ``timm.create_model`` with timm's
``SoftTargetCrossEntropy``. timm's Mixup needs an even batch, so the training loader drops the last
partial batch (timm's own training loader does the same); ours would take it.

``pretrained=False`` always: nothing is downloaded. Run ``--help`` for the options.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import timm
import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.utils.data import DataLoader

from loaders import CachedImageDataset, CacheSampler, collate_batch, device_loader
from loaders.transforms import MixUpCutMix, imagenet_eval, imagenet_train

__all__ = ["build_mix", "main", "make_loader", "parse_args", "train"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train", help="training cache (folder or URL)")
    p.add_argument("--val", help="validation cache")
    p.add_argument("--model", default="resnet10t", help="any timm.create_model name (pretrained=False)")
    p.add_argument("--img-size", type=int, default=None, help="crop size (default: the cache's)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mix", choices=("timm", "ours"), default="timm", help="timm.data.Mixup or our MixUpCutMix")
    p.add_argument("--mixup", type=float, default=0.8, help="MixUp alpha (0: off)")
    p.add_argument("--cutmix", type=float, default=1.0, help="CutMix alpha (0: off)")
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def make_loader(ds: CachedImageDataset, sampler: Any, batch_size: int, workers: int, device: torch.device,
                drop_last: bool) -> Any:
    """Our loader path: whole gathered batches (``collate_batch``), moved by ``device_loader``."""
    kw: dict[str, Any] = {}
    if workers > 0:
        kw = {"persistent_workers": True, "prefetch_factor": 4}
        ds.ring_slots = 4 + 3  # batch-ring slots per worker to match the prefetch (CachedImageDataset)
    dl = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, collate_fn=collate_batch,
                    pin_memory=device.type == "cuda", drop_last=drop_last, **kw)
    return device_loader(dl, device)


def build_mix(args: argparse.Namespace, num_classes: int, generator: torch.Generator | None = None) -> Any:
    """``(images, labels) -> (images, soft targets)``: timm's Mixup, or ours with the same parameters."""
    if args.mixup <= 0 and args.cutmix <= 0:
        return None
    if args.mix == "timm":
        return Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=num_classes)
    return MixUpCutMix(num_classes, mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                       label_smoothing=args.smoothing, pairing="flip", generator=generator)


@dataclass
class Summary:
    steps: int
    samples: int
    first_loss: float
    last_loss: float
    val_acc: float | None
    img_per_s: float


def _evaluate(model: torch.nn.Module, loader: Any, tf: Any) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(tf(x)).argmax(1) == y).sum())
            total += len(y)
    model.train()
    return correct / max(total, 1)


def train(args: argparse.Namespace) -> Summary:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    ds = CachedImageDataset(args.train)
    num_classes = len(ds.classes)
    size = args.img_size or ds.shape[0]
    sampler = CacheSampler(ds, shuffle=True, seed=args.seed)
    mix = build_mix(args, num_classes)
    loader = make_loader(ds, sampler, args.batch_size, args.workers, device, drop_last=mix is not None)
    train_tf = imagenet_train(size).to(device)
    model = timm.create_model(args.model, pretrained=False, num_classes=num_classes)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5)
    loss_fn = SoftTargetCrossEntropy() if mix is not None else torch.nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    losses: list[float] = []
    steps = samples = 0
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = train_tf(x)
            if mix is not None:
                x, y = mix(x, y)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            sampler.advance(len(x))
            steps, samples = steps + 1, samples + len(x)
            if args.max_steps and steps >= args.max_steps:
                break
        if args.max_steps and steps >= args.max_steps:
            break
    elapsed = time.perf_counter() - t0
    val_acc = None
    if args.val:
        val_ds = CachedImageDataset(args.val)
        val_loader = make_loader(val_ds, range(len(val_ds)), args.batch_size, args.workers, device, drop_last=False)
        val_acc = _evaluate(model, val_loader, imagenet_eval(size, resize_size=size).to(device))
    if not losses or not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"training diverged or ran no step: losses {losses[:5]}...")
    return Summary(steps, samples, losses[0], losses[-1], val_acc, samples / max(elapsed, 1e-9))


def main(argv: Sequence[str] | None = None) -> Summary:
    s = train(parse_args(argv))
    val = f", val acc {s.val_acc:.3f}" if s.val_acc is not None else ""
    print(f"{s.steps} steps, {s.samples} samples, loss {s.first_loss:.3f} -> {s.last_loss:.3f}{val}, "
          f"{s.img_per_s:.0f} img/s")
    return s


if __name__ == "__main__":
    main()
