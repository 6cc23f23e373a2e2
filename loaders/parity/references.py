"""The references: what torchvision (or the source kind's own labels) says sample ``i`` is.

Each listing is made without cachebuild's sources: torchvision's ``ImageFolder`` rules for class-folder
trees, torchvision's own devkit parsers (or Kaggle's CSV) for a flat ImageNet val, a restricted reader of
CIFAR's python batches, pyarrow for a Parquet label column. ``open(i)`` gives the source image as PIL
(or, for CIFAR, the array), for :mod:`loaders.parity.checks` to transform as torchvision would.
"""

from __future__ import annotations

import csv
import io
import os
import pickle
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from loaders.parity.recipe import ParityInputError, Recipe, source_folder

__all__ = ["Listing", "reference_listing"]

_DEVKIT = "ILSVRC2012_devkit_t12"
_CACHE_SUBFOLDER = ".cachebuild"  # the one folder of a tree cachebuild documents as not a class (docs/sources.md)


@dataclass
class Listing:
    """The reference's samples, in its order: keys as the cache's ``paths.json`` names them."""

    how: str  # which reference, in words
    classes: list[str]
    keys: list[str]
    labels: np.ndarray
    open: Callable[[int], Any]  # index -> PIL.Image (RGB; info["source_mode"]: the file's mode) or uint8 (H, W, 3)
    files: list[Path] | None = None  # each key's file, where the reference reads files (their sizes are checked)
    folders: bool = False  # ImageFolder's rules: a class with no file is a tree it refuses


def _pil_open(path: Path) -> Any:
    """torchvision's ``pil_loader`` (ImageFolder's: RGB, no EXIF transpose), keeping the mode it converted from
    (a 16-bit greyscale file becomes white where its values pass 255)."""
    from PIL import Image

    with open(path, "rb") as f:
        img = Image.open(f)
        rgb = img.convert("RGB")
    rgb.info["source_mode"] = img.mode
    return rgb


def _image_folder(folder: Path, prefix: str) -> Listing:
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:  # ImageFolder.find_classes / make_dataset, as ImageFolder(folder) calls them
        classes = [c for c in find_classes(str(folder))[0] if c != _CACHE_SUBFOLDER]
    except FileNotFoundError as e:
        raise ParityInputError(f"{folder}: not a class-folder tree ({e})") from None
    index = {c: i for i, c in enumerate(classes)}
    items = make_dataset(str(folder), index, extensions=IMG_EXTENSIONS, allow_empty=True)
    keys = [prefix + os.path.relpath(p, folder).replace(os.sep, "/") for p, _ in items]
    paths = [Path(p) for p, _ in items]
    return Listing(f"torchvision ImageFolder({folder})", classes, keys,
                   np.asarray([y for _, y in items], dtype=np.int64), lambda i: _pil_open(paths[i]), paths, True)


def _devkit_truth(src: Path) -> tuple[dict[int, str], list[int], str] | None:
    """(ILSVRC2012_ID -> wnid of the leaf synsets, ground-truth ID per val image, where) from the devkit
    folder or its archive in ``src``; None when neither is there."""
    if (src / _DEVKIT).is_dir():
        return (*_parse_devkit(src / _DEVKIT), f"{_DEVKIT}/")
    archive = src / f"{_DEVKIT}.tar.gz"
    if not archive.is_file():
        return None
    with tempfile.TemporaryDirectory(prefix="parity-devkit-") as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")  # torchvision's parse_devkit_archive insists on the real archive's md5
        return (*_parse_devkit(Path(tmp) / _DEVKIT), archive.name)


def _parse_devkit(devkit: Path) -> tuple[dict[int, str], list[int]]:
    """The parsing of torchvision's ``parse_devkit_archive`` (its helpers are nested, not importable)."""
    import scipy.io

    meta = scipy.io.loadmat(str(devkit / "data" / "meta.mat"), squeeze_me=True)["synsets"]
    leaves = [row for row in meta if int(row[4]) == 0]  # num_children == 0: the 1,000 classes
    idx_to_wnid = {int(row[0]): str(row[1]) for row in leaves}
    lines = (devkit / "data" / "ILSVRC2012_validation_ground_truth.txt").read_text().split()
    return idx_to_wnid, [int(v) for v in lines]


def _flat_val(src: Path, val: Path) -> Listing:
    """A flat ImageNet val: labels from the devkit (torchvision's parsers) or Kaggle's LOC_val_solution.csv."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    names = sorted(n for n in os.listdir(val) if n.lower().endswith(IMG_EXTENSIONS) and (val / n).is_file())
    kaggle = src / "LOC_val_solution.csv"
    if kaggle.is_file():
        with open(kaggle, newline="") as f:
            by_id = {r["ImageId"]: r["PredictionString"].split()[0] for r in csv.DictReader(f)}
        wnids = [by_id.get(Path(n).stem, "?") for n in names]
        leaves, how = sorted(set(by_id.values())), f"Kaggle's {kaggle}"
    else:
        devkit = _devkit_truth(src)
        if devkit is None:
            raise ParityInputError(f"{val} is flat and {src} holds no {_DEVKIT}/ (or .tar.gz) nor "
                                   "LOC_val_solution.csv: no reference labels")
        idx_to_wnid, truth, where = devkit
        wnids = []
        for n in names:
            digits = "".join(ch for ch in Path(n).stem.rsplit("_", 1)[-1] if ch.isdigit())
            k = int(digits) if digits else 0
            wnids.append(idx_to_wnid[truth[k - 1]] if 1 <= k <= len(truth) else "?")
        leaves, how = sorted(idx_to_wnid.values()), f"the devkit's ground truth ({where})"
    from torchvision.datasets.folder import find_classes

    classes = find_classes(str(src / "train"))[0] if (src / "train").is_dir() else leaves
    index = {c: i for i, c in enumerate(classes)}
    labels = np.asarray([index.get(w, -1) for w in wnids], dtype=np.int64)
    return Listing(how, list(classes), [f"val/{n}" for n in names], labels, lambda i: _pil_open(val / names[i]),
                   [val / n for n in names])


class _Batches(pickle.Unpickler):
    """CIFAR's Python-2 pickles hold dicts of numpy arrays: those globals, nothing else, may load."""

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
        ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"), ("copy_reg", "_reconstructor"), ("__builtin__", "object")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"CIFAR batch names {module}.{name}: not a CIFAR batch")
        return super().find_class(module, name)


_CIFAR = {"cifar10": ("cifar-10-batches-py", {"train": [f"data_batch_{k}" for k in range(1, 6)],
                                              "test": ["test_batch"]}, "batches.meta", "label_names", "labels"),
          "cifar100": ("cifar-100-python", {"train": ["train"], "test": ["test"]}, "meta", "fine_label_names",
                       "fine_labels")}


def _cifar_files(src: Path, folder: str) -> Callable[[str], bytes]:
    for base in (src / folder, src):
        if (base / "batches.meta").is_file() or (base / "meta").is_file():
            return lambda name, b=base: (b / name).read_bytes()  # type: ignore[misc]
    archives = [src] if src.is_file() else sorted(src.glob("*.tar.gz"))
    if not archives:
        raise ParityInputError(f"{src} holds no {folder}/ batches nor a .tar.gz of them: not a CIFAR source")

    def read(name: str) -> bytes:
        with tarfile.open(archives[0]) as tar:  # a few files, each read once
            try:
                member = tar.extractfile(f"{folder}/{name}")
            except KeyError:
                member = None
            if member is None:
                raise ParityInputError(f"{archives[0]} has no {folder}/{name}: not a {folder} archive")
            return member.read()

    return read


def _cifar(recipe: Recipe, src: Path) -> Listing:
    folder, splits, meta_name, names_key, labels_key = _CIFAR[recipe.kind]
    read = _cifar_files(src, folder)

    def load(name: str) -> dict[str, Any]:
        try:
            d = _Batches(io.BytesIO(read(name)), encoding="latin1").load()
        except (OSError, KeyError) as e:
            raise ParityInputError(f"{src}: cannot read CIFAR file {name} ({e})") from None
        return {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}

    classes = [str(c) for c in load(meta_name)[names_key]]
    images: list[np.ndarray] = []
    labels: list[int] = []
    keys: list[str] = []
    for name in splits.get(recipe.split, []):
        d = load(name)
        images.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.extend(int(v) for v in d[labels_key])
        keys.extend(f"{name}#{j}" for j in range(len(d[labels_key])))
    data = np.concatenate(images) if images else np.zeros((0, 32, 32, 3), np.uint8)
    return Listing(f"CIFAR python batches in {src}", classes, keys, np.asarray(labels, np.int64),
                   lambda i: data[i])


def _parquet(recipe: Recipe, src: Path) -> Listing:
    import pyarrow.parquet as pq
    from PIL import Image

    files = [src] if src.is_file() else sorted(src.rglob("*.parquet"))
    split = recipe.options.get("split")
    named = [f for f in files if split and f.name.startswith(f"{split}-")]
    files = named or files
    if not files:
        raise ParityInputError(f"{src} holds no .parquet files: not a Parquet source")
    cols = recipe.options.get("columns") or {}
    label_col, image_col = cols.get("label") or "label", cols.get("image") or "image"
    root = src if src.is_dir() else src.parent
    keys: list[str] = []
    labels: list[int] = []
    cells: list[Any] = []
    for f in files:
        t = pq.read_table(f, columns=[image_col, label_col])
        rel = f.relative_to(root).as_posix()
        keys.extend(f"{rel}#{r}" for r in range(t.num_rows))
        labels.extend(-1 if v is None else int(v) for v in t.column(label_col).to_pylist())
        cells.extend(t.column(image_col).to_pylist())
    meta = pq.read_schema(files[0]).metadata or {}
    classes: list[str] = []
    if b"huggingface" in meta:
        import json

        feature = json.loads(meta[b"huggingface"]).get("info", {}).get("features", {}).get(label_col, {})
        classes = [str(c) for c in feature.get("names", [])]

    def open_row(i: int) -> Any:
        cell = cells[i]
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        if data is None:
            raise ParityInputError(f"row {keys[i]} has no image bytes")
        return Image.open(io.BytesIO(data)).convert("RGB")

    return Listing(f"pyarrow: column {label_col!r} of {len(files)} Parquet file(s)", classes, keys,
                   np.asarray(labels, np.int64), open_row)


def reference_listing(recipe: Recipe, src: Path) -> Listing:
    """The reference listing of ``src`` for the cache's recipe; :class:`ParityInputError` when ``src`` is not
    a source of that kind."""
    folder = source_folder(recipe, src)
    if recipe.kind in ("cifar10", "cifar100"):
        return _cifar(recipe, src)
    if recipe.kind == "parquet":
        return _parquet(recipe, src)
    if recipe.kind == "imagenet" and recipe.split == "val":
        with os.scandir(folder) as it:
            if not any(e.is_dir() and e.name.startswith("n") for e in it):
                return _flat_val(src, folder)
    return _image_folder(folder, "")  # keys relative to the split folder (ImageNet's), as paths.json
