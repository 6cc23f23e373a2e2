"""The sample generators write the real ImageNet layouts, real quirks and really broken files."""

from __future__ import annotations

import csv
import re
import struct
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from cachebuild.samples.broken import BROKEN_KINDS, write_all_broken, write_pixel_bomb_png
from cachebuild.samples.imagenet_layout import IMAGENET_SYNSETS, write_imagenet
from cachebuild.samples.photos import class_region, imagenet_like_size, photo_bank, render_sample
from support.archive import write_tar_gz

N_CLASSES, TRAIN, VAL = 4, 6, 3


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


@pytest.fixture(scope="module")
def folders_tree(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_imagenet(
        tmp_path_factory.mktemp("inet"), N_CLASSES, TRAIN, VAL, "folders", seed=1, quirks=True, broken=True
    )


# ---------------------------------------------------------------------------------------- photos


def test_photo_bank_is_real_rgb_photos() -> None:
    bank = photo_bank()
    names = [n for n, _ in bank]
    assert len(bank) >= 8 and len(set(names)) == len(names)
    assert names[:4] == ["astronaut", "chelsea", "coffee", "rocket"]
    for name, img in bank:
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3, name
        assert min(img.shape[:2]) >= 300 and not img.flags.writeable, name
        assert img.std() > 20, name  # a photograph, not a flat image


def test_render_is_deterministic_and_classes_differ() -> None:
    bank = photo_bank()
    a = render_sample(bank, 2, 64, 48, np.random.default_rng(5))
    b = render_sample(bank, 2, 64, 48, np.random.default_rng(5))
    c = render_sample(bank, 2, 64, 48, np.random.default_rng(6))
    assert a.shape == (48, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # Classes past the bank size come from distinct regions of the photos.
    regions = {class_region(k, bank) for k in range(6 * len(bank))}
    assert len(regions) == 6 * len(bank)


def test_imagenet_like_sizes() -> None:
    rng = np.random.default_rng(0)
    normal = np.array([imagenet_like_size(rng) for _ in range(2000)])
    aspect = normal[:, 0] / normal[:, 1]
    assert normal.max(1).min() >= 300 and normal.max(1).max() <= 500
    assert aspect.min() >= 0.74 and aspect.max() <= 1.79
    assert 370 < normal[:, 0].mean() < 430 and 300 < normal[:, 1].mean() < 360
    assert all(max(imagenet_like_size(rng, "large")) >= 1000 for _ in range(20))
    assert all(min(imagenet_like_size(rng, "small")) < 224 for _ in range(20))


# ---------------------------------------------------------------------------------------- layouts


def test_folders_layout(folders_tree: dict) -> None:
    r = folders_tree
    root = r["root"]
    assert r["wnids"] == [w for w, _ in IMAGENET_SYNSETS[:N_CLASSES]] == sorted(r["wnids"])
    assert sorted(p.name for p in (root / "train").iterdir()) == r["wnids"]
    for k, wnid in enumerate(r["wnids"]):
        names = [p.name for p in (root / "train" / wnid).iterdir() if "_broken_" not in p.name]
        assert all(re.fullmatch(rf"{wnid}_\d+\.JPEG", n) for n in names), names
        assert len(names) == TRAIN + (1 if k < 4 else 0)  # one quirk file in each of the first 4
        assert all(e["label"] == k for e in r["train"] if e["wnid"] == wnid)
    val_files = sorted((root / "val").rglob("*.JPEG"))
    assert len(val_files) == N_CLASSES * VAL == len(r["val"])
    assert sorted(p.name for p in val_files) == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 13)]
    for e in r["val"]:
        assert e["path"].parent.name == e["wnid"] == r["wnids"][e["label"]]


def test_images_are_jpegs_of_the_recorded_sizes(folders_tree: dict) -> None:
    kinds = {e["kind"] for e in folders_tree["train"] + folders_tree["val"]}
    assert {"normal", "large", "small"} <= kinds
    for e in folders_tree["train"] + folders_tree["val"]:
        if e["kind"] in ("png", "exif"):
            continue
        with Image.open(e["path"]) as im:
            assert im.format == "JPEG" and im.size == e["size"], e["path"]
        w, h = e["size"]
        if e["kind"] == "large":
            assert max(w, h) >= 1000
        elif e["kind"] == "small":
            assert min(w, h) < 224
        else:
            assert 300 <= max(w, h) <= 500 and 0.74 <= w / h <= 1.79
        assert 85 <= e["quality"] <= 95


def test_deterministic_from_seed(tmp_path: Path) -> None:
    a = write_imagenet(tmp_path / "a", 2, 3, 1, "kaggle", seed=7)
    b = write_imagenet(tmp_path / "b", 2, 3, 1, "kaggle", seed=7)
    c = write_imagenet(tmp_path / "c", 2, 3, 1, "kaggle", seed=8)
    rel = lambda r: {p.relative_to(r["root"]): p.read_bytes() for p in _files(r["root"])}  # noqa: E731
    assert rel(a) == rel(b)
    assert rel(a) != rel(c)


def test_devkit_layout_reads_with_torchvision(tmp_path: Path) -> None:
    r = write_imagenet(tmp_path, N_CLASSES, 2, VAL, "devkit", seed=2)
    write_tar_gz(tmp_path / "ILSVRC2012_devkit_t12", tmp_path / "ILSVRC2012_devkit_t12.tar.gz")  # as downloaded
    val = sorted((tmp_path / "val").iterdir())
    assert [p.name for p in val] == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, N_CLASSES * VAL + 1)]
    gt = r["ground_truth"].read_text().splitlines()
    assert [int(x) for x in gt] == [r["ilsvrc_ids"][e["wnid"]] for e in r["val"]]

    synsets = scipy.io.loadmat(r["meta_mat"], squeeze_me=True)["synsets"]
    assert synsets.dtype.names == (
        "ILSVRC2012_ID",
        "WNID",
        "words",
        "gloss",
        "num_children",
        "children",
        "wordnet_height",
        "num_train_images",
    )
    leaves = [s for s in synsets if s["num_children"] == 0]
    assert len(leaves) == N_CLASSES and len(synsets) > N_CLASSES  # internal nodes follow the leaves
    assert [int(s["ILSVRC2012_ID"]) for s in leaves] == list(range(1, N_CLASSES + 1))
    assert [s["WNID"] for s in leaves] != sorted(s["WNID"] for s in leaves)  # IDs are not wnid order

    # torchvision's own devkit parser (md5 check of the real archive patched out).
    import torchvision.datasets.imagenet as tv_imagenet

    with mock.patch.object(tv_imagenet, "_verify_archive"):
        tv_imagenet.parse_devkit_archive(str(tmp_path))
    wnid_to_classes, val_wnids = torch.load(tmp_path / "meta.bin", weights_only=True)
    assert val_wnids == [e["wnid"] for e in r["val"]]
    assert wnid_to_classes["n01440764"] == ("tench", "Tinca tinca")


def test_kaggle_layout(tmp_path: Path) -> None:
    r = write_imagenet(tmp_path, N_CLASSES, 2, VAL, "kaggle", seed=3, kaggle_tree=True)
    data = tmp_path / "ILSVRC" / "Data" / "CLS-LOC"
    assert r["train_dir"] == data / "train"
    assert sorted(p.name for p in (data / "train").iterdir()) == r["wnids"]
    assert not (tmp_path / "train").exists()
    assert len(list((data / "val").glob("ILSVRC2012_val_*.JPEG"))) == N_CLASSES * VAL
    with r["solution_csv"].open(newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["ImageId", "PredictionString"] and len(rows) == 1 + N_CLASSES * VAL
    by_id = {e["path"].stem: e for e in r["val"]}
    for image_id, pred in rows[1:]:
        tokens = pred.split()
        assert len(tokens) % 5 == 0 and tokens
        e = by_id[image_id]
        w, h = e["size"]
        for i in range(0, len(tokens), 5):
            assert tokens[i] == e["wnid"]
            x0, y0, x1, y1 = map(int, tokens[i + 1 : i + 5])
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
    mapping = r["synset_mapping"].read_text().splitlines()
    assert mapping[0] == "n01440764 tench, Tinca tinca" and len(mapping) == N_CLASSES


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val_layout must be one of"):
        write_imagenet(tmp_path, val_layout="flat")
    with pytest.raises(ValueError, match="n_classes must be in"):
        write_imagenet(tmp_path, n_classes=len(IMAGENET_SYNSETS) + 1)


# ---------------------------------------------------------------------------------------- quirks


def test_quirk_files_are_what_imagenet_holds(folders_tree: dict) -> None:
    q = folders_tree["quirks"]
    assert set(q) == {"cmyk", "png", "gray", "exif"}
    for e in q.values():
        assert e["path"].suffix == ".JPEG" and e["path"].parent.name == e["wnid"]
    with Image.open(q["cmyk"]["path"]) as im:
        assert im.format == "JPEG" and im.mode == "CMYK" and im.size == q["cmyk"]["size"]
    assert q["png"]["path"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(q["png"]["path"]) as im:
        assert im.format == "PNG" and im.mode == "RGB"
    with Image.open(q["gray"]["path"]) as im:
        assert im.format == "JPEG" and im.mode == "L"
    with Image.open(q["exif"]["path"]) as im:
        w, h = q["exif"]["size"]
        assert im.format == "JPEG" and im.size == (h, w)  # stored turned
        assert im.getexif()[0x0112] == 6
        upright = np.asarray(ImageOps.exif_transpose(im))
    assert upright.shape == (h, w, 3)
    assert np.abs(upright.astype(int) - q["exif"]["upright"].astype(int)).mean() < 6


# ---------------------------------------------------------------------------------------- broken


def test_broken_files_are_broken(tmp_path: Path) -> None:
    b = write_all_broken(tmp_path)
    assert set(b) == set(BROKEN_KINDS)
    with Image.open(b["truncated"]) as im, pytest.raises(OSError, match="truncated"):
        im.load()
    assert b["truncated"].read_bytes()[:2] == b"\xff\xd8" and b["truncated"].read_bytes()[-2:] != b"\xff\xd9"
    assert b["empty"].stat().st_size == 0
    for kind in ("empty", "text"):
        with pytest.raises(UnidentifiedImageError):
            Image.open(b[kind])
    # Pixel bombs: small files whose headers declare huge images; PIL refuses them on open.
    raw = b["bomb_png"].read_bytes()
    assert raw[12:16] == b"IHDR" and struct.unpack(">II", raw[16:24]) == (30000, 30000)
    assert len(raw) < 1_000_000
    jpeg = b["bomb_jpeg"].read_bytes()
    sof = jpeg.index(b"\xff\xc0")
    assert struct.unpack(">HH", jpeg[sof + 5 : sof + 9]) == (65500, 65500) and len(jpeg) < 2000
    for kind in ("bomb_png", "bomb_jpeg"):
        with pytest.raises(Image.DecompressionBombError):
            Image.open(b[kind])
    assert b["unreadable"].is_symlink() and not b["unreadable"].exists()
    with pytest.raises(FileNotFoundError):
        b["unreadable"].open("rb")


def test_small_pixel_bomb_is_a_valid_png(tmp_path: Path) -> None:
    path = write_pixel_bomb_png(tmp_path, "small_bomb.png", side=300)
    with Image.open(path) as im:
        assert im.size == (300, 300)
        assert np.asarray(im.convert("L")).max() == 0


def test_broken_files_inside_the_tree(folders_tree: dict) -> None:
    broken = folders_tree["broken"]
    assert set(broken) == set(BROKEN_KINDS)
    last = folders_tree["train_dir"] / folders_tree["wnids"][-1]
    assert all(p.parent == last and p.name.startswith(f"{last.name}_broken_") for p in broken.values())


def test_the_sample_command_without_the_samples_extra_names_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from cachebuild.cli import main
    from cachebuild.samples import photos

    photos._load_bank.cache_clear()  # the bank is loaded once per process: make this call load it
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # as if not installed: the real guard runs
    try:
        res = CliRunner().invoke(main, ["sample", str(tmp_path / "photos")])
    finally:
        photos._load_bank.cache_clear()
    assert res.exit_code == 1 and res.output.strip() == (
        "Error: the sample photos ship in scikit-image and scikit-learn: pip install 'cachebuild[samples]'")
