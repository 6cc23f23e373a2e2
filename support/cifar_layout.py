"""CIFAR-10 / CIFAR-100 "python version" files, faithful to the ones from cs.toronto.edu.

The real batches were written by Python 2's cPickle with protocol 2: dict keys and strings are
py2 ``str`` (``SHORT_BINSTRING`` / ``BINSTRING`` opcodes, never unicode), and arrays are pickled
through ``numpy.core.multiarray._reconstruct`` with the pixel bytes as one py2 ``str``. Python 3's
pickler cannot emit py2 ``str``, so :class:`Py2Pickler` writes those opcodes itself (only the types
the format holds). The layout is exactly what ``torchvision.datasets.CIFAR10`` / ``CIFAR100`` read::

    cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta, readme.html}
    cifar-100-python/{train, test, meta}
    cifar-10-python.tar.gz / cifar-100-python.tar.gz (with ``tar_gz=True``)
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from support.archive import write_tar_gz

__all__ = [
    "CIFAR10_LABEL_NAMES",
    "CIFAR100_COARSE_LABEL_NAMES",
    "CIFAR100_FINE_LABEL_NAMES",
    "CIFAR100_FINE_TO_COARSE",
    "Pixels",
    "Py2Pickler",
    "py2_pickle_dumps",
    "write_cifar10",
    "write_cifar100",
]

CIFAR10_LABEL_NAMES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

CIFAR100_COARSE_LABEL_NAMES: tuple[str, ...] = (
    "aquatic_mammals",
    "fish",
    "flowers",
    "food_containers",
    "fruit_and_vegetables",
    "household_electrical_devices",
    "household_furniture",
    "insects",
    "large_carnivores",
    "large_man-made_outdoor_things",
    "large_natural_outdoor_scenes",
    "large_omnivores_and_herbivores",
    "medium_mammals",
    "non-insect_invertebrates",
    "people",
    "reptiles",
    "small_mammals",
    "trees",
    "vehicles_1",
    "vehicles_2",
)

_SUPERCLASSES: tuple[tuple[str, ...], ...] = (
    ("beaver", "dolphin", "otter", "seal", "whale"),
    ("aquarium_fish", "flatfish", "ray", "shark", "trout"),
    ("orchid", "poppy", "rose", "sunflower", "tulip"),
    ("bottle", "bowl", "can", "cup", "plate"),
    ("apple", "mushroom", "orange", "pear", "sweet_pepper"),
    ("clock", "keyboard", "lamp", "telephone", "television"),
    ("bed", "chair", "couch", "table", "wardrobe"),
    ("bee", "beetle", "butterfly", "caterpillar", "cockroach"),
    ("bear", "leopard", "lion", "tiger", "wolf"),
    ("bridge", "castle", "house", "road", "skyscraper"),
    ("cloud", "forest", "mountain", "plain", "sea"),
    ("camel", "cattle", "chimpanzee", "elephant", "kangaroo"),
    ("fox", "porcupine", "possum", "raccoon", "skunk"),
    ("crab", "lobster", "snail", "spider", "worm"),
    ("baby", "boy", "girl", "man", "woman"),
    ("crocodile", "dinosaur", "lizard", "snake", "turtle"),
    ("hamster", "mouse", "rabbit", "shrew", "squirrel"),
    ("maple_tree", "oak_tree", "palm_tree", "pine_tree", "willow_tree"),
    ("bicycle", "bus", "motorcycle", "pickup_truck", "train"),
    ("lawn_mower", "rocket", "streetcar", "tank", "tractor"),
)

# Fine labels are the 100 names in alphabetical order, as in the real meta file.
CIFAR100_FINE_LABEL_NAMES: tuple[str, ...] = tuple(sorted(n for group in _SUPERCLASSES for n in group))
CIFAR100_FINE_TO_COARSE: tuple[int, ...] = tuple(
    next(c for c, group in enumerate(_SUPERCLASSES) if name in group) for name in CIFAR100_FINE_LABEL_NAMES
)

_README_HTML = b'<meta HTTP-EQUIV="REFRESH" content="0; URL=http://www.cs.toronto.edu/~kriz/cifar.html">\n'


# --------------------------------------------------------------------------------------------------
# Python 2 protocol-2 pickle emitter


class _Global:
    """A ``GLOBAL module\\nname`` reference (memoised like cPickle does)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class Py2Pickler:
    """Emit a protocol-2 pickle as Python 2's cPickle wrote it, for the types the CIFAR files hold.

    ``str`` and ``bytes`` both become py2 ``str`` (``U`` / ``T`` opcodes; ``str`` must be latin-1);
    ``int`` (32-bit) ``K`` / ``M`` / ``J``; ``bool`` ``NEWTRUE`` / ``NEWFALSE``; ``None``; ``tuple``;
    ``list`` (``APPENDS`` in batches of 1000); ``dict`` (``SETITEMS``, insertion order); and
    C-contiguous numeric ``np.ndarray`` via ``numpy.core.multiarray._reconstruct``. Memo ids start
    at 1 (``BINPUT`` / ``LONG_BINPUT``); dicts, lists, globals, reduce results and strings of two or
    more characters are memoised, temporaries inside the array's reduce are not (as in the real files).
    """

    _BATCH = 1000

    def __init__(self) -> None:
        self._out = io.BytesIO()
        self._next_memo = 1
        self._globals: dict[tuple[str, str], int] = {}

    def dumps(self, obj: Any) -> bytes:
        self._out.write(b"\x80\x02")  # PROTO 2
        self._save(obj)
        self._out.write(b".")  # STOP
        return self._out.getvalue()

    # -- helpers
    def _put(self) -> int:
        idx = self._next_memo
        self._next_memo += 1
        self._out.write(b"q" + bytes([idx]) if idx < 256 else b"r" + struct.pack("<I", idx))
        return idx

    def _get(self, idx: int) -> None:
        self._out.write(b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx))

    def _save_str(self, raw: bytes, memo: bool = True) -> None:
        n = len(raw)
        self._out.write((b"U" + bytes([n])) if n < 256 else (b"T" + struct.pack("<I", n)))
        self._out.write(raw)
        if memo and n >= 2:
            self._put()

    def _save_global(self, g: _Global) -> None:
        key = (g.module, g.name)
        if key in self._globals:
            self._get(self._globals[key])
            return
        self._out.write(b"c" + g.module.encode("ascii") + b"\n" + g.name.encode("ascii") + b"\n")
        self._globals[key] = self._put()

    def _save_int(self, v: int) -> None:
        if 0 <= v < 256:
            self._out.write(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            self._out.write(b"M" + struct.pack("<H", v))
        elif -(2**31) <= v < 2**31:
            self._out.write(b"J" + struct.pack("<i", v))
        else:
            raise ValueError(f"py2 pickle emitter handles 32-bit ints only, got {v}")

    def _save_tuple(self, items: tuple[Any, ...], memo_str: bool = True) -> None:
        if not items:
            self._out.write(b")")
            return
        if len(items) > 3:
            self._out.write(b"(")
        for item in items:
            self._save(item, memo_str=memo_str)
        self._out.write(b"t" if len(items) > 3 else b"\x85\x86\x87"[len(items) - 1 : len(items)])

    def _save_ndarray(self, arr: np.ndarray) -> None:
        if arr.dtype.kind not in "biuf" or not arr.flags.c_contiguous:
            raise ValueError(f"py2 pickle emitter handles C-contiguous numeric arrays, got {arr.dtype}")
        reconstruct = _Global("numpy.core.multiarray", "_reconstruct")
        self._save_global(reconstruct)
        self._save_global(_Global("numpy", "ndarray"))
        self._save_tuple((0,), memo_str=False)
        self._save_str(b"b", memo=False)
        self._out.write(b"\x87R")  # TUPLE3 REDUCE -> empty array
        self._put()
        # state: (1, shape, dtype, is_fortran, raw bytes)
        self._out.write(b"(")
        self._save_int(1)
        self._save_tuple(tuple(int(s) for s in arr.shape), memo_str=False)
        self._save_dtype(arr.dtype)
        self._out.write(b"\x89")  # NEWFALSE: C order
        self._save_str(arr.tobytes(), memo=False)
        self._out.write(b"tb")  # TUPLE BUILD

    def _save_dtype(self, dt: np.dtype) -> None:
        self._save_global(_Global("numpy", "dtype"))
        self._save_str(f"{dt.kind}{dt.itemsize}".encode("ascii"), memo=False)
        self._out.write(b"K\x00K\x01\x87R")  # ('u1', 0, 1) REDUCE
        self._put()
        order = "|" if dt.itemsize == 1 else ("<" if dt.byteorder in "=<" else ">")
        self._out.write(b"(")
        self._save_int(3)
        self._save_str(order.encode("ascii"), memo=False)
        self._out.write(b"NNN")
        self._save_int(-1)
        self._save_int(-1)
        self._save_int(0)
        self._out.write(b"tb")

    def _save(self, obj: Any, memo_str: bool = True) -> None:
        if obj is None:
            self._out.write(b"N")
        elif obj is True or obj is False:
            self._out.write(b"\x88" if obj else b"\x89")
        elif isinstance(obj, (int, np.integer)):
            self._save_int(int(obj))
        elif isinstance(obj, str):
            self._save_str(obj.encode("latin-1"), memo=memo_str)
        elif isinstance(obj, bytes):
            self._save_str(obj, memo=memo_str)
        elif isinstance(obj, tuple):
            self._save_tuple(obj, memo_str=memo_str)
        elif isinstance(obj, list):
            self._out.write(b"]")
            self._put()
            for start in range(0, len(obj), self._BATCH):
                chunk = obj[start : start + self._BATCH]
                if len(chunk) == 1:
                    self._save(chunk[0])
                    self._out.write(b"a")  # APPEND
                else:
                    self._out.write(b"(")
                    for item in chunk:
                        self._save(item)
                    self._out.write(b"e")  # APPENDS
        elif isinstance(obj, dict):
            self._out.write(b"}")
            self._put()
            items = list(obj.items())
            for start in range(0, len(items), self._BATCH):
                chunk = items[start : start + self._BATCH]
                if len(chunk) == 1:
                    self._save(chunk[0][0])
                    self._save(chunk[0][1])
                    self._out.write(b"s")  # SETITEM
                else:
                    self._out.write(b"(")
                    for key, value in chunk:
                        self._save(key)
                        self._save(value)
                    self._out.write(b"u")  # SETITEMS
        elif isinstance(obj, np.ndarray):
            self._save_ndarray(obj)
        else:
            raise TypeError(f"py2 pickle emitter does not handle {type(obj).__name__}")


def py2_pickle_dumps(obj: Any) -> bytes:
    """``obj`` pickled as Python 2's ``cPickle.dump(obj, f, 2)`` would have (see :class:`Py2Pickler`)."""
    return Py2Pickler().dumps(obj)


# --------------------------------------------------------------------------------------------------
# Pixels and files


# (labels, seed, class count) -> (N, 32, 32, 3) uint8 RGB pictures of those classes: what the batches hold
# (tests/cifar_files.py cuts them from the sample photos)
Pixels = Callable[[np.ndarray, int, int], np.ndarray]


def _to_rows(images: np.ndarray) -> np.ndarray:
    """NHWC -> (N, 3072) rows holding the R, G, B planes (CHW), as in the real ``data`` arrays."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), 3 * 32 * 32))


def _balanced_labels(n: int, n_classes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.arange(n) % n_classes)


def _filenames(names: list[str], rng: np.random.Generator) -> list[str]:
    ids = rng.choice(60000, size=len(names), replace=False)
    return [f"{name}_s_{i:06d}.png" for name, i in zip(names, ids.tolist(), strict=True)]


def _check_counts(n_train: int, n_test: int) -> None:
    if n_train < 0 or n_test < 0:
        raise ValueError(f"sample counts must be >= 0, got n_train={n_train}, n_test={n_test}")


def write_cifar10(root: Path, pixels: Pixels, n_train: int = 500, n_test: int = 100, seed: int = 0,
                  tar_gz: bool = False) -> dict[str, Any]:
    """Write ``root/cifar-10-batches-py/`` (and ``root/cifar-10-python.tar.gz`` with ``tar_gz``), the pictures
    drawn by ``pixels``.

    ``n_train`` samples are split over ``data_batch_1..5`` (sizes differ by at most one), ``n_test``
    go to ``test_batch``. Labels are balanced over the 10 classes and shuffled. Returns a dict with
    ``folder``, ``archive`` (or None), ``train_images`` / ``test_images`` (NHWC uint8, what
    torchvision's ``.data`` holds), ``train_labels`` / ``test_labels`` (int64) and ``classes``.
    """
    _check_counts(n_train, n_test)
    root = Path(root)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = list(CIFAR10_LABEL_NAMES)
    train_labels = _balanced_labels(n_train, 10, rng)
    test_labels = _balanced_labels(n_test, 10, rng)
    train_images = pixels(train_labels, seed * 2 + 1, 10)
    test_images = pixels(test_labels, seed * 2 + 2, 10)

    splits = np.array_split(np.arange(n_train), 5)
    for b, idx in enumerate(splits, start=1):
        batch = {  # key order of the real files
            "batch_label": f"training batch {b} of 5",
            "labels": train_labels[idx].tolist(),
            "data": _to_rows(train_images[idx]),
            "filenames": _filenames([names[k] for k in train_labels[idx].tolist()], rng),
        }
        (folder / f"data_batch_{b}").write_bytes(py2_pickle_dumps(batch))
    test = {
        "batch_label": "testing batch 1 of 1",
        "labels": test_labels.tolist(),
        "data": _to_rows(test_images),
        "filenames": _filenames([names[k] for k in test_labels.tolist()], rng),
    }
    (folder / "test_batch").write_bytes(py2_pickle_dumps(test))
    meta = {"num_cases_per_batch": len(splits[0]), "label_names": names, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(py2_pickle_dumps(meta))
    (folder / "readme.html").write_bytes(_README_HTML)

    archive = None
    if tar_gz:
        archive = root / "cifar-10-python.tar.gz"
        write_tar_gz(folder, archive)
    return {
        "folder": folder,
        "archive": archive,
        "classes": names,
        "train_images": train_images,
        "train_labels": train_labels.astype(np.int64),
        "test_images": test_images,
        "test_labels": test_labels.astype(np.int64),
    }


def write_cifar100(root: Path, pixels: Pixels, n_train: int = 500, n_test: int = 100, seed: int = 0,
                   tar_gz: bool = False) -> dict[str, Any]:
    """Write ``root/cifar-100-python/{train,test,meta}`` (and ``cifar-100-python.tar.gz``).

    Fine labels are balanced over the 100 classes and shuffled; coarse labels follow the real
    fine-to-superclass table. Returns like :func:`write_cifar10` plus ``train_coarse_labels`` /
    ``test_coarse_labels`` and ``coarse_classes``; ``classes`` are the fine label names.
    """
    _check_counts(n_train, n_test)
    root = Path(root)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    fine_names = list(CIFAR100_FINE_LABEL_NAMES)
    coarse_of = np.array(CIFAR100_FINE_TO_COARSE, dtype=np.int64)
    out: dict[str, Any] = {
        "folder": folder,
        "classes": fine_names,
        "coarse_classes": list(CIFAR100_COARSE_LABEL_NAMES),
    }
    for split, n, sub_seed, label in (
        ("train", n_train, seed * 2 + 1, "training"),
        ("test", n_test, seed * 2 + 2, "testing"),
    ):
        fine = _balanced_labels(n, 100, rng)
        images = pixels(fine, sub_seed, 100)
        batch = {  # key order of the real files
            "filenames": _filenames([fine_names[k] for k in fine.tolist()], rng),
            "batch_label": f"{label} batch 1 of 1",
            "fine_labels": fine.tolist(),
            "coarse_labels": coarse_of[fine].tolist(),
            "data": _to_rows(images),
        }
        (folder / split).write_bytes(py2_pickle_dumps(batch))
        out[f"{split}_images"] = images
        out[f"{split}_labels"] = fine.astype(np.int64)
        out[f"{split}_coarse_labels"] = coarse_of[fine]
    meta = {"fine_label_names": fine_names, "coarse_label_names": list(CIFAR100_COARSE_LABEL_NAMES)}
    (folder / "meta").write_bytes(py2_pickle_dumps(meta))

    out["archive"] = None
    if tar_gz:
        out["archive"] = root / "cifar-100-python.tar.gz"
        write_tar_gz(folder, out["archive"])
    return out
