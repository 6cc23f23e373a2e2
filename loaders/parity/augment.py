"""Augmentation: our RandomResizedCrop + flip (the device transform and the worker crop) against torchvision's
``RandomResizedCrop.get_params`` on the same image sizes, by two-sample tests; and the eval centre crop
against torchvision's ``Resize`` + ``CenterCrop``, pixel for pixel.

Crops are compared as four numbers per draw, each relative to the image it was drawn in: area fraction,
log aspect (w / h), and the crop centre's x and y. A Kolmogorov-Smirnov test per number and path, and a
binomial test of the flip rate against torchvision's ``RandomHorizontalFlip(0.5)``; a check fails when any
p-value is under ``alpha``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loaders.parity.checks import Check

__all__ = ["CropDraws", "Sampler", "augmentation", "device_sampler", "eval_crop", "torchvision_draws",
           "worker_sampler"]

STATS = ("area", "log_aspect", "centre_x", "centre_y")
SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)


@dataclass
class CropDraws:
    crops: np.ndarray  # (N, 4) top, left, height, width in the sample
    boxes: np.ndarray  # (N, 4) y0, x0, y1, x1: the image each was drawn in
    flips: np.ndarray | None  # (N,) bool

    def stats(self) -> dict[str, np.ndarray]:
        c, b = self.crops.astype(np.float64), self.boxes.astype(np.float64)
        bh, bw = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
        return {"area": c[:, 2] * c[:, 3] / (bh * bw), "log_aspect": np.log(c[:, 3] / c[:, 2]),
                "centre_x": (c[:, 1] - b[:, 1] + c[:, 3] / 2) / bw, "centre_y": (c[:, 0] - b[:, 0] + c[:, 2] / 2) / bh}


#: (boxes (N, 4) of the images to draw in, sample shape (H, W), seed) -> draws
Sampler = Callable[[np.ndarray, tuple[int, int], int], CropDraws]


def torchvision_draws(boxes: np.ndarray, seed: int, scale: tuple[float, float] = SCALE,
                      ratio: tuple[float, float] = RATIO) -> CropDraws:
    """``torchvision.transforms.RandomResizedCrop.get_params`` once per box (an image of the box's size)."""
    import torch
    from torchvision.transforms import RandomHorizontalFlip, RandomResizedCrop

    torch.manual_seed(seed)
    crops = np.empty((len(boxes), 4), np.int64)
    images: dict[tuple[int, int], torch.Tensor] = {}
    for k, (y0, x0, y1, x1) in enumerate(boxes.tolist()):
        img = images.setdefault((y1 - y0, x1 - x0), torch.empty((1, y1 - y0, x1 - x0), dtype=torch.uint8))
        top, left, h, w = RandomResizedCrop.get_params(img, list(scale), list(ratio))
        crops[k] = (y0 + top, x0 + left, h, w)
    flip = RandomHorizontalFlip(0.5)
    flips = np.array([bool(torch.rand(1) < flip.p) for _ in range(len(boxes))])
    return CropDraws(crops, boxes, flips)


def device_sampler(scale: tuple[float, float] = SCALE, ratio: tuple[float, float] = RATIO) -> Sampler:
    """``loaders.transforms.RandomResizedCrop(flip_p=0.5).get_params``, the device path."""

    def draw(boxes: np.ndarray, shape: tuple[int, int], seed: int) -> CropDraws:
        import torch

        from loaders.transforms import RandomResizedCrop

        t = RandomResizedCrop(shape, scale=scale, ratio=ratio, flip_p=0.5,
                              generator=torch.Generator().manual_seed(seed))
        crops, flips = [], []
        for lo in range(0, len(boxes), 8192):
            b = torch.from_numpy(boxes[lo : lo + 8192].astype(np.int64))
            images = torch.zeros((1, 3, *shape), dtype=torch.uint8).expand(len(b), -1, -1, -1)
            c, f = t.get_params(images, b)
            crops.append(c.numpy())
            flips.append(f.numpy())
        return CropDraws(np.concatenate(crops), boxes, np.concatenate(flips))

    return draw


def worker_sampler(scale: tuple[float, float] = SCALE, ratio: tuple[float, float] = RATIO) -> Sampler:
    """``loaders.worker_crop``'s draws (``draw_crops`` of its per-sample uniforms), the worker path."""

    def draw(boxes: np.ndarray, shape: tuple[int, int], seed: int) -> CropDraws:
        from loaders.worker_crop import RandomResizedCrop, draw_crops, uniforms

        spec = RandomResizedCrop(shape, scale=scale, ratio=ratio)
        crops, flips = draw_crops(spec, boxes, shape, uniforms(seed, 0, np.arange(len(boxes))), 0.5)
        return CropDraws(crops, boxes, flips)

    return draw


def _compare(name: str, ours: CropDraws, ref: CropDraws, alpha: float) -> tuple[list[str], dict[str, object]]:
    from scipy.stats import binomtest, ks_2samp

    a, b = ours.stats(), ref.stats()
    figures: dict[str, object] = {}
    failed = []
    for stat in STATS:
        r = ks_2samp(a[stat], b[stat])
        figures[stat] = {"ks": round(float(r.statistic), 5), "p": float(r.pvalue),
                         "mean": round(float(a[stat].mean()), 5), "reference_mean": round(float(b[stat].mean()), 5)}
        if r.pvalue < alpha:
            failed.append(f"{name} {stat} (KS {r.statistic:.4f}, p={r.pvalue:.2g})")
    if ours.flips is not None:
        k = int(ours.flips.sum())
        p = float(binomtest(k, len(ours.flips), 0.5).pvalue)
        figures["flip"] = {"rate": round(k / len(ours.flips), 5), "p": p}
        if p < alpha:
            failed.append(f"{name} flip rate {k / len(ours.flips):.4f} (p={p:.2g})")
    return failed, figures


def augmentation(boxes: np.ndarray, shape: tuple[int, int], *, draws: int, reference_draws: int, seed: int,
                 alpha: float, samplers: dict[str, Sampler] | None = None,
                 reference: CropDraws | None = None) -> Check:
    """Two-sample tests of each sampler's crops against torchvision's (``reference``: drawn here unless
    given), drawn in ``boxes`` (cycled)."""
    samplers = samplers if samplers is not None else {"device": device_sampler(), "worker": worker_sampler()}
    ref = reference or torchvision_draws(boxes[np.arange(reference_draws) % len(boxes)], seed + 1)
    reference_draws = len(ref.crops)
    ours_boxes = boxes[np.arange(draws) % len(boxes)]
    failed: list[str] = []
    figures: dict[str, object] = {"draws": draws, "reference_draws": reference_draws, "alpha": alpha}
    for name, sampler in samplers.items():
        f, fig = _compare(name, sampler(ours_boxes, shape, seed), ref, alpha)
        failed += f
        figures[name] = fig
    verdict = (f"{len(samplers)} paths x {draws} crops vs {reference_draws} of torchvision's get_params: "
               + ("no test under " if not failed else f"{len(failed)} tests under ") + f"p={alpha:g}"
               + (f": {'; '.join(failed)}" if failed else " (area, aspect, centre x/y, flip rate)"))
    return Check("augmentation", not failed, verdict, figures)


def eval_crop(dataset: object, idx: np.ndarray, crop: int, boxes: np.ndarray | None = None) -> Check:
    """Our eval centre crop (device ``Resize`` + ``CenterCrop``, and the worker ``CenterCrop``) against
    torchvision's ``Resize(round(crop / 0.875))`` + ``CenterCrop(crop)`` on the same uint8 samples (the
    worker's of a ``--fit pad`` cache on each sample's real pixels, its box, as it documents)."""
    import torch
    import torchvision.transforms.v2.functional as F

    from loaders.transforms import CenterCrop, Resize
    from loaders.worker_crop import CenterCrop as WorkerCenterCrop
    from loaders.worker_crop import CropPlan

    resize = round(crop / 0.875)
    idx = np.sort(np.asarray(idx, dtype=np.int64))
    samples = dataset.gather(idx)  # type: ignore[attr-defined]
    x = torch.from_numpy(np.ascontiguousarray(samples)).permute(0, 3, 1, 2)

    def tv(t: torch.Tensor) -> np.ndarray:
        return F.center_crop(F.resize(t, [resize], antialias=True), [crop, crop]).permute(0, 2, 3, 1).numpy()

    ref = tv(x)
    ref_worker = ref if boxes is None else np.concatenate(
        [tv(x[k : k + 1, :, b[0] : b[2], b[1] : b[3]]) for k, b in enumerate(np.asarray(boxes)[idx].tolist())]
        or [ref])
    device = CenterCrop(crop)(Resize(resize)(x)).permute(0, 2, 3, 1).numpy()
    worker = np.empty((len(samples), crop, crop, 3), np.uint8)
    CropPlan(WorkerCenterCrop(crop)).gather(dataset, idx, worker)  # type: ignore[arg-type]
    diffs = {name: int(np.abs(out.astype(np.int16) - want.astype(np.int16)).max()) if len(out) else 0
             for name, out, want in (("device", device, ref), ("worker", worker, ref_worker))}
    ok = all(d == 0 for d in diffs.values())
    verdict = (f"Resize({resize}) + CenterCrop({crop}) of {len(samples)} samples: "
               + ", ".join(f"{k} {'equal' if d == 0 else f'differs by up to {d}'}" for k, d in diffs.items()))
    return Check("eval_crop", ok, verdict, {"crop": crop, "resize": resize, "samples": len(samples),
                                            "max_abs_diff": diffs})
