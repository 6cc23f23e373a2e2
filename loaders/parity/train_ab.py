"""Training A/B: the same model, seed, batches of the same samples and steps, fed by torchvision's pipeline
(the source files, ``RandomResizedCrop`` + flip on PIL images) and by the cache's (uint8 samples,
``loaders.transforms`` on the batch); loss curves and the paired difference of final accuracy.

Both models start from one initialisation and see the same sample indices in the same order; only the
pipeline differs. Accuracy is compared per image on one evaluation set (``--val``'s cache and its source
files, else the trained split's), so the interval is that of a paired difference: mean +- 1.96 standard
errors of (cache hit - torchvision hit).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loaders.parity.checks import Check
from loaders.parity.references import Listing

__all__ = ["AbData", "AbSettings", "training_ab"]


@dataclass(frozen=True)
class AbSettings:
    steps: int
    batch: int
    model: str
    lr: float
    seed: int


@dataclass
class AbData:
    """One split on both sides: the cache's dataset and, for sample ``i``, the reference's index."""

    dataset: Any  # loaders.CachedImageDataset
    listing: Listing
    ref_index: np.ndarray  # cache index -> listing index (>= 0 for every sample used)


def _tv_batch(data: AbData, idx: np.ndarray, tf: Callable[[Any], Any]) -> Any:
    import torch

    return torch.stack([tf(data.listing.open(int(data.ref_index[i]))) for i in idx])


def _cache_batch(data: AbData, idx: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(data.dataset.gather(np.sort(idx)))).permute(0, 3, 1, 2)


def _batches(n: int, s: AbSettings) -> list[np.ndarray]:
    """The sample indices of every step: epochs of one seeded permutation each, sorted within a batch."""
    rng, out = np.random.default_rng(s.seed), []  # type: np.random.Generator, list[np.ndarray]
    b = min(s.batch, n)
    while len(out) < s.steps:
        perm = rng.permutation(n)
        out += [np.sort(perm[lo : lo + b]) for lo in range(0, n - b + 1, b)]
    return out[: s.steps]


def _train(model: Any, batches: list[np.ndarray], make: Callable[[np.ndarray], Any], y: np.ndarray,
           s: AbSettings, norm: Callable[[Any], Any]) -> list[float]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=0.9, weight_decay=5e-5)
    loss_fn, losses = torch.nn.CrossEntropyLoss(), []
    model.train()
    for idx in batches:
        x = norm(make(idx))
        loss = loss_fn(model(x), torch.from_numpy(y[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _hits(model: Any, n: int, make: Callable[[np.ndarray], Any], y: np.ndarray, norm: Callable[[Any], Any]) -> Any:
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for lo in range(0, n, 64):
            idx = np.arange(lo, min(n, lo + 64))
            out.append((model(norm(make(idx))).argmax(1).numpy() == y[idx]).astype(np.float64))
    return np.concatenate(out) if out else np.zeros(0)


def training_ab(train: AbData, val: AbData, s: AbSettings, png: Path | None) -> Check:
    """Train twice (torchvision, cache), evaluate both on ``val``; the check passes when the 95% interval of
    the accuracy difference holds 0."""
    import torch
    import torchvision.transforms.v2 as T

    from loaders.train.models import build_model
    from loaders.transforms import CenterCrop, Normalize, RandomResizedCrop, Resize
    from loaders.transforms.presets import IMAGENET_MEAN, IMAGENET_STD

    size = train.dataset.shape[0]
    crop = max(8, round(size * 0.875))
    resize = round(crop / 0.875)
    norm = Normalize(IMAGENET_MEAN, IMAGENET_STD)
    torch.manual_seed(s.seed)
    base = build_model(s.model, len(train.listing.classes) or int(train.dataset.labels.max()) + 1,
                       image_size=crop, channels_last=False)
    batches = _batches(len(train.dataset), s)
    y_train = np.asarray(train.dataset.labels, dtype=np.int64)
    tv_train = T.Compose([T.PILToTensor(), T.RandomResizedCrop(crop, antialias=True), T.RandomHorizontalFlip()])
    tv_eval = T.Compose([T.PILToTensor(), T.Resize(resize, antialias=True), T.CenterCrop(crop)])
    dev_train = RandomResizedCrop(crop, flip_p=0.5, generator=torch.Generator().manual_seed(s.seed))
    dev_eval = torch.nn.Sequential(Resize(resize), CenterCrop(crop))
    torch.manual_seed(s.seed + 1)  # torchvision's transforms draw from the global generator
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    loss_a = _train(a, batches, lambda i: _tv_batch(train, i, tv_train), y_train, s, norm)
    loss_b = _train(b, batches, lambda i: dev_train(_cache_batch(train, i)), y_train, s, norm)
    y_val = np.asarray(val.dataset.labels, dtype=np.int64)
    hit_a = _hits(a, len(val.dataset), lambda i: _tv_batch(val, i, tv_eval), y_val, norm)
    hit_b = _hits(b, len(val.dataset), lambda i: dev_eval(_cache_batch(val, i)), y_val, norm)
    d = hit_b - hit_a
    mean = float(d.mean()) if len(d) else math.nan
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
    lo, hi = mean - 1.96 * se, mean + 1.96 * se
    if png is not None:
        _plot(loss_a, loss_b, png)
    ok = len(d) > 0 and lo <= 0.0 <= hi
    verdict = (f"{s.steps} steps of {s.model}, batch {min(s.batch, len(train.dataset))}: accuracy torchvision "
               f"{hit_a.mean():.3f}, cache {hit_b.mean():.3f} on {len(d)} images, difference {mean:+.3f} "
               f"(95% interval {lo:+.3f} to {hi:+.3f}{', holds 0' if ok else ', excludes 0'}); final loss "
               f"{np.mean(loss_a[-5:]):.3f} vs {np.mean(loss_b[-5:]):.3f}")
    return Check("training", ok, verdict, {
        "steps": s.steps, "batch": s.batch, "model": s.model, "lr": s.lr, "seed": s.seed, "eval_images": len(d),
        "accuracy_torchvision": float(hit_a.mean()), "accuracy_cache": float(hit_b.mean()),
        "difference": mean, "interval_95": [lo, hi], "loss_torchvision": loss_a, "loss_cache": loss_b})


def _plot(loss_a: list[float], loss_b: list[float], png: Path) -> None:
    from loaders.train.metrics import pyplot

    plt = pyplot(f"parity's {png.name}")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(loss_a) + 1), loss_a, label="torchvision ImageFolder pipeline")
    ax.plot(range(1, len(loss_b) + 1), loss_b, label="cache pipeline")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("training A/B: same model, seed, samples and steps")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
