"""Plans and labels equal torchvision's readers on the same files, in every real layout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torchvision

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.errors import SourceError
from cachebuild.samples.imagenet_layout import write_imagenet
from cachebuild.sources.cifar import cifar_plans
from cachebuild.sources.folder import folder_plan
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache
from support.archive import write_tar_gz
from tests.cifar_files import write_cifar10, write_cifar100


def test_folder_order_and_labels_equal_imagefolder(tmp_path):
    # Class names whose sorted order differs from sorted path order ('a' < 'a-b' but 'a-b/' < 'a/').
    for cls in ("a", "a-b", "B", "c"):
        (tmp_path / cls / "sub").mkdir(parents=True)
        for name in ("z.jpg", "A.JPEG", "m.png", "sub/q.jpeg", "notes.txt"):
            (tmp_path / cls / name).write_bytes(b"x")
    plan = folder_plan(tmp_path)
    ref = torchvision.datasets.ImageFolder(str(tmp_path), loader=lambda p: p)
    assert plan.classes == ref.classes
    assert [str(tmp_path / k) for k in plan.keys] == [p for p, _ in ref.samples]
    assert plan.labels.tolist() == ref.targets


def test_imagenet_train_labels_equal_imagefolder(imagenet_tree):
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    ref = torchvision.datasets.ImageFolder(str(imagenet_tree["train_dir"]), loader=lambda p: p)
    assert plan.classes == ref.classes
    assert [str(Path(plan.root) / k) for k in plan.keys] == [p for p, _ in ref.samples]
    assert plan.labels.tolist() == ref.targets


@pytest.mark.parametrize("layout,kaggle_tree,devkit_tar", [
    ("devkit", False, False), ("devkit", False, True), ("kaggle", False, False), ("kaggle", True, False),
])
def test_flat_val_is_labelled_like_the_folder_layout(tmp_path, layout, kaggle_tree, devkit_tar):
    info = write_imagenet(tmp_path, n_classes=4, train_per_class=2, val_per_class=3, val_layout=layout,
                          seed=3, kaggle_tree=kaggle_tree)
    if devkit_tar:  # only the archive, as downloaded
        import shutil

        write_tar_gz(tmp_path / "ILSVRC2012_devkit_t12", tmp_path / "ILSVRC2012_devkit_t12.tar.gz")
        shutil.rmtree(tmp_path / "ILSVRC2012_devkit_t12")
    train, val = imagenet_plans(tmp_path)
    assert val.split == "val" and val.classes == train.classes == sorted(info["wnids"])
    truth = {Path(e["path"]).name: e["label"] for e in info["val"]}
    assert val.labels.tolist() == [truth[Path(k).name] for k in val.keys]
    assert [Path(k).name for k in val.keys] == sorted(truth)
    # One split folder passed directly finds its labels beside it.
    only_val = imagenet_plans(info["val_dir"])[0]
    assert only_val.labels.tolist() == val.labels.tolist()


def test_flat_val_without_labels_is_a_clear_error(tmp_path):
    info = write_imagenet(tmp_path, n_classes=2, train_per_class=1, val_per_class=1, val_layout="devkit", seed=0)
    import shutil

    shutil.rmtree(Path(info["root"]) / "ILSVRC2012_devkit_t12")
    with pytest.raises(SourceError, match="no labels were found"):
        imagenet_plans(tmp_path, "val")


def test_a_devkit_labelled_val_without_scipy_names_the_extra(tmp_path, monkeypatch):
    write_imagenet(tmp_path, n_classes=2, train_per_class=1, val_per_class=1, val_layout="devkit", seed=0)
    monkeypatch.setitem(sys.modules, "scipy.io", None)  # as if not installed: the real guard runs
    with pytest.raises(SourceError) as e:
        imagenet_plans(tmp_path, "val")
    assert str(e.value) == (f"{tmp_path / 'ILSVRC2012_devkit_t12'}: the devkit's meta.mat is read with scipy, which "
                            f"labels a flat val/: pip install 'cachebuild[scipy]'")
    assert imagenet_plans(tmp_path, "train")[0].keys  # class folders need no scipy


def test_unknown_layouts_and_missing_sources(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        imagenet_plans(tmp_path / "nope")
    (tmp_path / "photos").mkdir()
    with pytest.raises(SourceError, match="not an ImageNet layout"):
        imagenet_plans(tmp_path / "photos")
    (tmp_path / "photos" / "cat").mkdir()
    with pytest.raises(SourceError, match="no image files"):
        folder_plan(tmp_path / "photos")
    with pytest.raises(SourceError):
        cifar_plans(tmp_path / "photos", "cifar10")


@pytest.mark.parametrize("variant,writer,tv", [
    ("cifar10", write_cifar10, torchvision.datasets.CIFAR10),
    ("cifar100", write_cifar100, torchvision.datasets.CIFAR100),
])
@pytest.mark.parametrize("from_tar", [False, True])
def test_cifar_cache_equals_torchvision(tmp_path, monkeypatch, variant, writer, tv, from_tar):
    info = writer(tmp_path / "src", n_train=300, n_test=60, seed=5, tar_gz=from_tar)
    # torchvision checks the md5s of the real files: ours are faithful in format, not in bytes.
    monkeypatch.setattr(tv, "_check_integrity", lambda self: True)
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *a, **k: True)
    src = info["archive"] if from_tar else tmp_path / "src"
    for split in ("train", "test"):
        plan = cifar_plans(src, variant, split)[0]
        cache = build(plan, tmp_path / "cache" / split, BuildOptions(size=32, jobs=1, block_size=128))
        c = open_cache(cache.path)
        ref = tv(str(tmp_path / "src"), train=split == "train", download=False)
        assert np.array_equal(c.gather(np.arange(len(c))), ref.data)  # byte for byte at native size
        assert c.labels.tolist() == list(ref.targets)
        assert list(c.manifest.classes) == ref.classes
        if variant == "cifar100":
            expected = info[f"{split}_coarse_labels"]
            assert np.array_equal(c.array("coarse_labels"), expected)
            assert c.manifest.extra["coarse_classes"] == list(info["coarse_classes"])
        assert c.paths()[0].endswith("#0")


def test_file_reader_reads_to_the_end_and_keeps_its_limit(tmp_path):
    """The reader sizes its read by the stat but reads on to the end: a file whose content outgrows
    its stat (procfs files stat at 0 bytes, like a file growing while it is read) is read whole, and
    the byte limit still holds past the stat."""
    from cachebuild.errors import DecodeError
    from cachebuild.sources.plan import FileReader

    status = FileReader("/proc/self")(0, "status")
    assert os.stat("/proc/self/status").st_size == 0 and status.startswith(b"Name:") and b"VmRSS" in status
    with pytest.raises(DecodeError, match="over 64 bytes, the limit for one image file"):
        FileReader("/proc/self", max_bytes=64)(0, "status")
    (tmp_path / "a.jpg").write_bytes(b"x" * 64)
    assert FileReader(str(tmp_path), max_bytes=64)(0, "a.jpg") == b"x" * 64


def test_the_source_digest_is_the_row_by_row_sha256_across_stretches() -> None:
    """digest_stats hashes rows a stretch at a time; the digest (in every cache's manifest) must stay the
    sha256 of one row after another: a wrong join, a lost row at a stretch's edge or another encoding of an
    undecodable name would change every cache's fingerprint."""
    import hashlib
    import json

    from cachebuild.sources.plan import _DIGEST_STRETCH, digest_stats

    n = 2 * _DIGEST_STRETCH + 7
    keys = [f"n{i % 977:08d}/img_{i}.JPEG" for i in range(n)]
    keys[_DIGEST_STRETCH] = "n1/caf\udce9.jpg"  # a name that was not UTF-8 on disk, at a stretch's start
    labels = np.arange(n, dtype=np.int64) % 1000
    stats = np.stack([np.arange(n) * 3 + 1, np.arange(n) * 1_000_000_007], axis=1).astype(np.int64)
    stats[5] = (-1, -1)  # a dangling link
    h = hashlib.sha256(json.dumps({"classes": ["a"]}, sort_keys=True).encode())
    for key, label, (size, mtime) in zip(keys, labels.tolist(), stats.tolist(), strict=True):
        meta = "missing" if size < 0 else f"{size}:{mtime}"
        h.update(f"{key}\0{label}\0{meta}\n".encode("utf-8", "surrogateescape"))
    assert digest_stats(keys, labels, stats, {"classes": ["a"]}) == h.hexdigest()
    with pytest.raises(ValueError, match="one each"):
        digest_stats(keys, labels[:-1], stats)


def test_a_local_tree_plans_without_the_url_side(imagenet_tree):
    """A local build's parent never imports fsspec's side of the storage layer (asyncio, ssl, the retries)."""
    import subprocess

    code = ("import sys; from cachebuild.sources.registry import plan_source; "
            f"plan_source('folder', {str(imagenet_tree['train_dir'])!r}); "
            "print('cachebuild.storage.locations.url' in sys.modules, 'fsspec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
