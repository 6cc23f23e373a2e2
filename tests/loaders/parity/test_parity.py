"""``cachebuild parity``: a faithful cache passes; a cache whose manifest lies about its recipe, a source with
files swapped between classes or changed, and a crop distribution off by a little each fail their check;
bad input exits 2."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from cachebuild.atomic import write_bytes_atomic
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.format.manifest import MANIFEST_NAME, manifest_bytes
from cachebuild.samples.imagenet_layout import write_imagenet
from cachebuild.sources.registry import plan_source
from cachebuild.storage.cache import read_manifest
from loaders.parity.augment import augmentation, device_sampler, torchvision_draws, worker_sampler
from loaders.parity.cli import parity
from tests.cifar_files import write_cifar10

SIZE = 48
FAST = ["--draws", "2000", "--reference-draws", "2000"]  # the crop tests' power is test_crop_distribution's


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small ILSVRC2012 tree with broken files (skipped by the build) and val in class folders."""
    return write_imagenet(tmp_path_factory.mktemp("parity"), n_classes=3, train_per_class=6, val_per_class=2,
                          val_layout="folders", seed=5, quirks=False, broken=True)


def _build(src: Path | str, out: Path, split: str = "train", kind: str = "imagenet", **kw: Any) -> Path:
    plans = {p.split: p for p in plan_source(kind, src)}
    return build(plans[split], out, BuildOptions(size=SIZE, jobs=1, **kw)).path


def _claim(cache: Path, **fields: Any) -> None:
    """Rewrite the manifest to claim other build parameters (the pixels stay as built): through the format's
    own serialiser, so the manifest is sealed and well-formed and only the claim is false."""
    m = read_manifest(cache)
    build_fields = {k: v for k, v in fields.items() if k in ("fit", "interpolation")}
    source = {**m.source, "recipe": {**m.source["recipe"], **fields.pop("recipe", {})}}
    m = dataclasses.replace(m, **build_fields, build={**m.build, **build_fields}, source=source)
    write_bytes_atomic(cache / MANIFEST_NAME, manifest_bytes(m))


def _run(cache: Path, src: Path, tmp: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    doc = tmp / "parity.json"
    r = CliRunner().invoke(parity, [str(cache), "--source", str(src), "--json", str(doc), *FAST, *extra])
    assert r.exit_code in (0, 1, 2), (r.output, r.exc_info)
    got = json.loads(doc.read_text()) if doc.is_file() else {}
    return r.exit_code, got, r.output


def _check(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in doc["checks"] if c["name"] == name)


def test_a_faithful_cache_passes_every_check(tree, tmp_path):
    cache = _build(tree["root"], tmp_path / "c")
    rc, doc, out = _run(cache, Path(tree["root"]), tmp_path, "--out", str(tmp_path / "html"))
    assert rc == 0, out
    assert doc["passed"] and not doc["failed"]
    assert {c["name"] for c in doc["checks"]} == {"classes", "order", "labels", "pixels", "augmentation",
                                                  "eval_crop"}
    order = _check(doc, "order")["figures"]
    assert order["skipped"] == len(read_manifest(cache).failures) > 0  # the broken files, accounted for
    assert order["samples"] + order["skipped"] == order["reference"]
    pixels = _check(doc, "pixels")["figures"]
    assert pixels["checked"] == order["samples"] and pixels["median_db"] >= 40
    assert _check(doc, "eval_crop")["figures"]["max_abs_diff"] == {"device": 0, "worker": 0}
    html = (tmp_path / "html" / "index.html").read_text()
    assert "Every check passed" in html and 'src="worst-pixels.png"' in html
    with Image.open(tmp_path / "html" / "worst-pixels.png") as sheet:
        assert sheet.size[0] > SIZE * 4


@pytest.mark.parametrize(("built", "claimed"), [({"fit": "squash"}, {"fit": "crop"}),
                                                ({"interpolation": "linear"}, {"interpolation": "antialias"})])
def test_a_manifest_that_claims_another_recipe_fails_the_pixels_check(tree, tmp_path, built, claimed):
    cache = _build(tree["root"], tmp_path / "c", **built)
    rc, doc, out = _run(cache, Path(tree["root"]), tmp_path)
    assert rc == 0, out  # as built, it passes
    _claim(cache, **claimed)
    rc, doc, out = _run(cache, Path(tree["root"]), tmp_path)
    assert rc == 1 and doc["failed"] == ["pixels"], out
    assert "pixels: FAIL" in out and "median" in _check(doc, "pixels")["verdict"]


def _copy(tree: dict[str, Any], tmp: Path) -> Path:
    src = tmp / "src"
    shutil.copytree(tree["root"], src, symlinks=True)  # the tree's broken files include a dangling link
    return src


def test_files_swapped_between_classes_fail_the_labels_check(tree, tmp_path):
    src = _copy(tree, tmp_path)
    cache = _build(src, tmp_path / "c")
    a_dir, b_dir = sorted(p for p in (src / "train").iterdir())[:2]
    a, b = sorted(a_dir.glob("*.JPEG"))[1], sorted(b_dir.glob("*.JPEG"))[2]
    a.rename(b_dir / a.name)
    b.rename(a_dir / b.name)
    rc, doc, out = _run(cache, src, tmp_path)
    assert rc == 1 and "labels" in doc["failed"], out
    labels = _check(doc, "labels")
    assert labels["figures"]["differ"] == 2
    first = labels["figures"]["first_differences"][0]
    assert first["file"] == f"{a_dir.name}/{a.name}" and (first["expected"], first["got"]) == (1, 0)
    assert labels["verdict"].startswith(f"2 samples differ, first #{first['index']} {a_dir.name}/{a.name}: "
                                        "expected 1, got 0")
    assert "labels: FAIL, 2 samples differ" in out


def test_a_changed_source_file_fails_the_pixels_check(tree, tmp_path):
    src = _copy(tree, tmp_path)
    cache = _build(src, tmp_path / "c")
    files = sorted((src / "train").glob("*/*.JPEG"))
    good = [f for f in files if "broken" not in f.name]
    changed = good[3]
    with Image.open(good[-1]) as other:
        other.convert("RGB").rotate(90, expand=True).save(changed, "JPEG", quality=90)
    rc, doc, out = _run(cache, src, tmp_path)
    assert rc == 1 and doc["failed"] == ["pixels"], out
    worst = _check(doc, "pixels")["figures"]["worst"][0]
    assert read_manifest(cache).count and worst["psnr_db"] < 20
    assert json.loads((cache / "paths.json").read_text())[worst["index"]] == f"{changed.parent.name}/{changed.name}"


def test_a_crop_distribution_off_by_a_little_fails_the_augmentation_check():
    """scale (0.1, 1) instead of torchvision's (0.08, 1): 2% of crops smaller, found by the area test only."""
    boxes = np.array([[0, 0, 96, 96], [0, 8, 96, 88]])
    ref = torchvision_draws(boxes[np.arange(20_000) % 2], seed=1)  # torchvision's, drawn once
    kw = {"draws": 100_000, "reference_draws": 20_000, "seed": 0, "alpha": 1e-3, "reference": ref}
    ok = augmentation(boxes, (96, 96), **kw)
    assert ok.passed, ok.verdict
    for name, sampler in (("device", device_sampler(scale=(0.1, 1.0))), ("worker", worker_sampler(scale=(0.1, 1.0)))):
        bad = augmentation(boxes, (96, 96), samplers={name: sampler}, **kw)
        assert not bad.passed and f"{name} area" in bad.verdict, bad.verdict
        assert "aspect" not in bad.verdict  # the other statistics are unchanged
    flips = augmentation(boxes, (96, 96), samplers={"device": _flip_rate(0.47)}, **kw)
    assert not flips.passed and "flip rate" in flips.verdict


def _flip_rate(p: float) -> Any:
    inner = device_sampler()

    def draw(boxes: np.ndarray, shape: tuple[int, int], seed: int) -> Any:
        d = inner(boxes, shape, seed)
        d.flips = np.random.default_rng(seed).random(len(boxes)) < p
        return d

    return draw


def test_bad_input_exits_2_with_the_reason(tree, tmp_path):
    cache = _build(tree["root"], tmp_path / "c")
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, out = _run(empty, Path(tree["root"]), tmp_path)
    assert rc == 2 and "not a cache" in out
    cifar = write_cifar10(tmp_path / "cifar", n_train=50, n_test=10)
    rc, _, out = _run(cache, Path(cifar["folder"]).parent, tmp_path)
    assert rc == 2 and "has no train/ folder" in out  # an ImageNet cache, a CIFAR source
    other = write_imagenet(tmp_path / "other", n_classes=2, train_per_class=2, val_per_class=1, seed=9)
    rc, _, out = _run(cache, Path(other["root"]), tmp_path)
    assert rc == 2 and "another source" in out
    _claim(cache, recipe={"kind": "wds"})
    rc, _, out = _run(cache, Path(tree["root"]), tmp_path)
    assert rc == 2 and "no independent reference for source kind 'wds'" in out


def test_cifar_and_a_flat_devkit_val_have_their_own_references(tmp_path):
    cifar = write_cifar10(tmp_path / "cifar", n_train=60, n_test=20, seed=3)
    cache = build(next(p for p in plan_source("cifar10", tmp_path / "cifar") if p.split == "test"),
                  tmp_path / "cc", BuildOptions(size=32, jobs=1)).path
    rc, doc, out = _run(cache, tmp_path / "cifar", tmp_path)
    assert rc == 0, out
    assert _check(doc, "pixels")["figures"]["min_db"] >= 99  # 32 px: the batches' pixels, unchanged
    assert "CIFAR python batches" in doc["reference"] and cifar["classes"]
    flat = write_imagenet(tmp_path / "in", n_classes=2, train_per_class=2, val_per_class=3, val_layout="devkit",
                          seed=4)
    val = _build(flat["root"], tmp_path / "v", split="val")
    rc, doc, out = _run(val, Path(flat["root"]), tmp_path)
    assert rc == 0 and "devkit" in doc["reference"], out


def test_training_ab_runs_both_pipelines_and_plots_them(tree, tmp_path):
    cache = _build(tree["root"], tmp_path / "c")
    rc, doc, out = _run(cache, Path(tree["root"]), tmp_path, "--train-steps", "3", "--train-batch", "4",
                        "--train-runs", "2", "--out", str(tmp_path / "html"))
    t = _check(doc, "training")["figures"]
    assert len(t["loss_torchvision"]) == len(t["loss_cache"]) == 2  # one curve per paired run
    assert all(len(c) == 3 for c in t["loss_torchvision"] + t["loss_cache"])
    for tv, ours in zip(t["loss_torchvision"], t["loss_cache"], strict=True):
        assert tv[0] == pytest.approx(ours[0], rel=0.5)  # one initialisation per run
    assert t["loss_torchvision"][0][0] != t["loss_torchvision"][1][0]  # another one in the next run
    lo, hi = t["interval"]
    assert lo <= t["difference"] <= hi and t["eval_images"] == read_manifest(cache).count
    assert t["differences"] == pytest.approx(np.subtract(t["accuracy_cache"], t["accuracy_torchvision"]).tolist())
    assert (tmp_path / "html" / "training-loss.png").stat().st_size > 1000
    assert rc in (0, 1) and ("training: ok" in out) == _check(doc, "training")["passed"]


def test_without_scipy_parity_is_one_line_naming_the_extra(tree, tmp_path, monkeypatch):
    cache = _build(tree["root"], tmp_path / "c")
    for name in ("scipy", "scipy.io", "scipy.stats"):  # what Python sees when scipy is not installed
        monkeypatch.setitem(sys.modules, name, None)
    rc, doc, out = _run(cache, Path(tree["root"]), tmp_path)
    assert rc == 2 and not doc
    assert out.strip().splitlines() == ["Error: cachebuild parity needs scipy for its statistical tests: "
                                        "pip install 'cachebuild[scipy]'"]


def test_without_matplotlib_the_page_goes_without_the_curves_and_says_so(tree, tmp_path, monkeypatch):
    from loaders.parity.cli import ParityOptions, _curves_png

    o = ParityOptions(cache="c", source=Path(tree["root"]), train_steps=3, out=tmp_path / "html")
    assert _curves_png(o, print) == tmp_path / "html" / "training-loss.png"
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    said: list[str] = []
    assert _curves_png(o, said.append) is None
    assert said == ["parity's training-loss.png needs matplotlib: pip install 'cachebuild[plots]'"]


@pytest.mark.slow
def test_training_ab_on_a_held_out_split_agrees(tree, tmp_path):
    train = _build(tree["root"], tmp_path / "t")
    val = _build(tree["root"], tmp_path / "v", split="val")
    rc, doc, out = _run(train, Path(tree["root"]), tmp_path, "--train-steps", "30", "--train-batch", "8",
                        "--val", str(val))
    assert rc == 0, out
    assert _check(doc, "training")["figures"]["eval_images"] == read_manifest(val).count


def test_parquet_labels_come_from_the_label_column(hf_set, tmp_path):
    data = Path(hf_set["files"][0]).parent
    cache = _build(data, tmp_path / "pq", kind="parquet")
    rc, doc, out = _run(cache, data, tmp_path)
    assert "pyarrow" in doc["reference"], out
    assert rc == 0 and _check(doc, "labels")["figures"]["compared"] == read_manifest(cache).count, out


def test_out_refuses_a_folder_it_did_not_write_and_replaces_only_its_own_files(tree, tmp_path):
    cache = _build(tree["root"], tmp_path / "c")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("my page")
    rc, doc, out = _run(cache, Path(tree["root"]), tmp_path, "--out", str(mine))
    assert rc == 2 and not doc and "holds no parity page" in out and "--out" in out, out
    assert [p.name for p in mine.iterdir()] == ["index.html"] and (mine / "index.html").read_text() == "my page"
    page = tmp_path / "page"
    assert _run(cache, Path(tree["root"]), tmp_path, "--out", str(page))[0] == 0
    (page / "notes.txt").write_text("added later")
    precious = tmp_path / "precious.html"
    precious.write_text("precious")
    (page / "index.html").unlink()
    (page / "index.html").symlink_to(precious)  # a link planted under one of parity's names
    rc, _, out = _run(cache, Path(tree["root"]), tmp_path, "--out", str(page))
    assert rc == 0, out
    assert precious.read_text() == "precious" and not (page / "index.html").is_symlink()
    assert "Every check passed" in (page / "index.html").read_text()
    assert (page / "notes.txt").read_text() == "added later"


def test_another_tree_is_bad_input_not_a_failed_check(tree, tmp_path):
    folder = build(next(p for p in plan_source("folder", Path(tree["root"]) / "train")), tmp_path / "f",
                   BuildOptions(size=SIZE, jobs=1)).path
    rc, _, out = _run(folder, Path(tree["root"]), tmp_path)  # a folder cache against the folder above its own
    assert rc == 2 and "another tree" in out and "--source" in out, out
    assert _run(folder, Path(tree["root"]) / "train", tmp_path)[0] == 0
    cache = _build(tree["root"], tmp_path / "c")
    sibling = _copy(tree, tmp_path)  # the same file names, other photos
    for f in sorted((sibling / "train").glob("*/*.JPEG")):
        if "broken" not in f.name:
            with Image.open(f) as im:
                im.convert("RGB").transpose(Image.Transpose.ROTATE_180).save(f, "JPEG", quality=70)
    rc, _, out = _run(cache, sibling, tmp_path)
    assert rc == 2 and "not the tree" in out and "differ in size" in out and "--source" in out, out


def test_the_classes_check_counts_samples_per_class(tree, tmp_path):
    src = _copy(tree, tmp_path)
    cache = _build(src, tmp_path / "c")
    m = read_manifest(cache)
    a_dir, b_dir = sorted((src / "train").iterdir())[:2]
    moved = sorted(a_dir.glob("*.JPEG"))[0]
    moved.rename(b_dir / moved.name)  # one file to another class: the counts differ, the lists do not
    rc, doc, out = _run(cache, src, tmp_path)
    classes = _check(doc, "classes")
    assert rc == 1 and not classes["passed"] and "classes: FAIL" in out, out
    assert f"{a_dir.name}: 6 in the cache, 5 in the reference" in classes["verdict"]
    assert classes["figures"]["count_differences"][0] == {"class": a_dir.name, "cache": 6, "reference": 5}
    (b_dir / moved.name).rename(moved)
    assert _run(cache, src, tmp_path)[0] == 0
    # An empty class folder: ImageFolder refuses the tree; a cache that lists the class with 0 samples fails.
    (src / "train" / "zzz_empty").mkdir()
    write_bytes_atomic(cache / MANIFEST_NAME, manifest_bytes(dataclasses.replace(m, classes=[*m.classes,
                                                                                        "zzz_empty"])))
    rc, doc, out = _run(cache, src, tmp_path)
    classes = _check(doc, "classes")
    assert rc == 1 and not classes["passed"], out
    assert "zzz_empty" in classes["verdict"] and "no samples" in classes["verdict"] and "ImageFolder" in \
        classes["verdict"]


def test_a_val_cache_built_from_its_own_tree_is_checked_against_it(tree, tmp_path):
    root = Path(tree["root"])
    train = build(next(p for p in plan_source("folder", root / "train")), tmp_path / "t",
                  BuildOptions(size=SIZE, jobs=1)).path
    val = build(next(p for p in plan_source("folder", root / "val")), tmp_path / "v",
                BuildOptions(size=SIZE, jobs=1)).path
    args = ["--train-steps", "2", "--train-batch", "4", "--train-runs", "2", "--train-model", "linear"]
    rc, doc, out = _run(train, root / "train", tmp_path, "--val", str(val), *args)
    assert rc in (0, 1) and _check(doc, "training")["figures"]["eval_images"] == read_manifest(val).count, out
    rc, doc, out = _run(train, root / "train", tmp_path, "--val", str(val), "--val-source", str(root / "val"), *args)
    assert rc in (0, 1) and _check(doc, "training")["figures"]["eval_images"] == read_manifest(val).count, out
    rc, _, out = _run(train, root / "train", tmp_path, "--val", str(val), "--val-source", str(root / "train"),
                      *args)
    assert rc == 2 and "--val-source" in out and "--source" not in out.split("--val-source")[0], out


def test_a_16_bit_source_is_named_as_the_cause_of_its_low_psnr(tree, tmp_path):
    src = _copy(tree, tmp_path)
    folder = sorted((src / "train").iterdir())[0]
    grey = (np.linspace(20_000, 60_000, 64 * 80).reshape(64, 80)).astype(np.uint16)  # a 16-bit grey photo
    Image.fromarray(grey).save(folder / "deep.JPEG", "PNG")
    cache = _build(src, tmp_path / "c")
    rc, doc, out = _run(cache, src, tmp_path, "--n", "1000")
    pixels = _check(doc, "pixels")
    assert rc == 1 and not pixels["passed"], out
    assert "16-bit" in pixels["verdict"] and "deep.JPEG" in pixels["verdict"] and "white" in pixels["verdict"]
    assert pixels["figures"]["sixteen_bit_sources"][0]["file"].endswith("deep.JPEG")


def test_the_paired_verdict_fails_only_a_difference_beyond_the_margin():
    from scipy.stats import t

    from loaders.parity.train_ab import POWER, paired_verdict

    # five paired runs of an honest cache on the built-in sample (seed 1): every run a few points above
    honest = np.array([0.09, 0.08, 0.04, 0.03, 0.10])
    v = paired_verdict(honest, 0.01, 0.1)
    lo, hi = v.interval
    assert lo > 0 and v.passed  # the interval excludes 0 but reaches the margin: the same training, as near as seen
    assert not paired_verdict(honest, 0.01, 0.0).passed  # the rule "excludes 0" fails it
    half = t.ppf(0.995, 4) * honest.std(ddof=1) / np.sqrt(5)
    assert (lo, hi) == pytest.approx((honest.mean() - half, honest.mean() + half))
    assert v.detectable == pytest.approx(0.1 + (t.ppf(0.995, 4) + t.ppf(POWER, 4)) * honest.std(ddof=1) / np.sqrt(5))
    wrong = np.array([-0.55, -0.62, -0.48, -0.60, -0.51])  # a cache that teaches other labels
    assert not paired_verdict(wrong, 0.01, 0.1).passed and not paired_verdict(-wrong, 0.01, 0.1).passed
    noisy = np.array([0.21, 0.32, 0.23, -0.03, -0.11])  # a wide spread: no difference found, and it says how big
    assert paired_verdict(noisy, 0.01, 0.1).passed and paired_verdict(noisy, 0.01, 0.1).detectable > 0.4


def _relabel(cache: Path) -> None:
    """Every sample's label one class on, written as a build writes labels (the array, its digest, the file
    table, the sealed manifest): a cache whose pixels are right and whose labels teach another task."""
    from cachebuild.storage.cache import save_array, with_file_table

    m = read_manifest(cache)
    labels = np.load(cache / m.arrays["labels"].file)
    info = save_array(cache, "labels", ((labels + 1) % len(m.classes)).astype(labels.dtype))
    m = dataclasses.replace(m, arrays={**m.arrays, "labels": info})
    write_bytes_atomic(cache / MANIFEST_NAME, manifest_bytes(with_file_table(cache, m)))


@pytest.mark.slow
def test_a_cache_that_teaches_other_labels_fails_the_training_check_on_every_seed(tmp_path):
    tree = write_imagenet(tmp_path / "src", n_classes=4, train_per_class=20, val_per_class=1, seed=2)
    cache = _build(tree["root"], tmp_path / "c")
    _relabel(cache)
    for seed in ("0", "1", "2"):
        rc, doc, out = _run(cache, Path(tree["root"]), tmp_path, "--train-steps", "40", "--train-batch", "16",
                            "--seed", seed)
        training = _check(doc, "training")
        assert rc == 1 and "labels" in doc["failed"] and not training["passed"], out
        assert training["figures"]["difference"] < -training["figures"]["margin"], training["verdict"]


@pytest.mark.slow
def test_an_honest_cache_passes_the_training_check_on_every_seed(tmp_path):
    tree = write_imagenet(tmp_path / "src", n_classes=4, train_per_class=20, val_per_class=1, seed=2)
    cache = _build(tree["root"], tmp_path / "c")
    for seed in ("0", "1", "2", "3"):
        rc, doc, out = _run(cache, Path(tree["root"]), tmp_path, "--train-steps", "40", "--train-batch", "16",
                            "--seed", seed)
        assert rc == 0 and _check(doc, "training")["passed"], out
