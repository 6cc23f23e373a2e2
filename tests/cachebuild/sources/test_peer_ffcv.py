"""FFCV .beton files into caches, read from the layout without ffcv: a file ffcv 1.0.2 wrote (golden, with
the payloads ffcv's own Reader located), converted with its labels, order and pixels; cut, foreign and custom-
field files refused before anything is written."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest

from cachebuild.errors import SourceError
from cachebuild.sources.peers.common import PeerOptions
from cachebuild.sources.peers.ffcv import ffcv_plan
from cachebuild.sources.registry import plan_source, replan
from tests.cachebuild.sources.peer_files.peer_checks import (
    HERE,
    LABELS,
    SIZE,
    build_folder,
    cache_samples,
    cli,
    payload_shas,
    psnr,
    refused,
    sha,
)

GOLDEN = HERE / "ffcv"


@pytest.fixture
def beton(tmp_path: Path) -> Path:
    """The golden .beton, unpacked (it is kept gzipped: FFCV pads each 2 MiB page with zeros)."""
    out = tmp_path / "src" / "photos.beton"
    out.parent.mkdir()
    with gzip.open(GOLDEN / "photos.beton.gz") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


def test_the_plan_finds_the_payloads_ffcvs_reader_finds(beton, peer_reference):
    plan = ffcv_plan(beton, PeerOptions())
    assert list(plan.keys) == [f"photos.beton#{i}" for i in range(len(LABELS))]
    assert plan.labels.tolist() == LABELS and plan.classes == ["0", "1", "2", "3"]
    assert (plan.dataset, plan.split, plan.extra["source_format"]) == ("photos", "train", "ffcv")
    modes = plan.reader.table.columns["mode"].tolist()
    assert sorted(set(modes)) == [0, 1]  # 'smart' wrote both: JPEG over its threshold, raw under it
    for i, want in enumerate(payload_shas(GOLDEN)["image"]):
        got = plan.reader(i, plan.keys[i])
        if modes[i] == 1:  # raw: the original's pixels, exactly
            assert isinstance(got, np.ndarray) and np.array_equal(got, peer_reference["originals"][i]), i
            assert sha(got) == want
        else:
            assert isinstance(got, bytes) and got[:2] == b"\xff\xd8" and sha(got) == want, i


def test_a_beton_converts_to_a_cache_that_every_command_reads(beton, peer_reference, tmp_path):
    out = tmp_path / "out"
    r = cli("ffcv", beton, "--size", SIZE, "--out", out, "--no-progress")
    assert r.exit_code == 0, r.output
    pixels, labels, keys = cache_samples(out / "train")
    assert labels == LABELS and keys == [f"photos.beton#{i}" for i in range(len(LABELS))]
    plan = ffcv_plan(beton, PeerOptions())
    modes = plan.reader.table.columns["mode"].tolist()
    jpegs = tmp_path / "jpegs"
    for i, mode in enumerate(modes):
        if mode == 1:  # raw pixels, resized as the build resizes the lossless original
            assert np.array_equal(pixels[i], peer_reference["pixels"][i]), i
        else:
            (jpegs / f"c{LABELS[i]}").mkdir(parents=True, exist_ok=True)
            (jpegs / f"c{LABELS[i]}" / f"{i:02d}.jpg").write_bytes(plan.reader(i, plan.keys[i]))
    # the JPEG samples are what a build of the very JPEG files FFCV stored makes
    from_files = build_folder(jpegs, tmp_path / "jpeg-ref")
    for i, ref in from_files.items():
        assert np.array_equal(pixels[i], ref), i
        # and near the originals: FFCV encodes with OpenCV at quality 97 and 4:2:0 chroma, which alone costs
        # these small, detailed crops 33-50 dB (measured against the lossless originals)
        assert psnr(pixels[i], peer_reference["pixels"][i]) > 32, i
    for command in (("info",), ("verify",), ("status",)):
        r = cli(*command, out / "train")
        assert r.exit_code == 0, (command, r.output)
    assert "up to date" in cli("status", out / "train").output
    # the recipe plans it again, to the same plan
    again = replan(plan_source("ffcv", beton)[0].recipe, None, [])
    assert again.source_digest == plan.source_digest


def test_the_bytes_field_holds_image_files_and_the_fields_are_chosen_by_name(beton, peer_reference, tmp_path):
    out = tmp_path / "out"
    r = cli("ffcv", beton, "--image-field", "png", "--size", SIZE, "--out", out, "--no-progress", "--split", "val")
    assert r.exit_code == 0, r.output
    pixels, labels, _ = cache_samples(out / "val")
    assert labels == LABELS
    for i in range(len(LABELS)):  # PNG files: lossless, so exactly the reference
        assert np.array_equal(pixels[i], peer_reference["pixels"][i]), i
    text = refused("ffcv", beton, tmp_path / "o2", "--image-field", "weight")
    assert "field 'weight' is FloatField" in text and "--image-field" in text and "png (BytesField)" in text
    text = refused("ffcv", beton, tmp_path / "o3", "--label-field", "image")
    assert "field 'image' is RGBImageField: not an IntField" in text
    text = refused("ffcv", beton, tmp_path / "o4", "--label-field", "nope")
    assert "has no field 'nope'" in text and "label (IntField)" in text


def _cut(beton: Path, size: int) -> Path:
    data = beton.read_bytes()[:size]
    beton.write_bytes(data)
    return beton


@pytest.mark.parametrize("where", ["in the allocation table", "in the data", "in the header"])
def test_a_truncated_beton_is_refused_and_nothing_is_written(beton, tmp_path, where):
    full = beton.stat().st_size
    cut = {"in the allocation table": full - 7, "in the data": 2 * 1024 * 1024 + 5000, "in the header": 20}[where]
    text = refused("ffcv", _cut(beton, cut), tmp_path / "out")
    assert str(beton) in text and ("truncated" in text or "shorter than an FFCV header" in text), text
    assert "again" in text or "not a .beton" in text


def test_other_files_and_custom_fields_are_refused(beton, tmp_path):
    png = next((HERE / "originals").rglob("*.png"))
    text = refused("ffcv", png, tmp_path / "out")
    assert str(png) in text and "not an FFCV .beton" in text
    mds_index = HERE / "mds" / "index.json"
    assert "not an FFCV .beton" in refused("ffcv", mds_index, tmp_path / "out")
    # a custom field (type id 255): its metadata size is unknowable, so no sample can be located
    data = bytearray(beton.read_bytes())
    weight = 24 + 2 * 1041  # the third field's descriptor: its type id byte
    assert data[weight + 1:weight + 7] == b"weight"
    data[weight] = 255
    beton.write_bytes(bytes(data))
    text = refused("ffcv", beton, tmp_path / "out")
    assert "field 'weight' has FFCV type id 255 (a custom field)" in text and str(beton) in text
    folder = beton.parent
    assert "is a folder: name the .beton file (photos.beton)" in refused("ffcv", folder, tmp_path / "out")
    with pytest.raises(SourceError, match="cannot read the FFCV file"):
        ffcv_plan(tmp_path / "missing.beton", PeerOptions())
