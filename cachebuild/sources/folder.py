"""Any class-folder tree, with torchvision ``ImageFolder``'s rules for classes, extensions and order."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.format.manifest import CACHE_SUBFOLDER
from cachebuild.sources.image_files import IMG_EXTENSIONS
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan, file_plan
from cachebuild.storage import is_url

__all__ = ["IMG_EXTENSIONS", "FolderOptions", "FolderSource", "find_classes", "folder_plan", "list_class_folder"]

log = logging.getLogger("cachebuild")


def find_classes(root: Path) -> list[str]:
    """Class folders, sorted: what ``ImageFolder.find_classes`` returns (index = position), except
    ``.cachebuild/``, the one place inside a source tree where its caches may be written."""
    if not root.is_dir():
        raise SourceError(f"{root} does not exist or is not a folder")
    with os.scandir(root) as entries:  # ImageFolder's rule, less the folder that may hold caches of this tree
        classes = sorted(e.name for e in entries if e.is_dir() and e.name != CACHE_SUBFOLDER)
    if not classes:
        raise SourceError(f"{root} has no class folders: expected one sub-folder of images per class")
    return classes


def _walk_once(top: Path) -> list[tuple[str, list[str], list[str]]]:
    """``os.walk(top, followlinks=True)`` that lists every real folder at most once.

    Symlinks are followed, as ImageFolder follows them (symlink farms that gather classes from several
    disks are a normal layout), wherever they point. What is bounded is repetition: a link back to a
    folder already listed (a loop, which ImageFolder walks until the path is too long: 6 files became
    2,706 samples) or a second link to one folder adds nothing. Children are visited in sorted order, so
    which path of a folder is kept does not depend on the listing order.
    """
    seen: set[tuple[int, int]] = set()
    out = []
    for dirpath, dirnames, fnames in os.walk(top, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            log.warning("%s: skipped, a symlink to a folder already listed (a loop or a second link)", dirpath)
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames.sort()
        out.append((dirpath, dirnames, fnames))
    return out


def list_class_folder(root: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """(relative path, label) in ``ImageFolder.make_dataset`` order: class by class, walk sorted."""
    keys: list[str] = []
    labels: list[int] = []
    for idx, cls in enumerate(classes):
        class_dir = root / cls
        if not class_dir.is_dir():
            continue
        for dirpath, _, fnames in sorted(_walk_once(class_dir)):
            prefix = os.path.join(os.path.relpath(dirpath, root), "")  # os.path.join(rel, name), by list
            found = [prefix + f for f in sorted(fnames) if f.lower().endswith(IMG_EXTENSIONS)]
            keys += found
            labels += [idx] * len(found)
    return keys, np.asarray(labels, dtype=np.int64)


def folder_plan(root: str | os.PathLike[str], *, dataset: str = "folder", split: str = "train",
                classes: list[str] | None = None) -> Plan:
    """Plan a class-folder tree, local or at a URL. ``classes`` pins the class list (e.g. a val split labelled
    like train)."""
    if is_url(os.fspath(root)):
        from cachebuild.sources.url_folder import url_folder_plan

        return url_folder_plan(os.fspath(root), dataset=dataset, split=split, classes=classes)
    root = Path(root)
    found = find_classes(root)
    if classes is None:
        classes = found
    else:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise SourceError(
                f"{root} has class folders {unknown[:5]} that are not among the {len(classes)} classes "
                f"of the other split; the splits must share one class list"
            )
    keys, labels = list_class_folder(root, classes)
    if not keys:
        raise SourceError(
            f"{root} has class folders but no image files with extensions {', '.join(IMG_EXTENSIONS)}"
        )
    return file_plan(dataset, split, root, keys, labels, classes)


@dataclass(frozen=True)
class FolderOptions(SourceOptions):
    split: str = option("train", "Name of the split this tree is.")
    dataset: str | None = option(None, "Dataset name (default: the folder's name).", flag="--name")


class FolderSource(SourceKind):
    name = "folder"
    options = FolderOptions
    help = ("Any class-folder tree at SRC, a path or a URL (s3://bucket/images, https://...): ImageFolder's "
            "rules, one sub-folder per class.")
    size_at = 0
    pins_classes = True

    def plan(self, src: str, options: FolderOptions, *, classes: list[str] | None = None,
             jobs: int = 1) -> list[Plan]:
        last = src.rstrip("/").rsplit("/", 1)[-1] if is_url(src) else Path(src).resolve().name
        dataset = options.dataset or last or "folder"
        return [folder_plan(src, dataset=dataset, split=options.split, classes=classes)]
