"""Order, labels and pixels of a cache against a reference listing; each a :class:`Check` with its figures.

The pixels' reference for each fit, from the recipe (docs/FORMAT.md): ``crop`` is torchvision's ``Resize(S)`` +
``CenterCrop(S)`` on the PIL image; ``squash`` ``Resize((S, S))``; ``pad`` ``Resize`` to the letterbox and
zeros around it. ``antialias`` is PIL's bilinear (what torchvision does to PIL images), ``area`` PIL's box
filter when shrinking, ``linear`` torchvision's tensor bilinear with ``antialias=False``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachebuild.storage.cache import CacheReader
from loaders.parity.recipe import Recipe
from loaders.parity.references import Listing

__all__ = ["Check", "Matching", "PixelResult", "letterbox", "match_samples", "order_and_labels", "pixels", "psnr",
           "reference_pixels"]

@dataclass
class Check:
    """One check: passed or not, a one-line verdict that names the first problem, and its figures."""

    name: str
    passed: bool
    verdict: str
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.name}: {'ok' if self.passed else 'FAIL'}, {self.verdict}"


@dataclass
class Matching:
    """Each cache sample's reference index (-1: none), found by its path, else by its file name (a file
    moved to another class folder keeps its name)."""

    ref_index: np.ndarray
    by_name: int  # samples matched by file name only


def match_samples(paths: list[str], listing: Listing) -> Matching:
    pos = {k: i for i, k in enumerate(listing.keys)}
    names: dict[str, int] = {}
    for i, k in enumerate(listing.keys):
        base = os.path.basename(k)
        names[base] = -2 if base in names else i  # -2: not unique, no match by name
    out, by_name = np.full(len(paths), -1, np.int64), 0
    for i, p in enumerate(paths):
        j = pos.get(p)
        if j is None:
            j = names.get(os.path.basename(p), -1)
            j, by_name = (j, by_name + 1) if j >= 0 else (-1, by_name)
        out[i] = j
    return Matching(out, by_name)


def order_and_labels(reader: CacheReader, listing: Listing, match: Matching) -> list[Check]:
    """The ``classes``, ``order`` and ``labels`` checks (skipped files accounted for in ``order``)."""
    m = reader.manifest
    paths, labels = reader.paths(), np.asarray(reader.labels, dtype=np.int64)
    skipped = {f.path for f in m.failures}
    ref_keys = set(listing.keys)
    expected = [k for k in listing.keys if k not in skipped]
    classes = _classes(m.classes, labels, listing, skipped)
    bad_order = [i for i, (a, b) in enumerate(zip(paths, expected, strict=False)) if a != b]
    cached = set(paths)
    missing = [k for k in expected if k not in cached]
    unknown_skips = sorted(skipped - ref_keys)
    order_ok = not bad_order and len(paths) == len(expected) and not unknown_skips
    if order_ok:
        verdict = (f"{len(paths)} samples in the reference's order; {len(skipped)} skipped files are source files "
                   f"the build listed as failures")
    elif bad_order:
        i = bad_order[0]
        verdict = (f"{len(bad_order)} samples out of place, first #{i}: cache has {paths[i]}, reference "
                   f"{expected[i]}")
    else:
        verdict = (f"{len(paths)} samples, the reference has {len(expected)} after {len(skipped)} skipped; "
                   f"{len(missing)} source files neither cached nor skipped (first: {missing[:1]}), "
                   f"{len(unknown_skips)} skipped files not in the source")
    order = Check("order", order_ok, verdict, {
        "samples": len(paths), "reference": len(listing.keys), "skipped": len(skipped),
        "out_of_place": len(bad_order), "missing": len(missing), "skipped_not_in_source": len(unknown_skips),
        "first_out_of_place": [{"index": i, "cache": paths[i], "reference": expected[i]} for i in bad_order[:5]]})
    got = match.ref_index
    found = got >= 0
    ref_labels = np.where(found, listing.labels[np.maximum(got, 0)], -1)
    wrong = np.flatnonzero(found & (ref_labels != labels))
    first = [{"index": int(i), "file": paths[i], "expected": int(ref_labels[i]), "got": int(labels[i])}
             for i in wrong[:5]]
    if len(wrong):
        f0 = first[0]
        verdict = (f"{len(wrong)} samples differ, first #{f0['index']} {f0['file']}: expected {f0['expected']}, "
                   f"got {f0['got']}")
    else:
        verdict = f"{int(found.sum())} samples labelled as {listing.how}"
    unmatched = int((~found).sum())
    if unmatched:
        verdict += f"; {unmatched} samples have no source file"
    labels_check = Check("labels", not len(wrong) and not unmatched, verdict,
                         {"compared": int(found.sum()), "differ": len(wrong), "no_source_file": unmatched,
                          "matched_by_file_name": match.by_name, "first_differences": first})
    return [classes, order, labels_check]


def _classes(cache_classes: Sequence[str], labels: np.ndarray, listing: Listing, skipped: set[str]) -> Check:
    """The class lists, then the samples of each class: the cache's labels against the reference's files less
    those the build skipped. Under ImageFolder's rules a class with no file is a tree torchvision refuses."""
    names = list(cache_classes)
    figures: dict[str, Any] = {"cache": len(names), "reference": len(listing.classes)}
    if listing.classes and names != list(listing.classes):
        pairs = enumerate(zip(names, listing.classes, strict=False))
        diff = [f"#{i} cache {a!r} vs {b!r}" for i, (a, b) in pairs if a != b]
        return Check("classes", False, f"{len(names)} in the cache, {len(listing.classes)} in the reference; first "
                     f"differences: {'; '.join(diff[:5]) or 'the lists differ in length'}", figures)
    k = max(len(names), len(listing.classes))
    kept = np.array([key not in skipped for key in listing.keys], dtype=bool)
    ref_labels = listing.labels[kept] if len(listing.labels) else listing.labels
    ref = np.bincount(ref_labels[(ref_labels >= 0) & (ref_labels < k)], minlength=k) if k else np.zeros(0, int)
    ours = np.bincount(labels[(labels >= 0) & (labels < k)], minlength=k) if k else np.zeros(0, int)
    name = (lambda c: names[c] if c < len(names) else str(c))  # noqa: E731
    differ = [{"class": name(c), "cache": int(ours[c]), "reference": int(ref[c])} for c in np.flatnonzero(ours != ref)]
    every = listing.labels[(listing.labels >= 0) & (listing.labels < k)]
    empty = [name(c) for c in np.flatnonzero(np.bincount(every, minlength=k) == 0)] if listing.folders else []
    figures.update(count_differences=differ[:20], empty_classes=empty[:20])
    if differ:
        first = "; ".join(f"{d['class']}: {d['cache']} in the cache, {d['reference']} in the reference"
                          for d in differ[:3])
        return Check("classes", False, f"{len(names)} classes as {listing.how}, but {len(differ)} hold another "
                     f"number of samples than the reference's files (less the skipped): {first}", figures)
    if empty:
        return Check("classes", False, f"{len(empty)} classes have no samples and no files: {', '.join(empty[:5])} "
                     f"(torchvision's ImageFolder refuses such a tree: 'Found no valid file for the classes "
                     f"{empty[0]}'); remove the empty folders and rebuild", figures)
    return Check("classes", True, f"{len(names)} classes as {listing.how}, each with the reference's number of "
                 f"samples", figures)


# PIL's modes of a 16-bit greyscale file (and 32-bit ones): convert("RGB") clips them at 255
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float(10 * np.log10(255.0**2 / max(mse, 1e-10)))


def letterbox(h: int, w: int, s: int) -> tuple[int, int, int, int]:
    """``--fit pad``'s box as docs/FORMAT.md defines it: aspect kept, long side S, centred (y0, x0, y1, x1)."""
    scale = s / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    y0, x0 = (s - nh) // 2, (s - nw) // 2
    return y0, x0, y0 + nh, x0 + nw


def _resize(img: Any, hw: list[int], interpolation: str) -> np.ndarray:
    """torchvision's ``resize`` to ``hw`` ([S]: the short side to S, as ``Resize(S)``)."""
    import torch
    import torchvision.transforms.v2.functional as F
    from PIL import Image
    from torchvision.transforms import InterpolationMode

    if interpolation == "linear":
        t = torch.from_numpy(np.array(img)).permute(2, 0, 1)
        out = F.resize(t, hw, InterpolationMode.BILINEAR, antialias=False)
        return out.permute(1, 2, 0).numpy()
    mode = InterpolationMode.BILINEAR
    if interpolation == "area" and min(hw) <= min(img.height, img.width) and max(hw) <= max(img.height, img.width):
        mode = InterpolationMode.BOX  # shrinking; the build's area filter enlarges bilinearly
    return np.asarray(F.resize(img if isinstance(img, Image.Image) else Image.fromarray(img), hw, mode))


def reference_pixels(source: Any, recipe: Recipe) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """The S x S x 3 reference of one source image (PIL or uint8 array) and the box of its real pixels."""
    from PIL import Image

    img = source if isinstance(source, Image.Image) else Image.fromarray(np.asarray(source))
    s, w, h = recipe.size, img.width, img.height
    if recipe.fit == "squash":
        return _resize(img, [s, s], recipe.interpolation), (0, 0, s, s)
    if recipe.fit == "pad":
        y0, x0, y1, x1 = letterbox(h, w, s)
        out = np.zeros((s, s, 3), np.uint8)
        out[y0:y1, x0:x1] = _resize(img, [y1 - y0, x1 - x0], recipe.interpolation)
        return out, (y0, x0, y1, x1)
    import torch
    import torchvision.transforms.v2.functional as F

    big = torch.from_numpy(_resize(img, [s], recipe.interpolation).copy()).permute(2, 0, 1)  # Resize(S)
    return F.center_crop(big, [s, s]).permute(1, 2, 0).numpy(), (0, 0, s, s)  # CenterCrop(S)


@dataclass
class PixelResult:
    """PSNR of each checked sample; the worst ones kept for the contact sheet."""

    indices: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    box_mismatches: list[int] = field(default_factory=list)  # pad: stored box != the letterbox
    sixteen_bit: list[tuple[int, str]] = field(default_factory=list)  # (index, PIL mode) of 16-bit source files
    worst: list[tuple[float, int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (dB, index, ours, ref)

    def summary(self) -> dict[str, Any]:
        s = np.asarray(self.scores)
        return {"checked": len(s), "median_db": float(np.median(s)) if len(s) else None,
                "min_db": float(s.min()) if len(s) else None,
                "worst": [{"index": i, "psnr_db": round(float(p), 2)}
                          for p, i in sorted(zip(self.scores, self.indices, strict=True))[:8]],
                "box_mismatches": self.box_mismatches[:20]}


def pixels(reader: CacheReader, listing: Listing, match: Matching, recipe: Recipe, *, n: int, seed: int,
           min_median: float, min_each: float, keep_worst: int = 8) -> tuple[Check, PixelResult]:
    """PSNR of ``n`` random samples (all when the cache is smaller) against the reference pixels."""
    count = reader.manifest.count
    rng = np.random.default_rng(seed)
    picks = np.arange(count) if n >= count else np.sort(rng.choice(count, n, replace=False))
    picks = picks[match.ref_index[picks] >= 0]
    res = PixelResult()
    boxes = reader.boxes
    for lo in range(0, len(picks), 64):
        idx = picks[lo : lo + 64]
        ours = reader.gather(idx)
        for k, i in enumerate(idx):
            source = listing.open(int(match.ref_index[i]))
            mode = getattr(source, "info", {}).get("source_mode")
            if mode in SIXTEEN_BIT_MODES:
                res.sixteen_bit.append((int(i), str(mode)))
            ref, box = reference_pixels(source, recipe)
            res.indices.append(int(i))
            res.scores.append(psnr(ours[k], ref))
            if boxes is not None and tuple(int(v) for v in boxes[i]) != box:
                res.box_mismatches.append(int(i))
            res.worst = sorted([*res.worst, (res.scores[-1], int(i), ours[k].copy(), ref)],
                               key=lambda t: t[0])[:keep_worst]
    s = res.summary()
    if not s["checked"]:
        return Check("pixels", False, "no sample could be matched to a source file", s), res
    ok = s["median_db"] >= min_median and s["min_db"] >= min_each and not res.box_mismatches
    worst = s["worst"][0]
    verdict = (f"{s['checked']} samples vs torchvision ({recipe.describe()}): median {s['median_db']:.1f} dB "
               f"(at least {min_median:g}), min {s['min_db']:.1f} dB at #{worst['index']} (at least {min_each:g})")
    if res.box_mismatches:
        verdict += f"; {len(res.box_mismatches)} pad boxes differ from the letterbox, first #{res.box_mismatches[0]}"
    paths = reader.paths() if res.sixteen_bit else []
    scores = dict(zip(res.indices, res.scores, strict=True))
    deep: list[dict[str, Any]] = [{"index": i, "file": paths[i], "mode": mode, "psnr_db": round(scores[i], 2)}
                                  for i, mode in res.sixteen_bit]
    if deep:
        d = min(deep, key=lambda e: e["psnr_db"])
        verdict += (f"; {len(deep)} source files are 16-bit (PIL mode {d['mode']}), e.g. #{d['index']} {d['file']} at "
                    f"{d['psnr_db']:.1f} dB: torchvision's pil_loader converts such a file to RGB by clipping every "
                    f"value above 255, so the reference is mostly white where the cache holds the image scaled to "
                    f"8 bits: the difference is how PIL reads the file, not the cache")
    s.update({"min_median_db": min_median, "min_each_db": min_each, "sixteen_bit_sources": deep[:20]})
    return Check("pixels", ok, verdict, s), res
