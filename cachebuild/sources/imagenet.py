"""ILSVRC2012 in its real layouts: class-folder train/; val/ in class folders or flat, labelled by the
devkit ground truth or by Kaggle's ``LOC_val_solution.csv``. Class index = position of the wnid in sorted
order, as torchvision's ``ImageFolder`` gives it."""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.folder import IMG_EXTENSIONS, find_classes, folder_plan
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan, file_plan

__all__ = ["SPLITS", "ImagenetOptions", "ImagenetSource", "imagenet_plans"]

log = logging.getLogger("cachebuild")

SPLITS = ("train", "val")
DEVKIT = "ILSVRC2012_devkit_t12"
KAGGLE_TREE = Path("ILSVRC") / "Data" / "CLS-LOC"
_VAL_NUMBER = re.compile(r"ILSVRC2012_val_(\d+)")
_WNID = re.compile(r"n\d{8}")


def _locate(src: Path) -> tuple[Path, Path, list[str]]:
    """(folder holding the split folders, folder holding label files, splits present)."""
    if not src.exists():
        raise SourceError(f"{src} does not exist")
    if not src.is_dir():
        raise SourceError(f"{src} is not a folder: pass the ImageNet root (holding train/ and val/) or one split")
    if (src / KAGGLE_TREE).is_dir():
        data = src / KAGGLE_TREE
        return data, src, [s for s in SPLITS if (data / s).is_dir()]
    present = [s for s in SPLITS if (src / s).is_dir()]
    if present:  # the root, or Kaggle's ILSVRC/Data/CLS-LOC/ named directly (its labels 3 levels up)
        return src, _label_root(src), present
    if src.name in SPLITS:  # one split folder given: labels live beside it (or 3 levels up on Kaggle)
        return src.parent, _label_root(src.parent), [src.name]
    raise SourceError(f"{src} is not an ImageNet layout: expected train/ and/or val/ inside it (or "
                      f"ILSVRC/Data/CLS-LOC/ for the Kaggle download); for any other class-folder tree use "
                      f"`cachebuild folder`")


def _label_root(folder: Path) -> Path:
    """The folder holding the val labels (devkit or Kaggle's CSV): ``folder`` or one of its 3 parents
    (Kaggle's ILSVRC/Data/CLS-LOC/), else ``folder``."""
    for up in (folder, *folder.parents[:3]):
        if (up / DEVKIT).exists() or (up / f"{DEVKIT}.tar.gz").exists() or (up / "LOC_val_solution.csv").exists():
            return up
    return folder


def _devkit_labels(meta_root: Path) -> tuple[list[str], dict[int, str], list[int], dict[str, str]]:
    """(leaf wnids, ILSVRC2012_ID -> wnid, ground-truth IDs by val number, wnid -> words) from the devkit."""
    folder = meta_root / DEVKIT / "data"
    archive = meta_root / f"{DEVKIT}.tar.gz"
    if folder.is_dir():
        meta_bytes = (folder / "meta.mat").read_bytes()
        gt_text = (folder / "ILSVRC2012_validation_ground_truth.txt").read_text()
    elif archive.is_file():
        with tarfile.open(archive, "r:gz") as tar:  # read members in memory; nothing is extracted
            def member(name: str) -> bytes:
                f = tar.extractfile(f"{DEVKIT}/data/{name}")
                if f is None:
                    raise SourceError(f"{archive} has no regular file {DEVKIT}/data/{name}")
                return f.read()
            meta_bytes = member("meta.mat")
            gt_text = member("ILSVRC2012_validation_ground_truth.txt").decode()
    else:
        raise FileNotFoundError(folder)
    try:
        import scipy.io
    except ImportError:
        raise SourceError(f"{meta_root / DEVKIT}: the devkit's meta.mat is read with scipy, which labels a flat "
                          f"val/: pip install 'cachebuild[scipy]'") from None
    meta = scipy.io.loadmat(io.BytesIO(meta_bytes), squeeze_me=True)["synsets"]
    id_to_wnid: dict[int, str] = {}
    words: dict[str, str] = {}
    for row in meta:
        if int(row["num_children"]) == 0:  # the 1000 leaf classes; the rest are WordNet ancestors
            id_to_wnid[int(row["ILSVRC2012_ID"])] = str(row["WNID"])
            words[str(row["WNID"])] = str(row["words"])
    gt = [int(line) for line in gt_text.split()]
    return sorted(id_to_wnid.values()), id_to_wnid, gt, words


def _kaggle_labels(meta_root: Path) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(sorted wnids, image id -> wnid, wnid -> words) from LOC_synset_mapping.txt / LOC_val_solution.csv."""
    words = {}
    mapping = meta_root / "LOC_synset_mapping.txt"
    if mapping.is_file():
        for line in mapping.read_text().splitlines():
            if line.strip():
                wnid, _, text = line.partition(" ")
                words[wnid] = text.strip()
    labels = {}
    with open(meta_root / "LOC_val_solution.csv", newline="") as f:
        for row in csv.DictReader(f):
            labels[row["ImageId"]] = row["PredictionString"].split()[0]
    wnids = sorted(words) if words else sorted(set(labels.values()))
    return wnids, labels, words


def _flat_images(folder: Path) -> tuple[list[str], list[str]]:
    """(image file names directly in ``folder``, its sub-folders), both sorted."""
    with os.scandir(folder) as entries:
        listed = [(e.name, e.is_dir()) for e in entries]
    return (sorted(n for n, d in listed if not d and n.lower().endswith(IMG_EXTENSIONS)),
            sorted(n for n, d in listed if d))


def _flat_val_plan(val_dir: Path, meta_root: Path, train_classes: list[str] | None) -> Plan:
    files, folders = _flat_images(val_dir)
    if not files:
        raise SourceError(f"{val_dir} holds no image files")
    # Images and wnid folders side by side: a valprep.sh that stopped half-way; either reading drops samples.
    wnid_folders = [d for d in folders if _WNID.fullmatch(d)]
    if wnid_folders:
        raise SourceError(
            f"{val_dir} holds both {len(files)} images and class folders ({', '.join(wnid_folders[:3])}, ...): "
            f"finish sorting them into class folders (valprep.sh) or move them all back flat")
    if folders:  # __MACOSX/, .ipynb_checkpoints/: not classes of a flat val
        log.warning("%s: flat val (labelled by its ground truth); sub-folders %s ignored", val_dir, folders[:5])
    words: dict[str, str] = {}
    if (meta_root / "LOC_val_solution.csv").is_file():
        classes, by_id, words = _kaggle_labels(meta_root)
        label_source = str(meta_root / "LOC_val_solution.csv")
        try:
            wnids = [by_id[Path(f).stem] for f in files]
        except KeyError as e:
            raise SourceError(f"{label_source} has no row for val image {e.args[0]}") from None
    else:
        try:
            classes, id_to_wnid, gt, words = _devkit_labels(meta_root)
        except FileNotFoundError:
            raise SourceError(f"{val_dir} is flat (no class folders) and no labels were found: expected {DEVKIT}/ (or "
                              f"{DEVKIT}.tar.gz) with data/meta.mat and data/ILSVRC2012_validation_ground_truth.txt, "
                              f"or Kaggle's LOC_val_solution.csv, in {meta_root}") from None
        label_source = str(meta_root / DEVKIT)
        wnids = []
        for f in files:
            m = _VAL_NUMBER.search(f)
            if m is None or not 1 <= int(m.group(1)) <= len(gt):
                raise SourceError(f"{val_dir / f}: name has no ILSVRC2012_val number within the devkit's {len(gt)}")
            wnids.append(id_to_wnid[gt[int(m.group(1)) - 1]])
    if train_classes is not None:
        missing = sorted(set(wnids) - set(train_classes))
        if missing:
            raise SourceError(f"val labels from {label_source} name wnids absent from train/: {missing[:5]}")
        classes = train_classes
    index = {w: i for i, w in enumerate(classes)}
    labels = np.asarray([index[w] for w in wnids], dtype=np.int64)
    keys = [f"val/{f}" for f in files]
    extra = {"class_descriptions": [words.get(c, "") for c in classes]} if words else None
    return file_plan("imagenet", "val", val_dir.parent, keys, labels, classes, extra)


def imagenet_plans(src: str | os.PathLike[str], split: str = "all") -> list[Plan]:
    """One plan per requested split found under ``src`` (the root, the Kaggle root, or one split folder)."""
    if split not in (*SPLITS, "all"):
        raise SourceError(f"unknown split {split!r}: expected train, val or all")
    data, meta_root, present = _locate(Path(src))
    wanted = present if split == "all" else [split]
    if split != "all" and split not in present:
        raise SourceError(f"{data} has no {split}/ folder (found: {', '.join(present) or 'none'})")
    # val is labelled by train's classes, also when only the val folder was named (its train/ beside it):
    # a val missing a class folder must not renumber the classes after it.
    train_classes = find_classes(data / "train") if (data / "train").is_dir() else None
    plans = []
    for s in wanted:
        folder = data / s
        images, folders = _flat_images(folder)
        if s == "val" and images:  # flat, labelled by the devkit or Kaggle's CSV (stray sub-folders aside)
            plan = _flat_val_plan(folder, meta_root, train_classes)
        elif folders:
            plan = folder_plan(folder, dataset="imagenet", split=s, classes=train_classes)
        else:
            raise SourceError(f"{folder} has no class folders (expected {folder}/nXXXXXXXX/*.JPEG)")
        plans.append(plan)
    return plans


@dataclass(frozen=True)
class ImagenetOptions(SourceOptions):
    split: str = option("all", None, choices=(*SPLITS, "all"))


class ImagenetSource(SourceKind):
    name = "imagenet"
    options = ImagenetOptions
    help = "ILSVRC2012 at SRC: the root (train/, val/), the Kaggle root, or one split folder."
    url_src = False
    size_help = "Output side S (samples are S x S x 3)."

    def plan(self, src: str, options: ImagenetOptions, *, classes: list[str] | None = None,
             jobs: int = 1) -> list[Plan]:
        return imagenet_plans(src, options.split)
