"""Training A/B: the same model trained on torchvision's pipeline (the source files, ``RandomResizedCrop`` +
flip on PIL images, the reference's labels) and on the cache's (uint8 samples, ``loaders.transforms`` on the
batch, the cache's labels), several times; the verdict is on the spread of the paired differences.

One training run is a noisy measurement: two runs of one pipeline that differ only in their crop draws end
several points of accuracy apart after a few dozen steps, so one run's difference says little. The design:

* ``runs`` paired runs. Run ``r`` draws one initialisation and one sample order from ``(seed, r)`` and gives
  both to both pipelines; only the pipeline (and so its random crops) differs within a run.
* Both models of a run are evaluated on the same images with the same labels: torchvision's eval view
  (``Resize`` + ``CenterCrop``) of the source files of ``--val``'s samples (else of the trained split's), with
  the reference's labels. A cache that teaches the model something else (wrong labels, other pixels) is
  measured on the images and labels it should have taught.
* ``d_r`` = cache accuracy - torchvision accuracy of run ``r``. The check fails when the ``1 - alpha``
  t-interval of their mean, ``mean +- t(1 - alpha / 2, runs - 1) * sd / sqrt(runs)``, lies wholly beyond
  ``+-margin``: evidence that the two pipelines train more than ``margin`` apart. Not "excludes 0": an honest
  cache is not torchvision's pipeline (its crops come from the stored square, not the whole photo), and with
  few steps that alone moves accuracy a few points one way, which an interval around 0 calls a failure on some
  seeds and not others. The difference it detects at 80% power, ``margin + (t(1 - alpha / 2) + t(0.8)) * sd /
  sqrt(runs)`` with the spread seen, is in its figures and verdict: a pass says "no difference of that size",
  not "equal".
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

__all__ = ["AbData", "AbSettings", "paired_verdict", "training_ab"]

POWER = 0.8  # the power at which the detectable difference is stated
_DECODED_BYTES = 1 << 30  # source images kept decoded across steps and runs (each is opened once while this lasts)


@dataclass(frozen=True)
class AbSettings:
    steps: int
    batch: int
    model: str
    lr: float
    seed: int
    runs: int = 5
    alpha: float = 0.01
    eval_images: int = 2000
    margin: float = 0.1  # accuracy points the pipelines may differ by before the check fails


@dataclass
class AbData:
    """One split on both sides: the cache's dataset and, for sample ``i``, the reference's index."""

    dataset: Any  # loaders.CachedImageDataset
    listing: Listing
    ref_index: np.ndarray  # cache index -> listing index (>= 0 for every sample used)


@dataclass(frozen=True)
class PairedDifference:
    """The runs' differences and what they say at ``alpha``."""

    differences: np.ndarray
    mean: float
    sd: float
    interval: tuple[float, float]
    detectable: float  # the difference found with probability POWER, for the spread seen
    passed: bool


def paired_verdict(differences: np.ndarray, alpha: float, margin: float) -> PairedDifference:
    """The t-interval of the mean of ``differences`` (one per paired run) at ``1 - alpha``; passes unless it
    lies wholly beyond ``+-margin``. Needs two runs or more."""
    from scipy.stats import t

    d = np.asarray(differences, dtype=np.float64)
    k = len(d)
    if k < 2:
        raise ValueError(f"a paired verdict needs two runs or more, got {k}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    crit = float(t.ppf(1 - alpha / 2, k - 1))
    half = crit * sd / math.sqrt(k)
    lo, hi = mean - half, mean + half
    detectable = margin + (crit + float(t.ppf(POWER, k - 1))) * sd / math.sqrt(k)
    return PairedDifference(d, mean, sd, (lo, hi), detectable, lo <= margin and hi >= -margin)


class _Decoded:
    """``listing.open(i)``, each image decoded once while the decoded ones fit ``budget`` bytes."""

    def __init__(self, listing: Listing, budget: int = _DECODED_BYTES) -> None:
        self.listing, self.budget, self.kept = listing, budget, {}  # type: Listing, int, dict[int, Any]

    def __call__(self, i: int) -> Any:
        img = self.kept.get(i)
        if img is None:
            img = self.listing.open(i)
            size = (img.width * img.height * 3) if hasattr(img, "width") else int(np.asarray(img).nbytes)
            if size <= self.budget:
                self.kept[i] = img
                self.budget -= size
        return img


def _batches(n: int, steps: int, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The sample indices of every step: epochs of one seeded permutation each, sorted within a batch."""
    out: list[np.ndarray] = []
    b = min(batch, n)
    while len(out) < steps:
        perm = rng.permutation(n)
        out += [np.sort(perm[lo : lo + b]) for lo in range(0, n - b + 1, b)]
    return out[:steps]


def _train(model: Any, batches: list[np.ndarray], make: Callable[[np.ndarray], Any], y: np.ndarray,
           s: AbSettings, norm: Callable[[Any], Any]) -> list[float]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=0.9, weight_decay=5e-5)
    loss_fn, losses = torch.nn.CrossEntropyLoss(), []
    model.train()
    for idx in batches:
        loss = loss_fn(model(norm(make(idx))), torch.from_numpy(y[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _accuracy(model: Any, x: Any, y: np.ndarray, norm: Callable[[Any], Any]) -> float:
    import torch

    model.eval()
    hits = 0
    with torch.no_grad():
        for lo in range(0, len(y), 64):
            pred = model(norm(x[lo : lo + 64])).argmax(1).numpy()
            hits += int((pred == y[lo : lo + 64]).sum())
    return hits / max(len(y), 1)


def _run_seed(seed: int, run: int) -> int:
    return int(np.random.SeedSequence([seed, run]).generate_state(1)[0])


def training_ab(train: AbData, val: AbData, s: AbSettings, png: Path | None) -> Check:
    """``s.runs`` paired trainings (torchvision, cache) evaluated on the same reference images; the check
    passes unless the interval of the mean accuracy difference lies beyond ``+-s.margin`` (the module docstring)."""
    import torch
    import torchvision.transforms.v2 as T

    from loaders.train.models import build_model
    from loaders.transforms import Normalize, RandomResizedCrop
    from loaders.transforms.presets import IMAGENET_MEAN, IMAGENET_STD

    size = train.dataset.shape[0]
    crop = max(8, round(size * 0.875))
    norm = Normalize(IMAGENET_MEAN, IMAGENET_STD)
    num_classes = len(train.listing.classes) or int(np.max(train.dataset.labels)) + 1
    y_tv = np.asarray(train.listing.labels, dtype=np.int64)[train.ref_index]  # the reference's labels
    y_cache = np.asarray(train.dataset.labels, dtype=np.int64)
    unlabelled = int((y_tv < 0).sum()) + int((y_tv >= num_classes).sum())
    eval_pick = np.random.default_rng([s.seed, 1 << 20]).permutation(len(val.ref_index))[: s.eval_images]
    eval_ref = np.sort(val.ref_index[eval_pick])
    y_eval = np.asarray(val.listing.labels, dtype=np.int64)[eval_ref]
    if unlabelled or (y_eval < 0).any():
        return Check("training", False, "some samples have no reference label: see the labels check", {})
    tv_train = T.Compose([T.PILToTensor(), T.RandomResizedCrop(crop, antialias=True), T.RandomHorizontalFlip()])
    tv_eval = T.Compose([T.PILToTensor(), T.Resize(round(crop / 0.875), antialias=True), T.CenterCrop(crop)])
    val_open = _Decoded(val.listing, 0)  # each evaluation image is read once, here
    x_eval = torch.stack([tv_eval(val_open(int(j))) for j in eval_ref]) if len(eval_ref) else \
        torch.zeros((0, 3, crop, crop), dtype=torch.uint8)
    source = _Decoded(train.listing)

    def tv_batch(idx: np.ndarray) -> Any:
        return torch.stack([tv_train(source(int(train.ref_index[i]))) for i in idx])

    def cache_batch(idx: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(train.dataset.gather(np.sort(idx)))).permute(0, 3, 1, 2)

    acc = np.zeros((s.runs, 2))
    curves: list[tuple[list[float], list[float]]] = []
    for r in range(s.runs):
        seed = _run_seed(s.seed, r)
        torch.manual_seed(seed)
        base = build_model(s.model, num_classes, image_size=crop, channels_last=False)
        batches = _batches(len(train.ref_index), s.steps, s.batch, np.random.default_rng(seed))
        dev_train = RandomResizedCrop(crop, flip_p=0.5, generator=torch.Generator().manual_seed(seed + 2))
        torch.manual_seed(seed + 1)  # torchvision's transforms draw from the global generator
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        loss_a = _train(a, batches, tv_batch, y_tv, s, norm)

        def make_b(i: np.ndarray, crop: Any = dev_train) -> Any:
            return crop(cache_batch(i))

        loss_b = _train(b, batches, make_b, y_cache, s, norm)
        acc[r] = _accuracy(a, x_eval, y_eval, norm), _accuracy(b, x_eval, y_eval, norm)
        curves.append((loss_a, loss_b))
    v = paired_verdict(acc[:, 1] - acc[:, 0], s.alpha, s.margin)
    if png is not None:
        _plot(curves, png)
    level = f"{1 - s.alpha:.0%}" if round((1 - s.alpha) * 100, 6).is_integer() else f"{1 - s.alpha:.4g}"
    lo, hi = v.interval
    verdict = (f"{s.runs} paired runs of {s.steps} steps of {s.model}, batch {min(s.batch, len(y_cache))}, on "
               f"{len(y_eval)} reference images: accuracy torchvision {acc[:, 0].mean():.3f}, cache "
               f"{acc[:, 1].mean():.3f}, difference {v.mean:+.3f} (sd {v.sd:.3f} over runs; {level} interval "
               f"{lo:+.3f} to {hi:+.3f}, {'overlaps' if v.passed else 'beyond'} +-{s.margin:.3f}); with "
               f"this spread a difference of {v.detectable:.3f} is found {POWER:.0%} of the time")
    return Check("training", v.passed, verdict, {
        "steps": s.steps, "batch": s.batch, "model": s.model, "lr": s.lr, "seed": s.seed, "runs": s.runs,
        "alpha": s.alpha, "margin": s.margin, "eval_images": len(y_eval),
        "accuracy_torchvision": acc[:, 0].tolist(),
        "accuracy_cache": acc[:, 1].tolist(), "differences": v.differences.tolist(), "difference": v.mean,
        "sd": v.sd, "interval": list(v.interval), "detectable_difference": v.detectable, "power": POWER,
        "loss_torchvision": [c[0] for c in curves], "loss_cache": [c[1] for c in curves]})


def _plot(curves: list[tuple[list[float], list[float]]], png: Path) -> None:
    from loaders.train.metrics import pyplot

    plt = pyplot(f"parity's {png.name}")
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, (loss_a, loss_b) in enumerate(curves):
        steps = range(1, len(loss_a) + 1)
        ax.plot(steps, loss_a, color="tab:blue", alpha=0.6, label="torchvision ImageFolder pipeline" if not r else None)
        ax.plot(steps, loss_b, color="tab:orange", alpha=0.6, label="cache pipeline" if not r else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"training A/B: {len(curves)} paired runs (each: one model, seed and sample order)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
