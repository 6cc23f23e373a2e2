"""A small ILSVRC2012 tree in the real on-disk layouts, made from real photographs.

Train is always ``train/<wnid>/<wnid>_<k>.JPEG``. Validation comes in the three layouts found in
the wild:

* ``folders``: ``val/<wnid>/ILSVRC2012_val_000000NN.JPEG`` (what ``valprep.sh`` / torchvision make);
* ``devkit``: flat ``val/ILSVRC2012_val_000000NN.JPEG`` labelled by
  ``ILSVRC2012_devkit_t12/data/meta.mat`` + ``ILSVRC2012_validation_ground_truth.txt``;
* ``kaggle``: flat ``val/`` labelled by ``LOC_val_solution.csv`` + ``LOC_synset_mapping.txt``.

``kaggle_tree=True`` nests train/ and val/ under ``ILSVRC/Data/CLS-LOC/`` like the Kaggle download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from cachebuild.samples.broken import write_all_broken
from cachebuild.samples.photos import imagenet_like_size, photo_bank, render_sample

__all__ = ["IMAGENET_SYNSETS", "VAL_LAYOUTS", "write_imagenet"]

VAL_LAYOUTS: tuple[str, ...] = ("folders", "devkit", "kaggle")

# The first 30 ILSVRC2012 classes in wnid order, with their LOC_synset_mapping.txt words.
IMAGENET_SYNSETS: tuple[tuple[str, str], ...] = (
    ("n01440764", "tench, Tinca tinca"),
    ("n01443537", "goldfish, Carassius auratus"),
    ("n01484850", "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias"),
    ("n01491361", "tiger shark, Galeocerdo cuvieri"),
    ("n01494475", "hammerhead, hammerhead shark"),
    ("n01496331", "electric ray, crampfish, numbfish, torpedo"),
    ("n01498041", "stingray"),
    ("n01514668", "cock"),
    ("n01514859", "hen"),
    ("n01518878", "ostrich, Struthio camelus"),
    ("n01530575", "brambling, Fringilla montifringilla"),
    ("n01531178", "goldfinch, Carduelis carduelis"),
    ("n01532829", "house finch, linnet, Carpodacus mexicanus"),
    ("n01534433", "junco, snowbird"),
    ("n01537544", "indigo bunting, indigo finch, indigo bird, Passerina cyanea"),
    ("n01558993", "robin, American robin, Turdus migratorius"),
    ("n01560419", "bulbul"),
    ("n01580077", "jay"),
    ("n01582220", "magpie"),
    ("n01592084", "chickadee"),
    ("n01601694", "water ouzel, dipper"),
    ("n01608432", "kite"),
    ("n01614925", "bald eagle, American eagle, Haliaeetus leucocephalus"),
    ("n01616318", "vulture"),
    ("n01622779", "great grey owl, great gray owl, Strix nebulosa"),
    ("n01629819", "European fire salamander, Salamandra salamandra"),
    ("n01630670", "common newt, Triturus vulgaris"),
    ("n01631663", "eft"),
    ("n01632458", "spotted salamander, Ambystoma maculatum"),
    ("n01632777", "axolotl, mud puppy, Ambystoma mexicanum"),
)

# Non-leaf synsets as meta.mat lists them after the 1000 leaves (num_children > 0); readers must
# skip them. (wnid, words, gloss)
_INTERNAL_SYNSETS: tuple[tuple[str, str, str], ...] = (
    ("n00015388", "animal, animate being, beast, brute, creature, fauna",
     "a living organism characterized by voluntary movement"),
    ("n01471682", "vertebrate, craniate",
     "animals having a bony or cartilaginous skeleton with a segmented spinal column"),
    ("n02512053", "fish", "any of various mostly cold-blooded aquatic vertebrates usually having scales"),
)

_QUIRK_KINDS: tuple[str, ...] = ("cmyk", "png", "gray", "exif")


def _kind_for(i: int) -> str:
    """Deterministic mix: 1 in 25 large, 1 in 20 small (both present once >= 8 images)."""
    if i % 25 == 3:
        return "large"
    if i % 20 == 7:
        return "small"
    return "normal"


def _write_image(path: Path, bank: list, k: int, kind: str, rng: np.random.Generator) -> dict[str, Any]:
    w, h = imagenet_like_size(rng, kind)
    img = render_sample(bank, k, w, h, rng)
    quality = int(rng.integers(85, 96))
    Image.fromarray(img).save(path, format="JPEG", quality=quality)
    return {"path": path, "label": k, "size": (w, h), "kind": kind, "quality": quality}


def _write_quirk(path: Path, bank: list, k: int, quirk: str, rng: np.random.Generator) -> dict[str, Any]:
    w, h = imagenet_like_size(rng, "normal")
    img = render_sample(bank, k, w, h, rng)
    quality = int(rng.integers(85, 96))
    pil = Image.fromarray(img)
    if quirk == "cmyk":
        pil.convert("CMYK").save(path, format="JPEG", quality=quality)
    elif quirk == "png":
        pil.save(path, format="PNG")
    elif quirk == "gray":
        pil.convert("L").save(path, format="JPEG", quality=quality)
    else:  # exif: the upright picture stored turned 90 deg counter-clockwise; orientation 6 tells a viewer
        # to turn it 90 deg clockwise, which gives the upright (w x h) picture back.
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.fromarray(np.ascontiguousarray(np.rot90(img, 1))).save(path, format="JPEG", quality=quality,
                                                                      exif=exif.tobytes())
    return {"path": path, "label": k, "size": (w, h), "kind": quirk, "quality": quality, "upright": img}


def _write_meta_mat(path: Path, wnids: list[str], words: list[str], ids: list[int], n_train: list[int]) -> None:
    """``meta.mat`` with a 1-column ``synsets`` struct array in the real field order."""
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    n_leaf = len(wnids)
    rows: list[tuple[Any, ...]] = []
    for i in sorted(range(n_leaf), key=lambda i: ids[i]):  # leaves by their ILSVRC2012_ID (not wnid order)
        rows.append((np.array([[float(ids[i])]]), wnids[i], words[i], f"gloss of {words[i].split(', ')[0]}",
                     np.array([[0.0]]), np.zeros((1, 0)), np.array([[0.0]]), np.array([[float(n_train[i])]])))
    # Internal nodes after the leaves, the last one (the root) parent of all leaves.
    for j, (wnid, word, gloss) in enumerate(_INTERNAL_SYNSETS):
        own_id = n_leaf + j + 1
        last = j == len(_INTERNAL_SYNSETS) - 1
        children = np.arange(1, n_leaf + 1, dtype=float) if last else np.array([float(own_id + 1)])
        rows.append((np.array([[float(own_id)]]), wnid, word, gloss, np.array([[float(children.size)]]),
                     children.reshape(1, -1), np.array([[float(len(_INTERNAL_SYNSETS) - j)]]),
                     np.array([[float(sum(n_train))]])))
    synsets = np.empty((len(rows), 1), dtype=[(f, object) for f in fields])
    for r, row in enumerate(rows):
        synsets[r, 0] = row
    import scipy.io  # a devkit layout only: `cachebuild sample` writes class folders

    path.parent.mkdir(parents=True, exist_ok=True)
    scipy.io.savemat(str(path), {"synsets": synsets}, format="5")


def write_imagenet(root: Path, n_classes: int = 10, train_per_class: int = 20, val_per_class: int = 5,
                   val_layout: str = "folders", seed: int = 0, *, kaggle_tree: bool = False, quirks: bool = False,
                   broken: bool = False) -> dict[str, Any]:
    """Write an ILSVRC2012-layout tree under ``root``; deterministic from ``seed``.

    Classes are the first ``n_classes`` real wnids (label = index in sorted wnid order, as
    ``ImageFolder`` assigns). Class ``k`` is cut from photo ``k`` of :func:`photo_bank` (from photo
    regions past the bank's size). Image sizes follow :func:`imagenet_like_size`; 1 image in 25 is
    large (1000-2000 px long side) and 1 in 20 small (short side < 224).

    ``quirks=True`` adds to the train folders of classes 0, 1, 2, 3 (cycling when fewer) one CMYK
    JPEG, one PNG named ``.JPEG``, one grayscale JPEG and one JPEG with EXIF orientation 6.
    ``broken=True`` adds the files of :func:`~cachebuild.samples.broken.write_all_broken` to the
    train folder of the last class (named ``<wnid>_broken_*.JPEG``).

    Returns a dict: ``root``, ``train_dir``, ``val_dir``, ``val_layout``, ``wnids``, ``words``,
    ``train`` and ``val`` (lists of dicts with ``path``, ``label``, ``wnid``, ``size`` = displayed
    (w, h), ``kind``; val also ``index``, 1-based), ``quirks`` (kind -> entry, with the ``upright``
    RGB array), ``broken`` (kind -> path), and per layout ``meta_mat`` / ``ground_truth`` /
    ``ilsvrc_ids`` (wnid -> ILSVRC2012_ID) or ``solution_csv`` / ``synset_mapping``.
    """
    if val_layout not in VAL_LAYOUTS:
        raise ValueError(f"val_layout must be one of {VAL_LAYOUTS}, got {val_layout!r}")
    if not 1 <= n_classes <= len(IMAGENET_SYNSETS):
        raise ValueError(f"n_classes must be in [1, {len(IMAGENET_SYNSETS)}] (known wnids), got {n_classes}")
    if train_per_class < 0 or val_per_class < 0:
        raise ValueError(f"per-class counts must be >= 0, got {train_per_class}, {val_per_class}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    bank = photo_bank()
    wnids = [w for w, _ in IMAGENET_SYNSETS[:n_classes]]
    words = [t for _, t in IMAGENET_SYNSETS[:n_classes]]
    data_root = root / "ILSVRC" / "Data" / "CLS-LOC" if kaggle_tree else root
    train_dir, val_dir = data_root / "train", data_root / "val"

    out: dict[str, Any] = {"root": root, "train_dir": train_dir, "val_dir": val_dir, "val_layout": val_layout,
                           "wnids": wnids, "words": words, "train": [], "val": [], "quirks": {}, "broken": {}}

    _write_train(out, bank, rng, train_per_class, quirks)
    if broken:
        out["broken"] = write_all_broken(train_dir / wnids[-1], prefix=f"{wnids[-1]}_broken_", seed=seed)
    # Val: 50 000 images in the real set, numbered 1.. in an order that mixes the classes.
    val_labels = rng.permutation(np.repeat(np.arange(n_classes), val_per_class))
    _write_val(out, bank, rng, val_labels)
    if val_layout == "devkit":
        _write_devkit(out, rng, val_labels)
    elif val_layout == "kaggle":
        _write_kaggle_solution(out, rng)
    return out


def _write_train(out: dict[str, Any], bank: Any, rng: np.random.Generator, per_class: int, quirks: bool) -> None:
    """Train: real files are <wnid>_<image id>.JPEG with sparse ids; the quirk files cycle over the classes."""
    wnids, i = out["wnids"], 0
    for k, wnid in enumerate(wnids):
        cls_dir = out["train_dir"] / wnid
        cls_dir.mkdir(parents=True, exist_ok=True)
        ids = np.sort(rng.choice(20000, size=per_class + len(_QUIRK_KINDS), replace=False)) + 1
        for j in range(per_class):
            entry = _write_image(cls_dir / f"{wnid}_{ids[j]}.JPEG", bank, k, _kind_for(i), rng)
            entry["wnid"] = wnid
            out["train"].append(entry)
            i += 1
        if quirks:
            for q, quirk in enumerate(_QUIRK_KINDS):
                if q % len(wnids) == k:
                    entry = _write_quirk(cls_dir / f"{wnid}_{ids[per_class + q]}.JPEG", bank, k, quirk, rng)
                    entry["wnid"] = wnid
                    out["train"].append(entry)
                    out["quirks"][quirk] = entry


def _write_val(out: dict[str, Any], bank: Any, rng: np.random.Generator, val_labels: np.ndarray) -> None:
    """Val images ``ILSVRC2012_val_<n>.JPEG``: in class folders, or flat (devkit, kaggle)."""
    val_dir, wnids, in_folders = out["val_dir"], out["wnids"], out["val_layout"] == "folders"
    if not in_folders:
        val_dir.mkdir(parents=True, exist_ok=True)
    for idx, k in enumerate(val_labels.tolist(), start=1):
        folder = val_dir / wnids[k] if in_folders else val_dir
        folder.mkdir(parents=True, exist_ok=True)
        entry = _write_image(folder / f"ILSVRC2012_val_{idx:08d}.JPEG", bank, k, _kind_for(idx + 11), rng)
        entry.update(wnid=wnids[k], index=idx)
        out["val"].append(entry)


def _write_devkit(out: dict[str, Any], rng: np.random.Generator, val_labels: np.ndarray) -> None:
    """The devkit: meta.mat (ILSVRC2012_IDs not in wnid order) and the val ground truth, one ID a line."""
    root, wnids, n_classes = out["root"], out["wnids"], len(out["wnids"])
    ilsvrc_ids = (rng.permutation(n_classes) + 1).tolist()  # real IDs are not in wnid order
    n_train = [sum(1 for e in out["train"] if e["label"] == k) for k in range(n_classes)]
    data_dir = root / "ILSVRC2012_devkit_t12" / "data"
    _write_meta_mat(data_dir / "meta.mat", wnids, out["words"], ilsvrc_ids, n_train)
    gt = data_dir / "ILSVRC2012_validation_ground_truth.txt"
    gt.write_text("".join(f"{ilsvrc_ids[k]}\n" for k in val_labels.tolist()), encoding="ascii")
    out.update(meta_mat=data_dir / "meta.mat", ground_truth=gt,
               ilsvrc_ids={wnids[k]: ilsvrc_ids[k] for k in range(n_classes)})


def _write_kaggle_solution(out: dict[str, Any], rng: np.random.Generator) -> None:
    """Kaggle's LOC_val_solution.csv (unsorted rows, 1-3 boxes each) and LOC_synset_mapping.txt."""
    root = out["root"]
    lines = ["ImageId,PredictionString\n"]
    for e in (out["val"][r] for r in rng.permutation(len(out["val"]))):  # rows are not sorted
        w, h = e["size"]
        boxes = []
        for _ in range(int(rng.integers(1, 4))):
            x0, x1 = sorted(rng.integers(0, w, size=2).tolist())
            y0, y1 = sorted(rng.integers(0, h, size=2).tolist())
            boxes.append(f"{e['wnid']} {x0} {y0} {max(x1, x0 + 1)} {max(y1, y0 + 1)}")
        lines.append(f"{e['path'].stem},{' '.join(boxes)} \n")
    csv = root / "LOC_val_solution.csv"
    csv.parent.mkdir(parents=True, exist_ok=True)
    csv.write_text("".join(lines), encoding="ascii")
    mapping = root / "LOC_synset_mapping.txt"
    mapping.write_text("".join(f"{w} {t}\n" for w, t in zip(out["wnids"], out["words"], strict=True)),
                       encoding="ascii")
    out.update(solution_csv=csv, synset_mapping=mapping)
