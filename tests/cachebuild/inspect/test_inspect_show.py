"""``cachebuild show``: contact sheets whose tiles are the stored pixels, captioned with the right sample;
random, per-class and given selections; ``--augment`` through the device presets; every storage kind, a
``--fit pad`` cache and a cache at a URL; one-line errors for bad input."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from click.testing import CliRunner
from PIL import Image

import cachebuild.cli as cli
from cachebuild.errors import OptionError
from cachebuild.inspect import Selection, pick_per_class, select, show
from cachebuild.inspect.sheet import BACKGROUND
from cachebuild.inspect.show import source_paths
from cachebuild.storage.cache import open_cache
from loaders import inspect_cli
from loaders.augment_view import PRESETS, augment_view
from loaders.inspect_cli import show as show_command
from loaders.transforms import presets
from tests.inspect_fixtures import AWKWARD_PATHS, inspect_cache
from tests.repo import REPO

KINDS = ["npy", "zarr", "jpeg"]


def _tile_pixels(sheet_image: np.ndarray, box: tuple[int, int, int, int], scale: int) -> np.ndarray:
    x0, y0, x1, y1 = box
    block = sheet_image[y0:y1, x0:x1]
    # every stored pixel is a scale x scale block of one colour: check the block, return one per pixel
    small = block[::scale, ::scale]
    assert np.array_equal(np.repeat(np.repeat(small, scale, 0), scale, 1), block)
    return small


def _displayed(y: torch.Tensor) -> np.ndarray:
    """A normalised ImageNet-preset batch back as uint8 NHWC pixels."""
    mean = torch.tensor(presets.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(presets.IMAGENET_STD).view(1, 3, 1, 1)
    return ((y * std + mean) * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("storage", KINDS)
def test_tiles_are_the_stored_pixels_and_captions_name_the_sample(tmp_path: Path, storage: str) -> None:
    root, images, labels, paths = inspect_cache(tmp_path / storage, storage, h=24, w=40)
    reader = open_cache(root)
    idx = np.array([71, 3, 40, 0, 89, 12, 13], dtype=np.int64)  # unsorted: shown in the order asked
    sheet = show(reader, Selection(idx), columns=3)
    assert sheet.scale == 3 and sheet.columns == 3  # 40 px -> 120 px tiles, whole-factor enlarged
    stored = reader.gather(idx)  # for jpeg: the decoded pixels the cache serves
    if storage != "jpeg":
        assert np.array_equal(stored, images[idx])
    for k, tile in enumerate(sheet.tiles):
        assert tile.index == idx[k] and tile.label == labels[idx[k]]
        assert np.array_equal(_tile_pixels(sheet.image, tile.stored, sheet.scale), stored[k])
        assert tile.class_name == f"class-{labels[idx[k]]}" and tile.path == paths[idx[k]]
        assert tile.caption == (f"#{idx[k]}  label {labels[idx[k]]}", tile.class_name, tile.path)
        x0, _, x1, y1 = tile.stored
        text = sheet.image[y1 + 2 : y1 + 2 + 3 * 13, x0:x1]
        assert (text != BACKGROUND).any(axis=2).sum() > 50  # the caption is drawn under the tile
    assert [t.stored[:2] for t in sheet.tiles[:4]] == [(4, 4), (132, 4), (260, 4), (4, 4 + 72 + 8 + 39)]


def test_long_names_are_shortened_in_the_middle(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c", h=16, w=16)
    long_path = "n01440764/" + "x" * 80 + "_10026.JPEG"
    from cachebuild.storage.cache import write_cache

    reader = open_cache(root)
    write_cache(tmp_path / "long", reader.gather(range(3)), np.zeros(3, np.int64), ["a" * 60], paths=[long_path] * 3)
    tile = show(open_cache(tmp_path / "long"), Selection(np.array([1]))).tiles[0]
    assert tile.path == long_path and tile.caption[2] != long_path
    assert tile.caption[2].endswith("_10026.JPEG") and "\u2026" in tile.caption[2]  # the file's end is kept


def test_per_class_selection(tmp_path: Path) -> None:
    root, _, labels, _ = inspect_cache(tmp_path / "c", n=300)
    reader = open_cache(root)
    sel = select(reader, per_class=4, classes="5,1-2", seed=3)
    assert sel.columns == 4 and len(sel.indices) == 12
    got = labels[sel.indices].reshape(3, 4)
    assert (got == np.array([[5], [1], [2]])).all()  # one class per row, in the order given
    assert len(set(sel.indices.tolist())) == 12
    again = select(reader, per_class=4, classes="5,1-2", seed=3)
    other = select(reader, per_class=4, classes="5,1-2", seed=4)
    assert np.array_equal(sel.indices, again.indices) and not np.array_equal(sel.indices, other.indices)
    by_name = select(reader, per_class=4, classes="class-5,class-1,class-2", seed=3)
    assert np.array_equal(by_name.indices, sel.indices)
    # few classes scan the labels per class, many sort them once: the same picks either way
    many = pick_per_class(labels, list(range(6)) * 7, 4, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(many[:6], pick_per_class(labels, range(6), 4, 3), strict=True))
    # a class smaller than --per-class: all of its samples
    sel = select(reader, per_class=1000, classes="5")
    assert np.array_equal(sel.indices, np.flatnonzero(labels == 5))
    sheet = show(reader, select(reader, per_class=3, classes="0-2"))
    assert [t.label for t in sheet.tiles] == [0, 0, 0, 1, 1, 1, 2, 2, 2] and sheet.columns == 3


def test_random_and_index_selections(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=150)
    reader = open_cache(root)
    sel = select(reader, n=64, seed=1)
    assert len(set(sel.indices.tolist())) == 64 and sel.indices.max() < 150
    assert not np.array_equal(sel.indices, select(reader, n=64, seed=2).indices)
    assert len(select(reader, n=1000).indices) == 150  # all, when asked for more than there are
    assert select(reader, indices="3,7,100-103, 9").indices.tolist() == [3, 7, 100, 101, 102, 103, 9]


def test_augment_shows_what_the_preset_makes_of_the_batch(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=40, h=40, w=40)
    reader = open_cache(root)
    idx = np.arange(0, 40, 3)
    sheet = show(reader, Selection(idx), augment=augment_view("imagenet", reader.manifest.shape, crop=24, seed=5))
    expected_pipeline = presets.imagenet_train(24, generator=torch.Generator().manual_seed(5))
    y = expected_pipeline(torch.from_numpy(reader.gather(idx)).permute(0, 3, 1, 2))
    want = _displayed(y)
    differs = 0
    for k, tile in enumerate(sheet.tiles):
        x0, y0, x1, y1 = tile.augmented
        assert (x1 - x0, y1 - y0) == (24 * sheet.scale, 24 * sheet.scale)  # the preset's output size
        assert x0 >= tile.stored[2]  # beside the stored tile
        aug = _tile_pixels(sheet.image, tile.augmented, sheet.scale)
        assert np.array_equal(aug, want[k])
        stored = reader.gather([idx[k]])[0]
        differs += not np.array_equal(aug, stored[:24, :24])
    assert differs == len(idx)


def test_augment_on_a_pad_cache_passes_the_boxes(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "pad", n=30, h=32, w=32, pad=True)
    reader = open_cache(root)
    assert reader.boxes is not None
    idx = np.arange(30)
    view = augment_view("imagenet", reader.manifest.shape, crop=16, seed=0)
    sheet = show(reader, Selection(idx), augment=view)
    pipeline = presets.imagenet_train(16, generator=torch.Generator().manual_seed(0))
    y = pipeline(torch.from_numpy(reader.gather(idx)).permute(0, 3, 1, 2), torch.from_numpy(reader.boxes[idx]))
    want = _displayed(y)
    got = np.stack([_tile_pixels(sheet.image, t.augmented, sheet.scale) for t in sheet.tiles])
    assert np.array_equal(got, want)


def test_cli_writes_the_png_and_its_layout(tmp_path: Path) -> None:
    root, images, labels, paths = inspect_cache(tmp_path / "c", "zarr", n=70)
    res = CliRunner().invoke(show_command, [str(root), "--indices", "5,60-62", "--out", str(tmp_path / "s.png"),
                                            "--layout", str(tmp_path / "s.json"), "--augment", "auto"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"{tmp_path / 's.png'}: 4 samples of {root}")
    png = np.asarray(Image.open(tmp_path / "s.png").convert("RGB"))
    layout = json.loads((tmp_path / "s.json").read_text())
    assert [t["index"] for t in layout["tiles"]] == [5, 60, 61, 62]
    for t in layout["tiles"]:
        assert t["path"] == paths[t["index"]] and t["class"] == f"class-{labels[t['index']]}"
        assert np.array_equal(_tile_pixels(png, tuple(t["stored"]), layout["scale"]), images[t["index"]])
        assert t["augmented"] is not None


def test_show_of_a_cache_at_a_url(tmp_path: Path, http_server) -> None:
    _root, images, _, paths = inspect_cache(tmp_path / "site" / "c", "npy", n=50, awkward=True)
    server = http_server(tmp_path / "site")
    url = server.url_for("c")
    res = CliRunner().invoke(show_command, [url, "--indices", "0-9", "--out", str(tmp_path / "u.png"),
                                            "--layout", str(tmp_path / "u.json")])
    assert res.exit_code == 0, res.output
    png = np.asarray(Image.open(tmp_path / "u.png").convert("RGB"))
    layout = json.loads((tmp_path / "u.json").read_text())
    assert [t["path"] for t in layout["tiles"]] == paths[:10] == [*AWKWARD_PATHS, "c3/img_00009.JPEG"]
    for t in layout["tiles"]:
        assert np.array_equal(_tile_pixels(png, tuple(t["stored"]), layout["scale"]), images[t["index"]])


def test_captions_name_the_source_paths_asked_for(tmp_path: Path) -> None:
    root, _, _, paths = inspect_cache(tmp_path / "c", n=40, awkward=True)
    reader = open_cache(root)
    assert source_paths(reader) == reader.paths() == paths
    idx = np.asarray([39, 0, 4, 3, 2, 1, 5, 6, 7, 8, 20])
    assert [t.path for t in show(reader, Selection(idx)).tiles] == [paths[i] for i in idx]


@pytest.mark.parametrize(("args", "message"), [
    (["--classes", "0-x"], "Error: --classes '0-x': '0-x' is neither a class index, a range such as 0-15, nor a "
                           "class name of this cache (e.g. 'class-0')"),
    (["--classes", "2-40"], "Error: --classes '2-40': 40 is out of range: the cache holds 6 samples (0-5)"),
    (["--indices", "3,,4"], "Error: --indices '3,,4': expected a comma-separated list such as 3,7,100-120 "
                            "(no empty items)"),
    (["--indices", "89-95"], "Error: --indices '89-95': 95 is out of range: the cache holds 90 samples (0-89)"),
    (["--indices", "9-3"], "Error: --indices '9-3': range 9-3 runs backwards"),
    (["--indices", "1", "--per-class", "2"], "Error: --indices names the samples itself: drop --per-class/--classes"),
])
def test_bad_selections_are_one_line_errors(tmp_path: Path, args: list[str], message: str) -> None:
    root, *_ = inspect_cache(tmp_path / "c")
    res = CliRunner().invoke(show_command, [str(root), "--out", str(tmp_path / "x.png"), *args])
    assert res.exit_code == 1 and res.output.strip() == message
    assert not (tmp_path / "x.png").exists()


def test_no_cache_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    res = CliRunner().invoke(show_command, [str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 1
    assert res.output.strip() == f"Error: {tmp_path / 'nothing'} is not a cachebuild cache (no manifest.json)"
    res = CliRunner().invoke(show_command, [str(tmp_path / "gone"), "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 1
    assert res.output.strip() == (f"Error: {tmp_path / 'gone'} does not exist: name the folder of a cache (the one "
                                  f"holding manifest.json)")
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(OptionError, match="--n must be at least 1"):
        select(open_cache(inspect_cache(tmp_path / "c")[0]), n=0)


def test_the_commands_are_registered_entry_points(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pyproject.toml registers show and report like train; the command group runs them from there."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][cli.COMMAND_GROUP]
    assert declared["show"] == "loaders.inspect_cli:show" and declared["report"] == "loaders.inspect_cli:report"
    eps = {name: EntryPoint(name=name, value=value, group=cli.COMMAND_GROUP) for name, value in declared.items()}
    monkeypatch.setattr(cli, "_command_entry_points", lambda: eps)
    root, *_ = inspect_cache(tmp_path / "c")
    res = CliRunner().invoke(cli.main, ["show", str(root), "--n", "5", "--out", str(tmp_path / "e.png")])
    assert res.exit_code == 0 and (tmp_path / "e.png").is_file(), res.output
    res = CliRunner().invoke(cli.main, ["--help"])
    assert "  show " in res.output and "  report " in res.output
    assert inspect_cli._PRESETS == PRESETS  # the CLI names them without importing augment_view (numpy)


def test_an_unwritable_out_is_a_one_line_error(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c")
    (tmp_path / "file").write_text("x")
    res = CliRunner().invoke(show_command, [str(root), "--n", "3", "--out", str(tmp_path / "file" / "s.png")])
    assert res.exit_code == 1 and res.output.startswith(f"Error: cannot write {tmp_path / 'file'}")
    assert len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(show_command, [str(root), "--n", "3", "--out", str(tmp_path / "new" / "dir" / "s.png")])
    assert res.exit_code == 0 and (tmp_path / "new" / "dir" / "s.png").is_file()


@pytest.mark.parametrize(("preset", "side", "crop", "out_side"), [
    ("auto", 32, None, 32),  # a 32x32 cache: cifar's RandomCrop(32, padding=4)
    ("cifar-eval", 32, None, 32),
    ("auto", 40, 24, 24),  # else imagenet's RandomResizedCrop(crop)
    ("imagenet-eval", 40, 32, 32),  # Resize(round(32 / 0.875)) + CenterCrop(32)
])
def test_each_preset_gives_its_geometry(tmp_path: Path, preset: str, side: int, crop: int | None,
                                        out_side: int) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=20, h=side, w=side)
    reader = open_cache(root)
    sheet = show(reader, Selection(np.arange(20)), augment=augment_view(preset, reader.manifest.shape, crop, 1))
    for t in sheet.tiles:
        x0, y0, x1, y1 = t.augmented
        assert (x1 - x0, y1 - y0) == (out_side * sheet.scale,) * 2
    stored = np.stack([_tile_pixels(sheet.image, t.stored, sheet.scale) for t in sheet.tiles])
    shown = np.stack([_tile_pixels(sheet.image, t.augmented, sheet.scale) for t in sheet.tiles])
    if preset == "cifar-eval":  # Normalize only: undone for display, the stored pixels to rounding
        assert np.abs(shown.astype(int) - stored.astype(int)).max() <= 1
    else:
        assert not np.array_equal(shown, stored[:, :out_side, :out_side])


def test_class_names_carry_imagenet_words() -> None:
    from cachebuild.inspect.show import class_label

    classes = ("n01440764", "n01443537")
    assert class_label(classes, ["tench, Tinca tinca", ""], 0) == "n01440764 tench, Tinca tinca"
    assert class_label(classes, ["tench, Tinca tinca", ""], 1) == "n01443537"
    assert class_label(classes, None, 1) == "n01443537" and class_label(classes, None, 7) == "class 7"


def _caption_pixels(sheet, k: int) -> np.ndarray:
    x0, _, _, y1 = sheet.tiles[k].stored
    return sheet.image[y1 + 2 : y1 + 2 + 3 * 13, x0 : x0 + 200]


@pytest.mark.parametrize("a, b", [("Жук.jpg", "Лук.jpg"), ("αβγ.png", "δεζ.png"), ("café.jpg", "cafè.jpg"),
                                  ("שלום.jpg", "עולם.jpg")])
def test_non_ascii_names_are_drawn_not_boxes(a: str, b: str) -> None:
    """Two names that differ only in letters outside ASCII draw differently: each letter is a glyph, not the
    one box a font draws for every character it lacks."""
    from cachebuild.inspect import compose_sheet

    tiles = np.full((2, 16, 16, 3), 90, np.uint8)
    sheet = compose_sheet(tiles, [0, 1], [0, 0], ["class", "class"], [a, b])
    assert sheet.missing_glyphs == ""
    assert not np.array_equal(_caption_pixels(sheet, 0), _caption_pixels(sheet, 1))


def test_characters_no_font_draws_are_said(tmp_path: Path) -> None:
    """A character no installed font has (a private-use code point here) stays a box, and show says so."""
    from cachebuild.inspect import compose_sheet
    from cachebuild.storage.cache import write_cache

    odd = "\U000f0001"
    sheet = compose_sheet(np.zeros((1, 16, 16, 3), np.uint8), [0], [0], ["c"], [f"x{odd}.jpg"])
    assert sheet.missing_glyphs == odd
    root, *_ = inspect_cache(tmp_path / "c", h=16, w=16)
    write_cache(tmp_path / "odd", open_cache(root).gather(range(2)), np.zeros(2, np.int64), ["c"],
                paths=[f"a{odd}.jpg", "b.jpg"])
    res = CliRunner().invoke(show_command, [str(tmp_path / "odd"), "--out", str(tmp_path / "s.png")])
    assert res.exit_code == 0, res.output
    assert "no installed font draws 1 character(s)" in res.stderr and odd in res.stderr and "--layout" in res.stderr
