"""Read the CIFAR-10 / CIFAR-100 "python version" batches without running code from them.

The batches are Python 2 pickles, and ``pickle.load`` calls any global a file names, so a crafted batch could
run ``os.system``. :class:`RestrictedUnpickler` admits only the few numpy constructors the format holds, each
mapped to numpy's object by hand (``numpy.core`` is deprecated in numpy 2 and never imported); anything else
raises :class:`CifarUnsafePickleError` before it is called.

``root`` is the folder holding ``cifar-10-batches-py/`` (as torchvision takes it), that folder itself, a folder
holding only ``cifar-10-python.tar.gz``, or the ``.tar.gz``, whose members are read in memory (nothing is
extracted). The result equals torchvision's ``.data`` / ``.targets`` / ``.classes`` for the same files.
"""

from __future__ import annotations

import codecs
import io
import pickle
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cachebuild.errors import OptionError, SourceError

__all__ = ["CIFAR_VARIANTS", "CifarFormatError", "CifarNotFoundError", "CifarSplit", "CifarUnsafePickleError",
           "RestrictedUnpickler", "load_cifar_split", "restricted_loads"]

Variant = Literal["cifar10", "cifar100"]
Split = Literal["train", "test"]


@dataclass(frozen=True)
class _Layout:
    folder: str
    archive: str
    meta: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    label_key: str
    names_key: str
    n_classes: int


CIFAR_VARIANTS: dict[str, _Layout] = {
    "cifar10": _Layout(folder="cifar-10-batches-py", archive="cifar-10-python.tar.gz", meta="batches.meta",
                       train=tuple(f"data_batch_{i}" for i in range(1, 6)), test=("test_batch",),
                       label_key="labels", names_key="label_names", n_classes=10),
    "cifar100": _Layout(folder="cifar-100-python", archive="cifar-100-python.tar.gz", meta="meta", train=("train",),
                        test=("test",), label_key="fine_labels", names_key="fine_label_names", n_classes=100),
}
_N_COARSE = 20
_ROW = 3 * 32 * 32


class CifarFormatError(SourceError):
    """A CIFAR batch file that is not what the format says (a ``ValueError``)."""


class CifarNotFoundError(CifarFormatError, FileNotFoundError):
    """A CIFAR folder, archive or batch file that is not there."""


class CifarUnsafePickleError(CifarFormatError):
    """A batch file that names a global outside the CIFAR format; nothing from it was called."""


def _codecs_encode(obj: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as Python 3 protocol-2 pickles of ``bytes`` use it, text codecs only."""
    if not isinstance(obj, str) or codecs.lookup(encoding).name not in {"latin-1", "iso8859-1", "utf-8"}:
        raise pickle.UnpicklingError(f"_codecs.encode admitted for latin-1/utf-8 text only, got {encoding!r}")
    return codecs.encode(obj, encoding, errors)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """The globals CIFAR batches (py2 originals and py3 re-pickles) name, resolved without numpy.core."""
    probe = np.zeros(1, dtype=np.uint8)
    reconstruct = probe.__reduce__()[0]  # numpy's multiarray._reconstruct
    scalar = np.int64(0).__reduce__()[0]  # numpy's multiarray.scalar
    frombuffer = probe.__reduce_ex__(5)[0]  # numpy's numeric._frombuffer (protocol 5 pickles)
    table: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _codecs_encode,
        ("copy_reg", "_reconstructor"): None,  # listed to give a clearer message below; not admitted
    }
    for core in ("numpy.core", "numpy._core"):
        table[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        table[(f"{core}.multiarray", "scalar")] = scalar
        table[(f"{core}.numeric", "_frombuffer")] = frombuffer
    return {k: v for k, v in table.items() if v is not None}


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose ``find_class`` admits only the CIFAR format's numpy globals.

    ``source`` names the file in error messages. Read with ``encoding="latin1"`` (as torchvision
    does) so py2 ``str`` holding pixel bytes round-trips.
    """

    _ALLOWED: dict[tuple[str, str], Any] | None = None

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, source: str) -> None:
        super().__init__(file, encoding="latin1")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = type(self)._ALLOWED
        if allowed is None:
            allowed = type(self)._ALLOWED = _allowed_globals()
        try:
            return allowed[(module, name)]
        except KeyError:
            raise CifarUnsafePickleError(f"{self.source}: refusing to load global {module}.{name}: a CIFAR batch "
                                         f"holds only numpy arrays, lists, ints and strings (allowed: "
                                         f"{', '.join(sorted(f'{m}.{n}' for m, n in allowed))}); nothing was "
                                         f"run") from None

    def persistent_load(self, pid: Any) -> Any:
        raise CifarUnsafePickleError(f"{self.source}: persistent id {pid!r} is not part of the CIFAR format")


def restricted_loads(data: bytes, source: str) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`; errors name ``source``."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), source).load()
    except CifarFormatError:
        raise
    except Exception as exc:  # truncated, not a pickle, bad opcode, numpy refusing a state...
        raise CifarFormatError(f"{source}: not a readable CIFAR pickle ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class _Source:
    """Either a folder of batch files or a tar archive whose members sit under ``<top>/``."""

    folder: Path | None
    archive: Path | None
    top: str


def _resolve(root: Path, layout: _Layout) -> _Source:
    root = Path(root)
    if root.is_file():
        if not tarfile.is_tarfile(root):
            raise CifarFormatError(f"{root}: expected a folder or a .tar.gz holding {layout.folder}/, got a file that "
                                   f"is not a tar archive")
        return _Source(None, root, layout.folder)
    if not root.is_dir():
        raise CifarNotFoundError(f"{root}: no such folder or archive (expected the folder holding {layout.folder}/, "
                                 f"that folder itself, or {layout.archive})")
    if (root / layout.folder).is_dir():
        return _Source(root / layout.folder, None, layout.folder)
    if (root / layout.meta).is_file():
        return _Source(root, None, layout.folder)
    if (root / layout.archive).is_file():
        return _Source(None, root / layout.archive, layout.folder)
    raise CifarNotFoundError(f"{root}: found neither {layout.folder}/, its files ({layout.meta}, ...), nor "
                             f"{layout.archive}")


def _open_tar(path: Path | None) -> tarfile.TarFile:
    try:
        return tarfile.open(str(path), mode="r:*")
    except (tarfile.TarError, OSError) as exc:
        raise CifarFormatError(f"{path}: cannot open as a tar archive ({exc})") from exc


def _read_all(src: _Source, names: tuple[str, ...]) -> Iterator[tuple[str, str, bytes]]:
    """Yield ``(name, display path, bytes)`` of each batch file, in the order given."""
    if src.folder is not None:
        for name in names:
            path = src.folder / name
            if not path.is_file():
                raise CifarNotFoundError(f"{path}: batch file missing (expected {', '.join(names)} in {src.folder})")
            yield name, str(path), path.read_bytes()
        return
    with _open_tar(src.archive) as tar:
        members: dict[str, tarfile.TarInfo] = {}
        for m in tar.getmembers():
            name = m.name[2:] if m.name.startswith("./") else m.name
            members[name] = m  # a later member of the same name wins, as on extraction
        for name in names:
            key = f"{src.top}/{name}"
            display = f"{src.archive}::{key}"
            found = members.get(key)
            if found is None:
                raise CifarNotFoundError(f"{display}: member missing (expected {', '.join(names)} under {src.top}/ in "
                                         f"the archive)")
            if not found.isfile():  # links, devices, folders: never followed
                raise CifarFormatError(f"{display}: expected a regular file member, got tar type {found.type!r}")
            fh = tar.extractfile(found)
            if fh is None:
                raise CifarFormatError(f"{display}: member cannot be read")
            with fh:
                yield name, display, fh.read()


def _str_keys(obj: Any, source: str, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise CifarFormatError(f"{source}: expected the pickle to hold a dict ({what}), got {type(obj).__name__}")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def _names(value: Any, source: str, key: str, expected: int) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise CifarFormatError(f"{source}: expected {key!r} to be a list of {expected} names, got "
                               f"{type(value).__name__}")
    names = [v.decode("latin1") if isinstance(v, bytes) else v for v in value]
    if len(names) != expected or not all(isinstance(n, str) for n in names):
        raise CifarFormatError(f"{source}: expected {key!r} to hold {expected} strings, got {len(names)} items of "
                               f"types {sorted({type(n).__name__ for n in names})}")
    return names


def _labels(value: Any, source: str, key: str, n: int, n_classes: int) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as exc:
        raise CifarFormatError(f"{source}: {key!r} is not a label list ({exc})") from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise CifarFormatError(f"{source}: expected {key!r} to be a flat list of ints, got shape {arr.shape} dtype "
                               f"{arr.dtype}")
    if arr.shape[0] != n:
        raise CifarFormatError(f"{source}: {key!r} holds {arr.shape[0]} labels but 'data' holds {n} images")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= n_classes):
        raise CifarFormatError(f"{source}: {key!r} values must be in [0, {n_classes}), got [{arr.min()}, {arr.max()}]")
    return arr


def _data(value: Any, source: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise CifarFormatError(f"{source}: expected 'data' to be a numpy array, got {type(value).__name__}")
    if value.dtype != np.uint8 or value.ndim != 2 or value.shape[1] != _ROW:
        raise CifarFormatError(f"{source}: expected 'data' of shape (N, {_ROW}) uint8 (R, G, B 32x32 planes per row), "
                               f"got shape {value.shape} dtype {value.dtype}")
    return value


@dataclass(frozen=True)
class CifarSplit:
    """One split of CIFAR-10 or CIFAR-100, decoded.

    ``images``: (N, 32, 32, 3) uint8 RGB, C-contiguous (torchvision's ``.data``). ``labels``: (N,)
    int64 (torchvision's ``.targets``; the fine labels for CIFAR-100). ``coarse_labels``: (N,) int64
    for CIFAR-100, else None. ``classes`` / ``coarse_classes``: label names. ``files``: the batch
    files read, in order (``archive::member`` for a tar input). ``keys``: ``<batch file>#<row>`` for
    every sample.
    """

    variant: str
    split: str
    images: np.ndarray
    labels: np.ndarray
    coarse_labels: np.ndarray | None
    classes: list[str]
    coarse_classes: list[str] | None
    files: list[str]
    keys: list[str]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _check_args(variant: str, split: str) -> _Layout:
    if not isinstance(variant, str) or variant not in CIFAR_VARIANTS:
        raise OptionError(f"variant must be one of {sorted(CIFAR_VARIANTS)}, got {variant!r}")
    if split not in ("train", "test"):
        raise OptionError(f"split must be 'train' or 'test', got {split!r}")
    return CIFAR_VARIANTS[variant]


def load_cifar_split(root: Path | str, variant: Variant = "cifar10", split: Split = "train") -> CifarSplit:
    """Decode one CIFAR split into NHWC uint8 images and int64 labels, without running pickled code.

    ``root`` may be the folder holding ``cifar-10-batches-py/`` / ``cifar-100-python/``, that
    folder, a folder holding only the ``.tar.gz``, or the ``.tar.gz``. Raises
    :class:`CifarNotFoundError` for a missing folder / file / member, :class:`CifarUnsafePickleError`
    for a pickle naming a global outside the format, and :class:`CifarFormatError` for anything else
    that disagrees with the format (shape, dtype, label count, label range, names).
    """
    layout = _check_args(variant, split)
    src = _resolve(Path(root), layout)
    batch_names: tuple[str, ...] = getattr(layout, split)
    blobs = {name: (display, blob) for name, display, blob in _read_all(src, (*batch_names, layout.meta))}

    meta_display, meta_blob = blobs[layout.meta]
    meta = _str_keys(restricted_loads(meta_blob, meta_display), meta_display, "meta")
    for key in (layout.names_key, *(("coarse_label_names",) if variant == "cifar100" else ())):
        if key not in meta:
            raise CifarFormatError(f"{meta_display}: missing key {key!r} (found {sorted(meta)})")
    classes = _names(meta[layout.names_key], meta_display, layout.names_key, layout.n_classes)
    coarse_classes = _names(meta["coarse_label_names"], meta_display, "coarse_label_names", _N_COARSE) \
        if variant == "cifar100" else None

    datas: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    coarse: list[np.ndarray] = []
    keys: list[str] = []
    for name in batch_names:
        display, blob = blobs[name]
        batch = _str_keys(restricted_loads(blob, display), display, "batch")
        needed = ("data", layout.label_key, *(("coarse_labels",) if variant == "cifar100" else ()))
        missing = [k for k in needed if k not in batch]
        if missing:
            raise CifarFormatError(f"{display}: missing key(s) {missing} (expected {list(needed)}, found "
                                   f"{sorted(batch)})")
        data = _data(batch["data"], display)
        n = data.shape[0]
        datas.append(data)
        labels.append(_labels(batch[layout.label_key], display, layout.label_key, n, layout.n_classes))
        if variant == "cifar100":
            coarse.append(_labels(batch["coarse_labels"], display, "coarse_labels", n, _N_COARSE))
        keys.extend(f"{name}#{i}" for i in range(n))

    rows = np.concatenate(datas) if len(datas) > 1 else datas[0]
    images = np.ascontiguousarray(rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return CifarSplit(variant=variant, split=split, images=images, labels=np.concatenate(labels),
                      coarse_labels=np.concatenate(coarse) if variant == "cifar100" else None, classes=classes,
                      coarse_classes=coarse_classes, files=[blobs[n][0] for n in batch_names], keys=keys)
