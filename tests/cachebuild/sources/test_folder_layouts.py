"""The class-folder source on the layouts users point it at: a root of split folders (train/, val/: what PyTorch's
imagenet/main.py reads) builds each split, numbered by train's classes; an empty class folder is refused, as
torchvision's ImageFolder refuses it, unless --allow-empty keeps it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torchvision
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import SourceError
from cachebuild.sources.folder import FolderOptions, folder_plan
from cachebuild.sources.registry import plan_source, replan
from cachebuild.storage.cache import open_cache


def _cli(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def _jpeg(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.full((20, 28, 3), value, np.uint8)
    img[::3, ::2] = 255 - value  # some texture, so each file is its own picture
    path.write_bytes(cv2.imencode(".jpg", img)[1].tobytes())


def _split_root(root: Path) -> Path:
    """train/ with classes a, b, c; val/ with a and c only (a val missing a class must not renumber c)."""
    for split, classes in (("train", "abc"), ("val", "ac")):
        for k, cls in enumerate(classes):
            for i in range(3 if split == "train" else 2):
                _jpeg(root / split / cls / f"{i}.jpg", 40 * k + 10 * i)
    return root


def _imagefolder(root: Path, classes: list[str] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    ds = torchvision.datasets.ImageFolder(str(root), loader=lambda p: p)
    if classes is None:
        return ds.classes, ds.samples
    index = {c: i for i, c in enumerate(classes)}
    return classes, [(p, index[ds.classes[t]]) for p, t in ds.samples]


def test_a_root_of_split_folders_builds_each_split_numbered_by_train(tmp_path):
    src = _split_root(tmp_path / "ds")
    r = _cli("folder", src, "--size", "16", "--out", tmp_path / "c", "-j", "1", "--no-progress")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if p.is_dir()) == ["train", "val"]
    train_classes, train_samples = _imagefolder(src / "train")
    for split, samples in (("train", train_samples), ("val", _imagefolder(src / "val", train_classes)[1])):
        cache = open_cache(tmp_path / "c" / split)
        assert list(cache.manifest.classes) == train_classes == ["a", "b", "c"]
        assert (cache.manifest.dataset, cache.manifest.split) == ("ds", split)
        assert [str(src / split / p) for p in cache.paths()] == [p for p, _ in samples]
        assert cache.labels.tolist() == [t for _, t in samples]  # val's c is 2, as in train, not 1
        assert cache.manifest.source["recipe"]["split"] == split
    # status plans each split again from its recipe: up to date
    for split in ("train", "val"):
        r = _cli("status", tmp_path / "c" / split)
        assert r.exit_code == 0 and "up to date" in r.output, r.output


def test_split_names_one_split_of_a_root_of_split_folders(tmp_path):
    src = _split_root(tmp_path / "ds")
    plans = plan_source("folder", src, FolderOptions(split="val"))
    assert [(p.split, p.classes) for p in plans] == [("val", ["a", "b", "c"])]
    assert Path(plans[0].root) == src / "val" and plans[0].labels.tolist() == [0, 0, 2, 2]
    assert replan(plans[0].recipe, None, []).source_digest == plans[0].source_digest
    with pytest.raises(SourceError, match=r"holds the split folders train, val.*--split test"):
        plan_source("folder", src, FolderOptions(split="test"))


def test_a_plain_class_tree_keeps_its_classes_and_its_split_name(tmp_path):
    src = _split_root(tmp_path / "ds") / "train"
    (plan,) = plan_source("folder", src)
    assert (plan.split, plan.classes, plan.dataset) == ("train", ["a", "b", "c"], "train")
    (named,) = plan_source("folder", src, FolderOptions(split="holdout"))
    assert named.split == "holdout"
    # class folders that hold images directly are classes, whatever their names
    flat = tmp_path / "flat"
    for k, cls in enumerate(("train", "val")):
        _jpeg(flat / cls / "0.jpg", 50 * k)
    (plan,) = plan_source("folder", flat)
    assert plan.classes == _imagefolder(flat)[0] == ["train", "val"]


def test_split_folders_beside_other_folders_are_refused_naming_both(tmp_path):
    src = _split_root(tmp_path / "ds")
    _jpeg(src / "extra" / "x" / "0.jpg", 7)
    r = _cli("folder", src, "--size", "16", "--out", tmp_path / "c", "-j", "1")
    assert r.exit_code != 0 and not (tmp_path / "c").exists()
    line = r.output.strip().splitlines()[-1]
    assert "split folders train, val" in line and "extra" in line and str(src / "train") in line, line
    # an ImageNet-style flat val/ beside train/ is not a split of class folders: named too
    shutil.rmtree(src / "extra")
    shutil.rmtree(src / "val")
    _jpeg(src / "val" / "ILSVRC2012_val_00000001.JPEG", 3)
    with pytest.raises(SourceError, match=r"val.*no class folders.*cachebuild imagenet"):
        plan_source("folder", src)


def test_an_empty_class_folder_is_refused_as_imagefolder_refuses_it(tmp_path):
    src = _split_root(tmp_path / "ds") / "train"
    (src / "zebra").mkdir()
    (src / "okapi").mkdir()
    (src / "okapi" / "notes.txt").write_text("no images here")
    with pytest.raises(FileNotFoundError, match="okapi, zebra"):
        torchvision.datasets.ImageFolder(str(src))  # the oracle
    r = _cli("folder", src, "--size", "16", "--out", tmp_path / "c", "-j", "1")
    assert r.exit_code != 0 and not (tmp_path / "c").exists()
    line = r.output.strip().splitlines()[-1]
    assert str(src / "okapi") in line and str(src / "zebra") in line and "--allow-empty" in line, line
    # --allow-empty keeps them as classes without samples, numbered as ImageFolder(allow_empty=True) does
    ref = torchvision.datasets.ImageFolder(str(src), loader=lambda p: p, allow_empty=True)
    r = _cli("folder", src, "--size", "16", "--out", tmp_path / "c", "-j", "1", "--allow-empty")
    assert r.exit_code == 0, r.output
    cache = open_cache(tmp_path / "c" / "train")
    assert list(cache.manifest.classes) == ref.classes == ["a", "b", "c", "okapi", "zebra"]
    assert cache.labels.tolist() == ref.targets
    assert cache.manifest.source["recipe"]["allow_empty"] is True
    r = _cli("status", tmp_path / "c" / "train")
    assert r.exit_code == 0, r.output


def test_an_empty_class_of_a_split_is_refused_naming_it(tmp_path):
    src = _split_root(tmp_path / "ds")
    (src / "val" / "b").mkdir()  # val has a folder for b, and nothing in it
    with pytest.raises(SourceError, match=r"val/b.*no image files"):
        plan_source("folder", src)
    with pytest.raises(SourceError, match=r"no image files"):
        folder_plan(src / "val", classes=["a", "b", "c"])
    plans = plan_source("folder", src, FolderOptions(allow_empty=True))
    assert [p.labels.tolist() for p in plans] == [[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 2, 2]]


def test_the_recipe_records_the_options_of_the_layout(tmp_path):
    src = _split_root(tmp_path / "ds")
    train, val = plan_source("folder", src)
    assert [train.recipe["split"], val.recipe["split"]] == ["train", "val"]
    assert train.recipe["allow_empty"] is False and json.loads(json.dumps(val.recipe)) == val.recipe


def test_a_root_of_split_folders_at_a_url_plans_as_its_local_copy(tmp_path, http_server):
    """The same rule over a listing: a URL holding train/ and val/ plans each split as the local root does
    (classes, keys, labels), and an empty class (a folder of no image file) is refused there too."""
    src = _split_root(tmp_path / "site" / "ds")
    url = http_server(tmp_path / "site").url_for("ds")
    local = plan_source("folder", src)
    remote = plan_source("folder", url)
    assert [(p.split, p.classes, list(p.keys), p.labels.tolist()) for p in remote] == \
        [(p.split, p.classes, list(p.keys), p.labels.tolist()) for p in local]
    assert [p.recipe["split"] for p in remote] == ["train", "val"] and remote[1].root == f"{url.rstrip('/')}/val"
    (src / "val" / "b").mkdir()
    (src / "val" / "b" / "notes.txt").write_text("no image")
    with pytest.raises(SourceError, match=r"val/b.*no image files"):
        plan_source("folder", url)
