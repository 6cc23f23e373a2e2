"""Any class-folder tree, local or at a URL (``s3://bucket/images``, ``https://host/images/``), with torchvision
``ImageFolder``'s rules for classes, extensions and order.

A root whose folders are all split names (``train/``, ``val/``...: the layout PyTorch's ``imagenet/main.py`` reads),
each holding class folders, is a dataset of splits, not a tree of two classes: each split is planned as its own
tree, all numbered by train's classes (a val missing a class folder must not renumber the classes after it).
A class folder without an image file is refused, as ``ImageFolder`` refuses it, unless ``--allow-empty``.

A tree at a URL is listed once and each file read whole in the workers, both through the storage layer's
locations (their socket timeout, retries and S3 session); index pages' percent-encoded names are decoded, so
classes, order and keys are those of the local copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.format.manifest import CACHE_SUBFOLDER
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan, file_plan
from cachebuild.storage import is_url, redact
from cachebuild.storage.locations import is_web_url

if TYPE_CHECKING:
    from cachebuild.storage import FsspecLocation

__all__ = ["IMG_EXTENSIONS", "SPLIT_FOLDERS", "FolderOptions", "FolderSource", "UrlFileReader", "find_classes",
           "folder_plan", "list_class_folder", "split_layout"]

log = logging.getLogger("cachebuild")

# torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively as ImageFolder does.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Folder names that make a root a dataset of splits (torchvision's, Kaggle's and Hugging Face's usual ones),
# in the order their caches are built; the first one present numbers the classes of all.
SPLIT_FOLDERS = ("train", "val", "valid", "validation", "test")


def find_classes(root: Path) -> list[str]:
    """Class folders, sorted: what ``ImageFolder.find_classes`` returns (index = position), except
    ``.cachebuild/``, the one place inside a source tree where its caches may be written."""
    if not root.is_dir():
        raise SourceError(f"{root} does not exist or is not a folder")
    with os.scandir(root) as entries:
        classes = sorted(e.name for e in entries if e.is_dir() and e.name != CACHE_SUBFOLDER)
    return _classes(classes, None, str(root))


def _classes(found: list[str], pinned: list[str] | None, where: str) -> list[str]:
    """The class list: ``found`` (sorted), or ``pinned`` (the other split's) when every found class is in it."""
    if not found:
        raise SourceError(f"{where} has no class folders: expected one sub-folder of images per class")
    unknown = sorted(set(found) - set(pinned or found))
    if unknown:
        raise SourceError(f"{where} has class folders {unknown[:5]} that are not among the {len(pinned or ())} "
                          f"classes of the other split; the splits must share one class list")
    return pinned or found


def _no_images(where: str) -> SourceError:
    return SourceError(f"{where} has class folders but no image files with extensions {', '.join(IMG_EXTENSIONS)}")


def _check_empty(labels: np.ndarray, classes: list[str], present: set[str], where: str, allow_empty: bool) -> None:
    """Refuse class folders (among ``present``) that gave no image file: ``ImageFolder`` raises "Found no valid
    file for the classes ..." there, and a class with no sample is a trap (0 of it in every batch, a parity
    check that compares class lists calls it equal). Classes pinned from another split and absent here pass."""
    counts = np.bincount(labels, minlength=len(classes))
    empty = [c for c, n in zip(classes, counts.tolist(), strict=True) if n == 0 and c in present]
    if empty and not allow_empty:
        shown = ", ".join(f"{where}/{c}" for c in empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5
                                                                 else "")
        raise SourceError(f"{shown}: class folder(s) with no image files ({', '.join(IMG_EXTENSIONS)}), which "
                          f"torchvision's ImageFolder refuses: add their images or remove the folders, or pass "
                          f"--allow-empty (cachebuild folder) to keep them as classes without samples")


def split_layout(tops: dict[str, bool], where: str) -> list[str]:
    """The split folders of a root whose top folders are ``tops`` (name -> whether it holds sub-folders), in
    :data:`SPLIT_FOLDERS` order; [] for a tree of class folders. Split folders beside other folders (or a split
    folder that holds images but no class folders, beside one that does) are refused: neither reading is
    safe to guess."""
    visible = {name: sub for name, sub in tops.items() if not name.startswith(".")}
    splits = [s for s in SPLIT_FOLDERS if visible.get(s)]
    if not splits:
        return []
    others = sorted(set(visible) - set(splits))
    if others:
        flat = [o for o in others if o in SPLIT_FOLDERS]
        why = (f"{', '.join(flat)} has no class folders (a flat split: `cachebuild imagenet` labels ImageNet's "
               f"from its devkit)" if flat else f"it also holds {', '.join(others[:5])}")
        raise SourceError(f"{where} holds the split folders {', '.join(splits)}, but {why}: pass one split folder "
                          f"as SRC ({where}/{splits[0]}), or keep only split folders in {where}")
    return splits


def _walk_once(top: Path) -> list[tuple[str, list[str], list[str]]]:
    """``os.walk(top, followlinks=True)`` that lists every real folder at most once.

    Symlinks are followed, as ImageFolder follows them (symlink farms that gather classes from several disks
    are a normal layout), wherever they point. What is bounded is repetition: a link back to a folder already
    listed (a loop, which ImageFolder walks until the path is too long) or a second link to one folder adds
    nothing. Children are visited in sorted order, so which path of a folder is kept does not depend on the
    listing order.
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
            prefix = os.path.join(os.path.relpath(dirpath, root), "")
            found = [prefix + f for f in sorted(fnames) if f.lower().endswith(IMG_EXTENSIONS)]
            keys += found
            labels += [idx] * len(found)
    return keys, np.asarray(labels, dtype=np.int64)


def folder_plan(root: str | os.PathLike[str], *, dataset: str = "folder", split: str = "train",
                classes: list[str] | None = None, allow_empty: bool = False) -> Plan:
    """Plan a class-folder tree, local or at a URL. ``classes`` pins the class list (e.g. a val split labelled
    like train); ``allow_empty`` keeps class folders without images as classes without samples."""
    if is_url(os.fspath(root)):
        url = os.fspath(root).rstrip("/")
        return _url_plan(url, dataset, split, classes, allow_empty, _listing(url))
    root = Path(root)
    found = find_classes(root)
    classes = _classes(found, classes, str(root))
    keys, labels = list_class_folder(root, classes)
    if not keys:
        raise _no_images(str(root))
    _check_empty(labels, classes, set(found), str(root), allow_empty)
    return file_plan(dataset, split, root, keys, labels, classes)


def _local_tops(root: Path) -> dict[str, bool]:
    """Folder name -> whether it holds a folder, for the folders directly under ``root``."""
    if not root.is_dir():
        raise SourceError(f"{root} does not exist or is not a folder")
    tops = {}
    with os.scandir(root) as entries:
        for e in entries:
            if e.is_dir() and e.name != CACHE_SUBFOLDER:
                try:
                    with os.scandir(e.path) as inner:
                        tops[e.name] = any(i.is_dir() for i in inner)
                except OSError:
                    tops[e.name] = False
    return tops


def _url_tops(files: dict[str, Any]) -> dict[str, bool]:
    tops: dict[str, bool] = {}
    for rel in files:
        parts = rel.split("/")
        if len(parts) > 1 and parts[0] != CACHE_SUBFOLDER:
            tops[parts[0]] = tops.get(parts[0], False) or len(parts) > 2
    return tops


@dataclass(frozen=True)
class UrlFileReader:
    """Reads ``<root>/<key>`` whole (retries and one-line errors from the storage location)."""

    root: str
    _location: list[FsspecLocation] = field(default_factory=list, compare=False, repr=False)

    def __call__(self, index: int, key: str) -> bytes:
        if not self._location:  # the fsspec side is imported where a URL is read, not by a local build
            from cachebuild.storage import FsspecLocation

            self._location.append(FsspecLocation(self.root))
        # Keys are file names (decoded, as on disk); an http(s) path needs them percent-encoded again ('#', '%').
        return self._location[0].read_bytes(urllib.parse.quote(key) if is_web_url(self.root) else key)


def _listing(url: str) -> dict[str, Any]:
    """Relative file name -> its listing (a ``FileInfo``: size, version)."""
    from cachebuild.storage.locations.url_files import UrlFiles

    files = UrlFiles(url)
    name_of = urllib.parse.unquote if is_web_url(url) else str
    try:
        prefix = name_of(files.path_of(url).rstrip("/"))
        listed = {}
        for f in files.find(files.path_of(url).rstrip("/")):  # retried as the storage layer retries
            rel = name_of(f.path)[len(prefix):].lstrip("/")
            if rel and not f.is_dir:
                listed[rel] = f
        unsized = [r for r, f in listed.items() if f.size is None]  # HTTP index pages give no sizes
        listed.update(zip(unsized, files.infos([listed[r].url for r in unsized]), strict=True))
    except Exception as e:  # OSError, and aiohttp's ClientResponseError (403...), which is not one
        raise SourceError(f"{redact(url)} cannot be listed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return listed


def _url_plan(root: str, dataset: str, split: str, pinned: list[str] | None, allow_empty: bool,
              files: dict[str, Any]) -> Plan:
    """The plan of the tree at ``root`` whose listing is ``files`` (names relative to ``root``)."""
    tops = {rel.split("/", 1)[0] for rel in files if "/" in rel} - {CACHE_SUBFOLDER}
    classes = _classes(sorted(tops), pinned, redact(root))
    index = {c: i for i, c in enumerate(classes)}
    # ImageFolder's order: class by class, then a sorted walk (folder by folder, files sorted in each).
    keys = sorted((rel for rel in files if rel.split("/", 1)[0] in tops and "/" in rel
                   and rel.lower().endswith(IMG_EXTENSIONS)),
                  key=lambda r: (index[r.split("/", 1)[0]], posixpath.dirname(r), posixpath.basename(r)))
    if not keys:
        raise _no_images(redact(root))
    labels = np.asarray([index[k.split("/", 1)[0]] for k in keys], dtype=np.int64)
    _check_empty(labels, classes, tops, redact(root), allow_empty)
    h = hashlib.sha256(json.dumps({"classes": classes}, sort_keys=True).encode())
    for key, label in zip(keys, labels.tolist(), strict=True):
        f = files[key]
        h.update(f"{key}\0{label}\0{f.size}:{f.version}\n".encode("utf-8", "surrogateescape"))
    return Plan(dataset=dataset, split=split, root=root, keys=keys, labels=labels, classes=classes,
                source_digest=h.hexdigest(), reader=UrlFileReader(root))


@dataclass(frozen=True)
class FolderOptions(SourceOptions):
    split: str | None = option(None, "In a root of split folders (train/, val/...: each holding class folders), "
                               "the one to build (default: each); in a tree of class folders, the name of its "
                               "split (default: train).")
    dataset: str | None = option(None, "Dataset name (default: the folder's name).", flag="--name")
    allow_empty: bool = option(False, "Keep class folders without image files as classes without samples "
                               "(ImageFolder's allow_empty); by default they are refused, naming them.")


class FolderSource(SourceKind):
    name = "folder"
    options = FolderOptions
    help = ("Any class-folder tree at SRC, a path or a URL (s3://bucket/images, https://...): ImageFolder's "
            "rules, one sub-folder per class.")
    size_at = 0
    pins_classes = True

    def plan(self, src: str, options: FolderOptions, *, classes: list[str] | None = None,
             jobs: int = 1) -> list[Plan]:
        url = is_url(src)
        root = src.rstrip("/") if url else src
        last = root.rsplit("/", 1)[-1] if url else Path(src).resolve().name
        dataset = options.dataset or last or "folder"
        files = _listing(root) if url else {}
        where = redact(root) if url else str(Path(root))
        splits = split_layout(_url_tops(files) if url else _local_tops(Path(root)), where)
        if not splits:  # a tree of class folders
            if url:
                return [_url_plan(root, dataset, options.split or "train", classes, options.allow_empty, files)]
            return [folder_plan(root, dataset=dataset, split=options.split or "train", classes=classes,
                                allow_empty=options.allow_empty)]
        if options.split is not None and options.split not in splits:
            raise SourceError(f"{where} holds the split folders {', '.join(splits)}: --split {options.split} names "
                              f"none of them")
        if classes is None:  # every split numbered by the first one's classes (train's, when there is one)
            first = splits[0]
            classes = (sorted(_url_tops({r[len(first) + 1:]: f for r, f in files.items()
                                         if r.startswith(first + "/")}))
                       if url else find_classes(Path(root) / first))
        plans = []
        for split in splits if options.split is None else [options.split]:
            if url:
                prefix = split + "/"
                part = {r[len(prefix):]: f for r, f in files.items() if r.startswith(prefix)}
                plans.append(_url_plan(f"{root}/{split}", dataset, split, classes, options.allow_empty, part))
            else:
                plans.append(folder_plan(Path(root) / split, dataset=dataset, split=split, classes=classes,
                                         allow_empty=options.allow_empty))
        return plans
