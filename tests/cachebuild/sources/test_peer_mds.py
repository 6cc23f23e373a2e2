"""MosaicML Streaming MDS datasets into caches, read from the layout without streaming: shards that
mosaicml-streaming 0.13.0 wrote (golden), converted with their labels, order and pixels for each image column;
cut shards, foreign indexes, compressed shards and unreadable columns refused before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cachebuild.sources.peers.common import PeerOptions
from cachebuild.sources.peers.mds import mds_plan
from cachebuild.sources.registry import plan_source, replan
from tests.cachebuild.sources.peer_files.peer_checks import (
    HERE,
    LABELS,
    SIZE,
    cli,
    converts_and_reads,
    copy_of,
    payload_shas,
    refused,
    sha,
)

GOLDEN = HERE / "mds"
N = len(LABELS)


def _index(folder: Path) -> dict:
    return json.loads((folder / "index.json").read_text())


def _edit_index(folder: Path, edit) -> None:
    index = _index(folder)
    edit(index)
    (folder / "index.json").write_text(json.dumps(index))


def test_the_plan_reads_every_column_the_writer_wrote(peer_reference):
    shards = [s["raw_data"]["basename"] for s in _index(GOLDEN)["shards"]]
    counts = [s["samples"] for s in _index(GOLDEN)["shards"]]
    assert len(shards) > 3  # samples span several shards, in index order
    want_keys = [f"{name}#{j}" for name, n in zip(shards, counts, strict=True) for j in range(n)]
    jpegs = payload_shas(GOLDEN)["image"]
    for column in ("image", "pil", "array"):
        plan = mds_plan(GOLDEN, PeerOptions(image_field=column))
        assert list(plan.keys) == want_keys and plan.labels.tolist() == LABELS, column
        for i in range(N):
            got = plan.reader(i, plan.keys[i])
            if column == "image":
                assert isinstance(got, bytes) and sha(got) == jpegs[i], i
            else:  # raw pixels, exactly the originals
                assert np.array_equal(got, peer_reference["originals"][i]), (column, i)
    assert (plan.dataset, plan.split, plan.extra["source_format"]) == ("mds", "train", "mds")


@pytest.mark.parametrize("column", ["image", "pil", "array"])
def test_an_mds_dataset_converts_to_a_cache_that_every_command_reads(peer_reference, tmp_path, column):
    converts_and_reads("mds", GOLDEN, column, jpeg=column == "image", first_key="shard.00000.mds#0",
                       reference=peer_reference, out=tmp_path / "out")


def test_status_names_the_samples_of_a_rewritten_shard_and_the_recipe_replans(tmp_path):
    src = copy_of(GOLDEN, tmp_path / "photos")
    out = tmp_path / "out"
    assert cli("mds", src, "--size", SIZE, "--out", out, "--no-progress", "--name", "pets").exit_code == 0
    assert "up to date" in cli("status", out / "train").output
    plan = plan_source("mds", src)[0]
    assert replan(plan.recipe, None, []).source_digest == plan.source_digest
    shard = src / "shard.00001.mds"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    r = cli("status", out / "train", "--json")
    assert r.exit_code == 1, r.output
    n0 = _index(src)["shards"][0]["samples"]
    n1 = _index(src)["shards"][1]["samples"]
    # the shard's mtime changed, its samples' bytes did not: each read and found the same (touched, not modified)
    assert json.loads(r.output)["examples"]["touched"] == [f"shard.00001.mds#{j}" for j in range(n1)]
    assert (json.loads(r.output)["touched"], json.loads(r.output)["modified"]) == (n1, 0) and n0 > 0


def test_split_folders_are_picked_by_split(tmp_path):
    root = tmp_path / "photos"
    copy_of(GOLDEN, root / "val")
    copy_of(GOLDEN, root / "train")
    assert "one Streaming MDS dataset per split (train, val)" in refused("mds", root, tmp_path / "out")
    plan = mds_plan(root, PeerOptions(split="val"))
    assert (plan.split, plan.dataset, plan.root) == ("val", "photos", str(root / "val"))
    assert plan_source("mds", root / "train")[0].split == "train"


def test_a_truncated_shard_is_refused_and_nothing_is_written(tmp_path):
    src = copy_of(GOLDEN, tmp_path / "src")
    shard = src / "shard.00002.mds"
    shard.write_bytes(shard.read_bytes()[:-100])
    text = refused("mds", src, tmp_path / "out")
    assert str(shard) in text and "truncated" in text and "write it again" in text
    # the index rewritten to match the cut file: the shard's own offsets give it away
    _edit_index(src, lambda ix: ix["shards"][2]["raw_data"].update(bytes=shard.stat().st_size))
    text = refused("mds", src, tmp_path / "out")
    assert str(shard) in text and "truncated" in text


def test_foreign_and_unfinished_folders_are_refused(tmp_path):
    text = refused("mds", HERE / "litdata", tmp_path / "out")
    assert str(HERE / "litdata" / "index.json") in text and "not a Streaming index of version 2" in text
    empty = tmp_path / "unfinished"
    copy_of(GOLDEN, empty)
    (empty / "index.json").unlink()
    text = refused("mds", empty, tmp_path / "out")
    assert f"{empty} holds no index.json" in text and "interrupted" in text
    (empty / "index.json").write_text("{not json")
    assert "not JSON" in refused("mds", empty, tmp_path / "out")


def test_compressed_shards_and_unreadable_columns_are_refused(tmp_path):
    src = copy_of(GOLDEN, tmp_path / "src")

    def compressed(ix: dict) -> None:
        s = ix["shards"][0]
        s.update(compression="zstd", zip_data={"basename": "shard.00000.mds.zstd", "bytes": 10, "hashes": {}})

    (src / "shard.00000.mds").rename(src / "shard.00000.mds.zstd")
    _edit_index(src, compressed)
    text = refused("mds", src, tmp_path / "out")
    assert "compressed (zstd)" in text and "compression=None" in text
    src = copy_of(GOLDEN, tmp_path / "src2")

    def encodings(values: dict) -> None:
        def edit(ix: dict) -> None:
            for s in ix["shards"]:
                s["column_encodings"] = [values.get(n, e) for n, e in zip(s["column_names"], s["column_encodings"],
                                                                          strict=True)]
        _edit_index(src, edit)

    encodings({"image": "pkl"})
    assert "field 'image' is pkl: pickled objects: cachebuild never unpickles" in refused("mds", src, tmp_path / "o")
    encodings({"image": "jpeg", "label": "str"})
    text = refused("mds", src, tmp_path / "o")
    assert "field 'label' is str: not an integer encoding" in text and "--label-field" in text
    encodings({"label": "int", "array": "ndarray:float32"})
    text = refused("mds", src, tmp_path / "o", "--image-field", "array")
    assert "only uint8 images are read" in text
    # payloads that are not what the encoding says: refused on the first sample, not skipped one by one
    encodings({"array": "ndarray"})
    text = refused("mds", src, tmp_path / "o", "--image-field", "array")
    assert "its first image, shard.00000.mds#0, cannot be read" in text, text
