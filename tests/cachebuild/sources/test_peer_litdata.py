"""LitData optimize output into caches, read from the layout without litdata: chunks that litdata 0.2.76 wrote
(golden), converted with their labels, order and pixels for each image leaf; cut chunks, foreign indexes,
compressed or encrypted chunks and unreadable leaves refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cachebuild.errors import SourceError
from cachebuild.sources.peers.common import PeerOptions
from cachebuild.sources.peers.litdata import leaf_names, litdata_plan
from cachebuild.sources.registry import plan_source, replan
from tests.cachebuild.sources.peer_files.peer_checks import (
    HERE,
    LABELS,
    converts_and_reads,
    copy_of,
    payload_shas,
    refused,
    sha,
)

GOLDEN = HERE / "litdata"
N = len(LABELS)


def _index(folder: Path) -> dict:
    return json.loads((folder / "index.json").read_text())


def _edit_config(folder: Path, **changes) -> None:
    index = _index(folder)
    index["config"].update(changes)
    (folder / "index.json").write_text(json.dumps(index))


def test_the_plan_reads_every_leaf_the_writer_wrote(peer_reference):
    chunks = _index(GOLDEN)["chunks"]
    assert len(chunks) > 3
    want_keys = [f"{c['filename']}#{j}" for c in chunks for j in range(c["chunk_size"])]
    jpegs = payload_shas(GOLDEN)["jpeg"]
    for leaf in ("image", "jpeg", "array"):
        plan = litdata_plan(GOLDEN, PeerOptions(image_field=leaf))
        assert list(plan.keys) == want_keys and plan.labels.tolist() == LABELS, leaf
        for i in range(N):
            got = plan.reader(i, plan.keys[i])
            if leaf == "jpeg":
                assert isinstance(got, bytes) and sha(got) == jpegs[i], i
            else:  # PIL's raw pixels, numpy's array: exactly the originals
                assert np.array_equal(got, peer_reference["originals"][i]), (leaf, i)
    assert (plan.dataset, plan.split, plan.extra["source_format"]) == ("litdata", "train", "litdata")


@pytest.mark.parametrize("leaf", ["image", "jpeg", "array"])
def test_litdata_output_converts_to_a_cache_that_every_command_reads(peer_reference, tmp_path, leaf):
    converts_and_reads("litdata", GOLDEN, leaf, jpeg=leaf == "jpeg", first_key="chunk-0-0.bin#0",
                       reference=peer_reference, out=tmp_path / "out")
    plan = plan_source("litdata", GOLDEN, PeerOptions(image_field=leaf))[0]
    assert replan(plan.recipe, None, []).source_digest == plan.source_digest


def test_leaves_are_named_by_their_path_in_the_sample():
    leaf = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.tuple", "context": "null", "children_spec": [
        leaf, {"type": "builtins.dict", "context": json.dumps(["label", "w"]), "children_spec": [leaf, leaf]}]}]
    assert leaf_names(json.dumps(spec), 3, "x") == ["0", "1.label", "1.w"]
    assert leaf_names(json.dumps([1, leaf]), 1, "x") == ["item"]
    with pytest.raises(SourceError, match="has 3 leaves, its data_format 2"):
        leaf_names(json.dumps(spec), 2, "x")
    with pytest.raises(SourceError, match="data_spec cannot be read"):
        leaf_names("[2, {}]", 1, "x")


def test_a_truncated_chunk_is_refused_and_nothing_is_written(tmp_path):
    src = copy_of(GOLDEN, tmp_path / "src")
    chunk = src / "chunk-0-3.bin"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    text = refused("litdata", src, tmp_path / "out")
    assert str(chunk) in text and "truncated" in text and "again" in text
    index = _index(src)
    index["chunks"][3]["chunk_bytes"] = chunk.stat().st_size  # an index that agrees: the offsets do not
    (src / "index.json").write_text(json.dumps(index))
    text = refused("litdata", src, tmp_path / "out")
    assert str(chunk) in text and "truncated" in text


def test_foreign_compressed_and_encrypted_outputs_are_refused(tmp_path):
    text = refused("litdata", HERE / "mds", tmp_path / "out")
    assert str(HERE / "mds" / "index.json") in text and "not a LitData index" in text
    src = copy_of(GOLDEN, tmp_path / "src")
    _edit_config(src, compression="zstd")
    assert "compressed with zstd" in refused("litdata", src, tmp_path / "out")
    _edit_config(src, compression=None, encryption={"algorithm": "fernet", "level": "sample"})
    assert "encrypted chunks" in refused("litdata", src, tmp_path / "out")
    _edit_config(src, encryption=None, item_loader="TokensLoader")
    assert "LitData's TokensLoader" in refused("litdata", src, tmp_path / "out")


def test_unreadable_leaves_are_refused_with_the_fields_listed(tmp_path):
    src = copy_of(GOLDEN, tmp_path / "src")
    text = refused("litdata", src, tmp_path / "out", "--image-field", "label")
    assert "field 'label' is int: not an image" in text and "array (numpy)" in text
    _edit_config(src, data_format=["pickle", "jpeg", "numpy", "int"])
    assert "field 'image' is pickle: pickled objects: cachebuild never unpickles" in \
        refused("litdata", src, tmp_path / "out")
    _edit_config(src, data_format=["file:txt", "jpeg", "numpy", "int"])
    assert "field 'image' is file:txt: files of type .txt: not images" in refused("litdata", src, tmp_path / "out")
    _edit_config(src, data_format=["pil", "jpeg", "numpy", "float"])
    assert "field 'label' is float: not an int" in refused("litdata", src, tmp_path / "out")
    # a leaf whose payloads are not what its serializer writes: refused on the first sample
    _edit_config(src, data_format=["pil", "jpeg", "tensor", "int"])
    text = refused("litdata", src, tmp_path / "out", "--image-field", "array")
    assert "its first image, chunk-0-0.bin#0, cannot be read" in text
