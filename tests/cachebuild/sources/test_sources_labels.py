"""Labels, order and sample sets that must not depend on how a source is named or where it is served from."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torchvision
from PIL import Image

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.errors import SourceError
from cachebuild.samples.imagenet_layout import write_imagenet
from cachebuild.samples.photos import photo_bank, render_sample
from cachebuild.sources.folder import folder_plan
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache

# Class names as users name them: sorted by code point, 'cafz' < 'café', but percent-encoded (as HTTP index
# pages link them) 'caf%C3%A9' < 'cafz': a plan of the encoded names swaps the two classes' labels.
ODD_CLASSES = ("café", "cafz", "a b", "a!b", "100%", "x#y")


def _write_tree(root: Path, classes: tuple[str, ...], per_class: int = 2, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    bank = photo_bank()
    for k, cls in enumerate(classes):
        for j in range(per_class):
            path = root / cls / ("sub" if j % 2 else "") / f"img {j}#{k}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            Image.fromarray(render_sample(bank, k, 96, 80, rng)).save(buf, format="JPEG", quality=90)
            path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("where", ["http", "s3"])
def test_a_class_tree_at_a_url_plans_and_builds_like_its_local_copy(tmp_path, where, request):
    site = tmp_path / "site" / "train"
    _write_tree(site, ODD_CLASSES)
    ref = torchvision.datasets.ImageFolder(str(site), loader=lambda p: p)
    # A cache built inside the tree (allowed: SRC/.cachebuild/), then uploaded with it: not a class.
    local_cache = build(folder_plan(site), site / ".cachebuild" / "c", BuildOptions(size=32, jobs=1))
    (site / ".cachebuild" / "preview.jpg").write_bytes((site / "cafz" / "img 0#1.jpg").read_bytes())
    local = folder_plan(site)
    assert local.classes == ref.classes and local.labels.tolist() == ref.targets
    if where == "http":
        url = request.getfixturevalue("http_server")(tmp_path / "site").url_for("train")
    else:
        s3 = request.getfixturevalue("s3")
        s3.fs.put(str(site), s3.url("data/train"), recursive=True)
        url = s3.url("data/train")
    remote = folder_plan(url)
    assert remote.classes == local.classes
    assert list(remote.keys) == list(local.keys) and remote.labels.tolist() == local.labels.tolist()
    got = build(remote, tmp_path / "remote", BuildOptions(size=32, jobs=1))
    a, b = open_cache(local_cache.path), open_cache(got.path)
    assert not b.manifest.failures and a.paths() == b.paths() and np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.gather(np.arange(len(a))), b.gather(np.arange(len(b))))


@pytest.mark.parametrize("layout", ["folders", "devkit", "kaggle"])
def test_the_val_folder_alone_is_labelled_like_the_root(tmp_path, layout):
    """``cachebuild imagenet ROOT/val`` numbers the classes as ``cachebuild imagenet ROOT`` does, by train/ beside
    it: a val without some class must not shift the labels of the classes after it."""
    info = write_imagenet(tmp_path, n_classes=4, train_per_class=1, val_per_class=2, val_layout=layout, seed=4)
    first = info["wnids"][0]
    if layout == "folders":
        shutil.rmtree(info["val_dir"] / first)
    else:
        for e in info["val"]:
            if e["wnid"] == first:
                Path(e["path"]).unlink()
        if layout == "kaggle":
            (tmp_path / "LOC_synset_mapping.txt").unlink()  # classes from the CSV rows, as without the mapping
            csv = tmp_path / "LOC_val_solution.csv"
            csv.write_text("".join(ln for ln in csv.read_text().splitlines(True) if first not in ln))
    by_root = imagenet_plans(tmp_path, "val")[0]
    alone = imagenet_plans(info["val_dir"])[0]
    truth = {Path(e["path"]).name: e["label"] for e in info["val"] if e["wnid"] != first}
    assert by_root.classes == alone.classes == info["wnids"]
    assert [truth[Path(k).name] for k in by_root.keys] == by_root.labels.tolist() == alone.labels.tolist()


@pytest.mark.parametrize("with_train", [True, False])
def test_stray_folders_in_a_flat_val_are_not_classes(tmp_path, with_train, caplog):
    """A flat val with ``__MACOSX/`` (unzipped on a Mac, AppleDouble ``._*.JPEG`` inside) or Jupyter's
    ``.ipynb_checkpoints/`` is still the flat val, labelled by its ground truth."""
    info = write_imagenet(tmp_path, n_classes=3, train_per_class=1, val_per_class=2, val_layout="devkit", seed=5)
    if not with_train:
        shutil.rmtree(info["train_dir"])
    (info["val_dir"] / "__MACOSX").mkdir()
    (info["val_dir"] / "__MACOSX" / "._ILSVRC2012_val_00000001.JPEG").write_bytes(b"\x00\x05\x16\x07")
    (info["val_dir"] / ".ipynb_checkpoints").mkdir()
    plan = imagenet_plans(tmp_path, "val")[0]
    truth = {Path(e["path"]).name: e["label"] for e in info["val"]}
    assert [Path(k).name for k in plan.keys] == sorted(truth)
    assert plan.labels.tolist() == [truth[Path(k).name] for k in plan.keys] and plan.classes == info["wnids"]
    assert "__MACOSX" in caplog.text


def test_a_half_sorted_val_is_an_error_not_a_subset(tmp_path):
    info = write_imagenet(tmp_path, n_classes=3, train_per_class=1, val_per_class=2, val_layout="devkit", seed=6)
    e = info["val"][0]
    (info["val_dir"] / e["wnid"]).mkdir()
    Path(e["path"]).rename(info["val_dir"] / e["wnid"] / Path(e["path"]).name)
    with pytest.raises(SourceError, match=r"holds both 5 images and class folders \(n0"):
        imagenet_plans(tmp_path, "val")


@pytest.mark.parametrize("named", ["root", "CLS-LOC", "val"])
def test_kaggle_tree_finds_its_labels_from_any_level(tmp_path, named):
    info = write_imagenet(tmp_path, n_classes=3, train_per_class=1, val_per_class=2, val_layout="kaggle", seed=7,
                          kaggle_tree=True)
    src = {"root": tmp_path, "CLS-LOC": tmp_path / "ILSVRC" / "Data" / "CLS-LOC", "val": info["val_dir"]}[named]
    val = imagenet_plans(src, "val")[0]
    truth = {Path(e["path"]).name: e["label"] for e in info["val"]}
    assert val.labels.tolist() == [truth[Path(k).name] for k in val.keys] and len(val) == len(truth)


def test_url_shards_with_odd_names_plan_in_the_local_order(wds_set, http_server, tmp_path):
    """Shard names sort (and read in provenance) as on disk, not as their percent-encoded links: 'aé' after 'az'."""
    from cachebuild.sources.shards.wds import wds_plan

    site = tmp_path / "site" / "ds"
    site.mkdir(parents=True)
    for shard, name in zip(wds_set["shards"][:3], ("a b-train-0.tar", "aé-train-1.tar", "az-train-2.tar"),
                           strict=True):
        shutil.copy(shard, site / name)
    local = wds_plan(site)
    remote = wds_plan(http_server(tmp_path / "site").url_for("ds") + "/")
    assert [k.split("#")[0] for k in local.keys][-1] == "aé-train-1.tar"
    assert list(remote.keys) == list(local.keys) and remote.labels.tolist() == local.labels.tolist()
    got = build(remote, tmp_path / "remote", BuildOptions(size=32, jobs=1))
    want = build(local, tmp_path / "local", BuildOptions(size=32, jobs=1))
    a, b = open_cache(want.path), open_cache(got.path)
    assert a.paths() == b.paths() and np.array_equal(a.gather(np.arange(len(a))), b.gather(np.arange(len(b))))
