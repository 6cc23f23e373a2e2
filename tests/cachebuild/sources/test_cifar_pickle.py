"""The CIFAR reader against torchvision, on py2-faithful batches made by cachebuild.samples."""

from __future__ import annotations

import io
import pickle
import pickletools
import shutil
import tarfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torchvision.datasets as tvd

from cachebuild.errors import OptionError
from cachebuild.sources.cifar_pickle import (
    CifarFormatError,
    CifarNotFoundError,
    CifarUnsafePickleError,
    load_cifar_split,
)
from support.cifar_layout import py2_pickle_dumps
from tests.cifar_files import write_cifar10, write_cifar100


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("cifar")
    c10 = write_cifar10(root, n_train=103, n_test=40, seed=3, tar_gz=True)  # uneven batches on purpose
    c100 = write_cifar100(root, n_train=150, n_test=60, seed=4, tar_gz=True)
    return root, c10, c100


def _torchvision(cls: type, root: Path, train: bool):
    # torchvision checks the md5 of the real downloads; ours are different bytes of the same layout.
    with (
        mock.patch.object(cls, "_check_integrity", return_value=True),
        mock.patch("torchvision.datasets.cifar.check_integrity", return_value=True),
    ):
        return cls(str(root), train=train, download=False)


def _copy_batches(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------- equality


@pytest.mark.parametrize("train", [True, False])
def test_cifar10_equals_torchvision(cifar_root, train: bool) -> None:
    root, c10, _ = cifar_root
    ref = _torchvision(tvd.CIFAR10, root, train)
    split = "train" if train else "test"
    for src in (root, root / "cifar-10-batches-py", root / "cifar-10-python.tar.gz"):
        got = load_cifar_split(src, "cifar10", split)
        assert got.images.dtype == np.uint8 and got.images.shape == ref.data.shape
        assert got.images.tobytes() == np.ascontiguousarray(ref.data).tobytes()
        assert got.images.flags.c_contiguous
        assert got.labels.dtype == np.int64
        np.testing.assert_array_equal(got.labels, np.asarray(ref.targets))
        assert got.classes == ref.classes
        assert got.coarse_labels is None and got.coarse_classes is None
        assert len(got) == len(ref) == len(got.keys)
    np.testing.assert_array_equal(got.images, c10[f"{split}_images"])


@pytest.mark.parametrize("train", [True, False])
def test_cifar100_equals_torchvision(cifar_root, train: bool) -> None:
    root, _, c100 = cifar_root
    ref = _torchvision(tvd.CIFAR100, root, train)
    split = "train" if train else "test"
    for src in (root, root / "cifar-100-python", root / "cifar-100-python.tar.gz"):
        got = load_cifar_split(src, "cifar100", split)
        assert got.images.tobytes() == np.ascontiguousarray(ref.data).tobytes()
        np.testing.assert_array_equal(got.labels, np.asarray(ref.targets))
        assert got.classes == ref.classes
        np.testing.assert_array_equal(got.coarse_labels, c100[f"{split}_coarse_labels"])
        assert got.coarse_classes is not None and len(got.coarse_classes) == 20


def test_folder_holding_only_the_archive(cifar_root, tmp_path: Path) -> None:
    root, c10, _ = cifar_root
    shutil.copy(root / "cifar-10-python.tar.gz", tmp_path)
    got = load_cifar_split(tmp_path, "cifar10", "test")
    np.testing.assert_array_equal(got.images, c10["test_images"])
    assert got.files == [f"{tmp_path / 'cifar-10-python.tar.gz'}::cifar-10-batches-py/test_batch"]


def test_provenance_and_source_files(cifar_root) -> None:
    root, _, _ = cifar_root
    got = load_cifar_split(root, "cifar10", "train")
    folder = root / "cifar-10-batches-py"
    assert got.files == [str(folder / f"data_batch_{i}") for i in range(1, 6)]
    # 103 samples over 5 batches: 21, 21, 21, 20, 20
    assert got.keys[0] == "data_batch_1#0" and got.keys[21] == "data_batch_2#0"
    assert got.keys[-1] == "data_batch_5#19"
    assert len(set(got.keys)) == len(got.keys) == 103


# ---------------------------------------------------------------------------------------- faithfulness


def test_batches_are_python2_protocol2_pickles(cifar_root) -> None:
    root, _, _ = cifar_root
    for path in [
        *(root / "cifar-10-batches-py").glob("*_batch*"),
        root / "cifar-10-batches-py/batches.meta",
        *(root / "cifar-100-python").iterdir(),
    ]:
        raw = path.read_bytes()
        ops = list(pickletools.genops(raw))
        names = {op.name for op, _, _ in ops}
        assert ops[0][0].name == "PROTO" and ops[0][1] == 2, path
        assert not names & {
            "BINUNICODE",
            "SHORT_BINUNICODE",
            "UNICODE",
            "BINUNICODE8",
            "STACK_GLOBAL",
            "FRAME",
            "BINBYTES",
            "SHORT_BINBYTES",
        }, path
        assert "SHORT_BINSTRING" in names, path
        pickletools.dis(raw, out=io.StringIO())  # well-formed: dis checks the stack and memo
        if path.name in ("batches.meta", "meta"):
            continue
        globals_ = {arg for op, arg, _ in ops if op.name == "GLOBAL"}
        assert globals_ == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}, path
        assert "BINSTRING" in names, path  # the pixel bytes, one py2 str
        # What Python 3 sees with latin1 decoding, as torchvision reads them.
        batch = pickle.loads(raw, encoding="latin1")
        assert isinstance(batch["data"], np.ndarray) and batch["data"].dtype == np.uint8
        assert batch["data"].shape[1] == 3072 and batch["data"].flags.c_contiguous
        label_key = "labels" if "labels" in batch else "fine_labels"
        assert type(batch[label_key]) is list and all(type(v) is int for v in batch[label_key])
        assert isinstance(batch["batch_label"], str)
        assert all(f.endswith(".png") for f in batch["filenames"])
    raw = (root / "cifar-10-batches-py/data_batch_1").read_bytes()
    assert list(pickle.loads(raw, encoding="latin1")) == ["batch_label", "labels", "data", "filenames"]
    # Python 3's bytes view of the same file, as `encoding="bytes"` users see it.
    assert set(pickle.loads(raw, encoding="bytes")) == {b"batch_label", b"labels", b"data", b"filenames"}


def test_data_rows_are_chw_planes(cifar_root) -> None:
    root, c10, _ = cifar_root
    batch = pickle.loads((root / "cifar-10-batches-py/test_batch").read_bytes(), encoding="latin1")
    img = c10["test_images"][0]
    np.testing.assert_array_equal(batch["data"][0, :1024], img[..., 0].ravel())  # R plane, row-major
    np.testing.assert_array_equal(batch["data"][0, 2048:], img[..., 2].ravel())  # B plane


def test_python3_pickled_batches_load(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(7, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7).tolist()
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    names = [f"c{i}" for i in range(10)]
    for protocol in (2, 4, 5):
        for i in range(1, 6):
            batch = {"batch_label": "x", "labels": labels, "data": data, "filenames": ["a.png"] * 7}
            if i == 2:  # numpy int labels pickle through numpy's multiarray.scalar
                batch["labels"] = [np.int64(v) for v in labels]
            if i == 3:  # keys as bytes, as a re-dump of an encoding="bytes" load has them
                batch = {k.encode(): v for k, v in batch.items()}
            (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=protocol))
        meta = {"label_names": names, "num_cases_per_batch": 7, "num_vis": 3072}
        (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=protocol))
        got = load_cifar_split(tmp_path, "cifar10", "train")
        assert got.images.shape == (35, 32, 32, 3)
        np.testing.assert_array_equal(got.images[:7], data.reshape(7, 3, 32, 32).transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(got.labels, np.tile(labels, 5))
        assert got.classes == names


# ---------------------------------------------------------------------------------------- safety


class _Evil:
    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def test_malicious_pickle_is_refused_and_runs_nothing(cifar_root, tmp_path: Path) -> None:
    root, _, _ = cifar_root
    folder = _copy_batches(root / "cifar-10-batches-py", tmp_path / "cifar-10-batches-py")
    sentinel = tmp_path / "pwned"
    evil = pickle.dumps({"data": _Evil(open, str(sentinel), "w"), "labels": []}, protocol=2)
    # The crafted file is real: an unrestricted load creates the sentinel.
    pickle.loads(evil).get("data").close()
    assert sentinel.exists()
    sentinel.unlink()

    (folder / "data_batch_3").write_bytes(evil)
    refused = r"data_batch_3: refusing to load global io\.open"
    with pytest.raises(CifarUnsafePickleError, match=refused) as info:
        load_cifar_split(tmp_path, "cifar10", "train")
    assert isinstance(info.value, ValueError)
    assert not sentinel.exists()

    import os

    (folder / "data_batch_3").write_bytes(pickle.dumps({"data": _Evil(os.system, f"touch {sentinel}")}, 0))
    with pytest.raises(CifarUnsafePickleError, match=r"data_batch_3.*system"):
        load_cifar_split(folder, "cifar10", "train")
    assert not sentinel.exists()

    (folder / "batches.meta").write_bytes(pickle.dumps(_Evil(eval, "1"), 4))
    with pytest.raises(CifarUnsafePickleError, match=r"batches\.meta.*builtins\.eval"):
        load_cifar_split(folder, "cifar10", "test")


def test_tar_links_are_not_followed(cifar_root, tmp_path: Path) -> None:
    root, _, _ = cifar_root
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(root / "cifar-10-python.tar.gz") as src, tarfile.open(archive, "w:gz") as dst:
        for m in src.getmembers():
            if m.name.endswith("/test_batch"):
                link = tarfile.TarInfo(m.name)
                link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
                dst.addfile(link)
            else:
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    with pytest.raises(CifarFormatError, match=r"test_batch: expected a regular file member"):
        load_cifar_split(archive, "cifar10", "test")
    assert len(load_cifar_split(archive, "cifar10", "train")) == 103


# ---------------------------------------------------------------------------------------- errors


def test_missing_root_and_files(cifar_root, tmp_path: Path) -> None:
    root, _, _ = cifar_root
    with pytest.raises(CifarNotFoundError, match="no such folder") as info:
        load_cifar_split(tmp_path / "nope", "cifar10", "train")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    with pytest.raises(CifarNotFoundError, match="found neither cifar-100-python"):
        load_cifar_split(tmp_path, "cifar100", "train")
    folder = _copy_batches(root / "cifar-10-batches-py", tmp_path / "cifar-10-batches-py")
    (folder / "data_batch_4").unlink()
    with pytest.raises(CifarNotFoundError, match=r"data_batch_4: batch file missing"):
        load_cifar_split(tmp_path, "cifar10", "train")
    with pytest.raises(OptionError, match="variant must be one of"):
        load_cifar_split(tmp_path, "cifar20", "train")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="split must be"):
        load_cifar_split(tmp_path, "cifar10", "val")  # type: ignore[arg-type]


def _rewrite(folder: Path, name: str, **changes) -> None:
    batch = pickle.loads((folder / name).read_bytes(), encoding="latin1")
    batch.update(changes)
    (folder / name).write_bytes(py2_pickle_dumps(batch))


def test_bad_contents_are_named(cifar_root, tmp_path: Path) -> None:
    root, _, _ = cifar_root
    folder = _copy_batches(root / "cifar-10-batches-py", tmp_path / "cifar-10-batches-py")
    good = (folder / "test_batch").read_bytes()

    _rewrite(folder, "test_batch", data=np.zeros((40, 3000), np.uint8))
    with pytest.raises(
        CifarFormatError,
        match=r"test_batch: expected 'data' of shape \(N, 3072\) uint8.*"
        r"got shape \(40, 3000\)",
    ):
        load_cifar_split(folder, "cifar10", "test")

    (folder / "test_batch").write_bytes(good)
    _rewrite(folder, "test_batch", labels=[0] * 39)
    with pytest.raises(CifarFormatError, match=r"test_batch: 'labels' holds 39 labels but 'data' holds 40"):
        load_cifar_split(folder, "cifar10", "test")

    (folder / "test_batch").write_bytes(good)
    _rewrite(folder, "test_batch", labels=[10] * 40)
    with pytest.raises(CifarFormatError, match=r"values must be in \[0, 10\), got \[10, 10\]"):
        load_cifar_split(folder, "cifar10", "test")

    (folder / "test_batch").write_bytes(good[: len(good) // 2])
    with pytest.raises(CifarFormatError, match=r"test_batch: not a readable CIFAR pickle"):
        load_cifar_split(folder, "cifar10", "test")

    (folder / "test_batch").write_bytes(good)
    meta = pickle.loads((folder / "batches.meta").read_bytes(), encoding="latin1")
    (folder / "batches.meta").write_bytes(py2_pickle_dumps({**meta, "label_names": meta["label_names"][:9]}))
    with pytest.raises(
        CifarFormatError, match=r"batches\.meta: expected 'label_names' to hold 10 strings, got 9"
    ):
        load_cifar_split(folder, "cifar10", "test")
