"""An ImageNet-*shaped* tree in the real ILSVRC2012 layout, made of small real-photo crops.

``full_tree(root)`` writes, once (reused by later runs):

* ``train/<wnid>/<wnid>_<id>.JPEG``: 1,000 class folders, per-class counts in 732..1300 summing to
  1,281,167 (most at 1,300, like the real set; any spread with the right total);
* ``val/ILSVRC2012_val_<n>.JPEG``: 50,000 flat, labelled by ``ILSVRC2012_devkit_t12/data/meta.mat`` and
  ``ILSVRC2012_validation_ground_truth.txt`` (the devkit layout ``cachebuild imagenet`` reads).

Each file is a distinct 40-80 px crop (random position, scale, aspect, flip, colour jitter) of the
photographs shipped in wheels (``cachebuild.samples.photos``), a few hundred bytes to a few KB, so decoding
is cheap and the *per-file* costs dominate. Classes are written in parallel, each into a staging folder
renamed into place, so a killed run resumes class by class.

``subset_tree(full, n)`` is a nested subset of ``n`` train files: the same 1,000 folders, each holding the
first files of its full folder in proportion (hard links: no pixels are copied).

    python -m bench.scale.tree /work/scale-data --n 10000,100000   # full tree + the subsets
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

__all__ = ["FULL_TRAIN", "N_CLASSES", "N_VAL", "class_counts", "full_tree", "read_all", "subset_counts",
           "subset_tree", "wnid_list"]

FULL_TRAIN = 1_281_167
N_CLASSES = 1000
N_VAL = 50_000
MIN_PER_CLASS, MAX_PER_CLASS = 732, 1300
SIDE = (40, 80)
VERSION = 1  # bump when the files change: a tree of another version is rewritten
_MARK = "scale-tree.json"
_bank: list[tuple[str, np.ndarray]] = []


def wnid_list(n_classes: int = N_CLASSES) -> list[str]:
    """Sorted ``nXXXXXXXX`` ids, the real set's first one first (the real list is not needed)."""
    return [f"n{1440764 + 2711 * k:08d}" for k in range(n_classes)]


def class_counts(total: int = FULL_TRAIN, n_classes: int = N_CLASSES, seed: int = 0) -> np.ndarray:
    """Per-class train counts in [732, 1300] summing to ``total``: most classes full, a few short (one at the
    minimum), as in ILSVRC2012."""
    if not n_classes * MIN_PER_CLASS <= total <= n_classes * MAX_PER_CLASS:
        raise ValueError(f"{total} files cannot be split into {n_classes} classes of {MIN_PER_CLASS}..{MAX_PER_CLASS}")
    rng = np.random.default_rng(seed)
    counts = np.full(n_classes, MAX_PER_CLASS, dtype=np.int64)
    short = int(counts.sum() - total)
    first = int(rng.integers(n_classes))
    take = min(short, MAX_PER_CLASS - MIN_PER_CLASS)
    counts[first] -= take
    short -= take
    while short:
        k = int(rng.integers(n_classes))
        room = int(counts[k] - MIN_PER_CLASS)
        if room:
            d = min(short, int(rng.integers(1, room + 1)))
            counts[k] -= d
            short -= d
    return counts


def subset_counts(n: int, counts: np.ndarray) -> np.ndarray:
    """``counts`` scaled to sum to ``n`` (largest remainders), every class keeping at least one file."""
    if not len(counts) <= n <= int(counts.sum()):
        raise ValueError(f"a subset needs {len(counts)}..{int(counts.sum())} files, got {n}")
    exact = counts * (n / counts.sum())
    out = np.maximum(np.floor(exact).astype(np.int64), 1)
    rest = n - int(out.sum())
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    if rest > 0:
        out[order[:rest]] += 1
    else:  # the floor of 1 took a few too many: give them back from the largest classes
        for k in np.argsort(-out, kind="stable")[:-rest]:
            out[k] -= 1
    return out


def _init() -> None:
    from cachebuild.samples.photos import photo_bank

    cv2.setNumThreads(1)  # one process per core already
    _bank[:] = photo_bank()


def _jpeg(k: int, rng: np.random.Generator) -> bytes:
    """A random crop of class ``k``'s region of a photograph (``class_region``), 40-80 px a side, flipped half
    the time, with a random brightness and JPEG quality. Cheaper than ``render_sample`` (no float colour
    jitter): 1.3M of them must take minutes."""
    from cachebuild.samples.photos import class_region

    photo, (rx, ry, rw, rh) = class_region(k, _bank)
    w, h = (int(v) for v in rng.integers(SIDE[0], SIDE[1] + 1, size=2))
    frac = float(rng.uniform(0.3, 1.0))
    cw = max(8, min(rw, int(rw * frac)))
    ch = max(8, min(rh, int(cw * h / w)))
    x, y = rx + int(rng.integers(0, rw - cw + 1)), ry + int(rng.integers(0, rh - ch + 1))
    img = cv2.resize(_bank[photo][1][y:y + ch, x:x + cw], (w, h), interpolation=cv2.INTER_LINEAR)
    img = cv2.convertScaleAbs(img, alpha=float(rng.uniform(0.85, 1.15)), beta=float(rng.uniform(-12, 12)))
    img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    if rng.random() < 0.5:
        img = cv2.flip(img, 1)
    ok, buf = cv2.imencode(".jpg", img,
                           [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(80, 96))])
    assert ok
    return buf.tobytes()


def _write_class(args: tuple[Path, int, str, int, int]) -> int:
    """One class folder: written in ``<root>/.staging/`` and renamed into ``train/``."""
    root, k, wnid, count, seed = args
    final = root / "train" / wnid
    if final.is_dir():
        return 0
    rng = np.random.default_rng([seed, k])
    ids = np.sort(rng.choice(20_000, size=count, replace=False)) + 1
    tmp = root / ".staging" / wnid
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i in ids.tolist():
        (tmp / f"{wnid}_{i}.JPEG").write_bytes(_jpeg(k, rng))
    tmp.rename(final)
    return count


def _write_val_chunk(args: tuple[Path, int, list[int], int]) -> int:
    """Val images ``start+1 ..`` of the given labels, flat in ``val/``."""
    root, start, labels, seed = args
    rng = np.random.default_rng([seed, 10_000 + start])
    for j, k in enumerate(labels):
        path = root / "val" / f"ILSVRC2012_val_{start + j + 1:08d}.JPEG"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(_jpeg(k, rng))
        tmp.rename(path)  # a killed run leaves no half file under an image name
    return len(labels)


def _write_devkit(root: Path, wnids: list[str], counts: np.ndarray, val_labels: np.ndarray, seed: int) -> None:
    from cachebuild.samples.imagenet_layout import _write_meta_mat  # the tests' devkit writer

    rng = np.random.default_rng([seed, 1])
    ids = (rng.permutation(len(wnids)) + 1).tolist()  # real ILSVRC2012_IDs are not in wnid order
    data = root / "ILSVRC2012_devkit_t12" / "data"
    data.mkdir(parents=True, exist_ok=True)
    _write_meta_mat(data / "meta.mat", wnids, [f"class {k}" for k in range(len(wnids))], ids, counts.tolist())
    gt = "".join(f"{ids[k]}\n" for k in val_labels.tolist())
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text(gt, encoding="ascii")


def full_tree(root: Path, *, total: int = FULL_TRAIN, n_val: int = N_VAL, n_classes: int = N_CLASSES,
              seed: int = 0, jobs: int | None = None, log: Any = print) -> Path:
    """Write (or find, complete) the tree at ``root``; returns ``root``. ``total``/``n_val``/``n_classes``
    smaller than the real set's make a small tree of the same shape (the tests)."""
    root = Path(root)
    mark = root / _MARK
    want = {"version": VERSION, "train": total, "val": n_val, "classes": n_classes, "seed": seed}
    if mark.is_file() and json.loads(mark.read_text()) == want:
        return root
    if root.exists() and any(root.iterdir()) and not (root / ".staging").is_dir() and not mark.exists():
        raise FileExistsError(f"{root} holds files this generator did not write: name an empty or new folder")
    if mark.exists():  # another version or shape: rewrite it all
        shutil.rmtree(root)
    (root / ".staging").mkdir(parents=True, exist_ok=True)
    (root / "train").mkdir(exist_ok=True)
    (root / "val").mkdir(exist_ok=True)
    counts = class_counts(total, n_classes, seed) if n_classes == N_CLASSES and total == FULL_TRAIN else \
        subset_counts(total, np.full(n_classes, max(1, -(-total // n_classes)), dtype=np.int64))
    wnids = wnid_list(n_classes)
    val_labels = np.random.default_rng([seed, 2]).permutation(np.resize(np.arange(n_classes), n_val))
    t0, done = time.perf_counter(), 0
    ctx = mp.get_context("fork")  # the photo bank is loaded once, before the fork
    _init()
    with ctx.Pool(jobs or os.cpu_count() or 1) as pool:
        tasks: list[Any] = [(root, k, w, int(c), seed) for k, (w, c) in enumerate(zip(wnids, counts, strict=True))]
        for n in pool.imap_unordered(_write_class, tasks):
            done += n
            if done and done % 100_000 < n:
                log(f"  train: {done:,} files, {done / (time.perf_counter() - t0):,.0f}/s")
        chunks = [(root, s, val_labels[s:s + 1000].tolist(), seed) for s in range(0, n_val, 1000)
                  if not (root / "val" / f"ILSVRC2012_val_{min(s + 1000, n_val):08d}.JPEG").exists()]
        for n in pool.imap_unordered(_write_val_chunk, chunks):
            done += n
    _write_devkit(root, wnids, counts, val_labels, seed)
    shutil.rmtree(root / ".staging")
    mark.write_text(json.dumps(want))
    log(f"  {root}: {total:,} train + {n_val:,} val files in {time.perf_counter() - t0:.0f} s")
    return root


def subset_tree(full: Path, n: int, dest: Path) -> Path:
    """A train-only tree of ``n`` files: every class folder of ``full`` with its first files in proportion
    (sorted names), hard-linked. Made once; returns ``dest``."""
    mark = dest / _MARK
    source_mark = json.loads((full / _MARK).read_text())
    want = {**source_mark, "subset_of": str(full), "train": n, "val": 0}
    if mark.is_file() and json.loads(mark.read_text()) == want:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    classes = sorted(os.listdir(full / "train"))
    counts = np.array([len(os.listdir(full / "train" / c)) for c in classes])
    for c, k in zip(classes, subset_counts(n, counts).tolist(), strict=True):
        (dest / "train" / c).mkdir(parents=True)
        for name in sorted(os.listdir(full / "train" / c))[:k]:
            os.link(full / "train" / c / name, dest / "train" / c / name)
    mark.write_text(json.dumps(want))
    return dest


def _read_folder(folder: str) -> tuple[int, int]:
    files = nbytes = 0
    with os.scandir(folder) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                with open(e.path, "rb") as f:
                    nbytes += len(f.read())
                files += 1
    return files, nbytes


def read_all(root: Path, threads: int = 16) -> dict[str, float]:
    """Read every file under ``root/train`` and ``root/val`` once, so the builds after it all start from the
    same page-cache state (a first build reading a cold tree measures the disk, and the builds after it
    would not): the time this takes is the cold read of the tree, reported on its own."""
    from concurrent.futures import ThreadPoolExecutor

    folders = [str(root / "val")] if (root / "val").is_dir() else []
    folders += [str(root / "train" / c) for c in sorted(os.listdir(root / "train"))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(_read_folder, folders))
    return {"seconds": time.perf_counter() - t0, "files": sum(f for f, _ in done),
            "bytes": sum(b for _, b in done)}


def trees(work: Path, ns: list[int], log: Any = print) -> dict[int, Path]:
    """{n: train-source root} for each ``n``: the full tree for its count, nested subsets below it."""
    full = full_tree(work / "imagenet-full", log=log)
    return {n: full if n == FULL_TRAIN else subset_tree(full, n, work / f"imagenet-{n}") for n in ns}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale.tree", description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path, help="work folder (outside the repository), e.g. /work/scale-data")
    ap.add_argument("--n", default="", help="subset sizes to make as well, e.g. 10000,100000")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.n.split(",") if x]
    for n, path in trees(args.work, ns).items():
        print(f"{n:>9,}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
