"""Block records hold their per-sample fields as arrays and keep them in the staging JSON as base64; records
the previous release wrote (lists of numbers) still read, so a build it left unfinished resumes with this one."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachebuild.builder import pipeline
from cachebuild.builder.destination import prepare_staging
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import read_manifest
from cachebuild.storage.kinds.base import BlockFailure, BlockRecord

_REC = BlockRecord(3, 30, 4, 3, "images-00003.npy", "0" * 64, np.array([30, 31, 33]),
                   np.array([[5, 7], [9, 11], [70_000, 1]]), np.array([[0, 1, 2, 3], [4, 5, 6, 7], [0, 0, 32, 32]]),
                   (BlockFailure(32, {"bytes": "bad_\\xff"}, "truncated"),), 1234, 2)


def _legacy(rec: BlockRecord) -> dict[str, Any]:
    """The record as the previous release's ``to_json`` wrote it: lists of numbers."""
    return {**rec.to_json(), "ok": rec.ok.tolist(), "sizes": rec.sizes.tolist(), "boxes": rec.boxes.tolist()}


def test_a_record_holds_arrays_and_its_json_is_little_endian_base64() -> None:
    assert (_REC.ok.dtype, _REC.sizes.dtype, _REC.boxes.dtype) == (np.int64, np.int32, np.int32)
    assert (_REC.ok.shape, _REC.sizes.shape, _REC.boxes.shape) == ((3,), (3, 2), (3, 4))
    d = json.loads(json.dumps(_REC.to_json(), separators=(",", ":")))
    assert base64.b64decode(d["ok"]) == np.array([30, 31, 33], "<i8").tobytes()
    assert base64.b64decode(d["sizes"]) == np.array([5, 7, 9, 11, 70_000, 1], "<i4").tobytes()
    assert base64.b64decode(d["boxes"]) == np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 32, 32], "<i4").tobytes()
    assert {k: d[k] for k in ("block", "start", "planned", "count", "stored_bytes", "reused")} == {
        "block": 3, "start": 30, "planned": 4, "count": 3, "stored_bytes": 1234, "reused": 2}
    back = BlockRecord.from_json(d)
    assert back == _REC and back.failures == _REC.failures
    assert (back.ok.dtype, back.sizes.shape, back.boxes.shape) == (np.int64, (3, 2), (3, 4))
    raw = BlockRecord(0, 0, 1, 1, "f", "0" * 64, [0], [(2, 3)], [(0, 0, 4, 4)])
    assert "stored_bytes" not in raw.to_json() and "reused" not in raw.to_json()  # raw kinds: as before


def test_the_previous_releases_list_records_read_back_equal() -> None:
    legacy = json.loads(json.dumps(_legacy(_REC)))
    assert isinstance(legacy["sizes"][0], list)
    assert BlockRecord.from_json(legacy) == _REC
    empty = {**_legacy(BlockRecord(5, 50, 2, 0, "f", "0" * 64)), "ok": [], "sizes": [], "boxes": []}
    rec = BlockRecord.from_json(empty)  # a block whose every file failed
    assert (rec.ok.shape, rec.sizes.shape, rec.boxes.shape) == ((0,), (0, 2), (0, 4))
    assert BlockRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec


def test_records_compare_by_value_field_by_field() -> None:
    same = BlockRecord(3, 30, 4, 3, "images-00003.npy", "0" * 64, (30, 31, 33), ((5, 7), (9, 11), (70_000, 1)),
                       ((0, 1, 2, 3), (4, 5, 6, 7), (0, 0, 32, 32)), _REC.failures, 1234, 2)
    assert same == _REC
    assert not (same != _REC)  # noqa: SIM202 (__ne__ from __eq__)
    boxes = _REC.boxes.copy()
    boxes[2, 3] = 31
    sizes = _REC.sizes.copy()
    sizes[0] = (7, 5)
    for other in (BlockRecord(**{**vars(_REC), "boxes": boxes}), BlockRecord(**{**vars(_REC), "sizes": sizes}),
                  BlockRecord(**{**vars(_REC), "ok": np.array([30, 31, 32])}),
                  BlockRecord(**{**vars(_REC), "ok": _REC.ok[:2], "sizes": _REC.sizes[:2], "boxes": _REC.boxes[:2]}),
                  BlockRecord(**{**vars(_REC), "reused": 0}), BlockRecord(**{**vars(_REC), "failures": ()})):
        assert other != _REC
    assert _REC != "a record"
    assert _REC != vars(_REC)  # noqa: SIM300
    with pytest.raises(TypeError):
        hash(_REC)
    with pytest.raises(ValueError):
        _REC.sizes[0, 0] = 1  # frozen: its arrays too
    mine = np.array([30, 31, 33])
    BlockRecord(**{**vars(_REC), "ok": mine})
    mine[0] = 1  # the caller's array is not made read-only


@pytest.mark.parametrize("edit", [
    {"sizes": "not base64!"},  # not base64
    {"ok": base64.b64encode(b"\0" * 12).decode()},  # not a whole number of int64
    {"ok": base64.b64encode(np.arange(2, dtype="<i8").tobytes()).decode()},  # 2 positions for 3 samples
    {"boxes": base64.b64encode(np.zeros(10, "<i4").tobytes()).decode()},  # not whole boxes
    {"sizes": [[5, 7], [9, 11, 1], [3, 4]]},  # a legacy row that is not (h, w)
    {"boxes": [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 32, 32]},  # legacy boxes flattened
    {"ok": {"b64": ""}},
])
def test_a_damaged_record_is_refused_for_the_resume_to_decode_again(edit: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError, KeyError)):
        BlockRecord.from_json({**_REC.to_json(), **edit})


def _files(cache: Path) -> dict[str, bytes]:
    """Every file of a cache by name, the manifest without its times (what differs between two builds)."""
    out = {p.name: p.read_bytes() for p in cache.iterdir() if p.name != "manifest.json"}
    m = json.loads((cache / "manifest.json").read_text())
    m.pop("created")
    out["manifest.json"] = json.dumps({k: v for k, v in m.items() if k not in ("checksum", "content_id")}).encode()
    return out


@pytest.mark.parametrize("legacy", [False, True], ids=["this-release", "previous-release"])
def test_a_killed_build_resumes_from_its_records_byte_identical(imagenet_tree, tmp_path, monkeypatch,
                                                                 legacy: bool) -> None:
    """Every block finished, killed in the finish: the resumed build decodes nothing (it reads each record back,
    in either form) and commits the fresh build's bytes, failures and pad boxes included."""
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    opts = BuildOptions(size=24, jobs=1, block_size=8, fit="pad")
    fresh = build(plan, tmp_path / "fresh", opts)

    def killed(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_finish", killed)
    with pytest.raises(KeyboardInterrupt):
        build(plan, tmp_path / "c", opts)
    monkeypatch.undo()
    staging = tmp_path / "c.partial"
    paths = sorted((staging / "blocks").glob("block-*.json"))
    written = {p: BlockRecord.from_json(json.loads(p.read_text())) for p in paths}
    assert len(paths) == -(-len(plan) // 8) and sum(len(r.failures) for r in written.values()) == 6
    if legacy:
        for p, rec in written.items():
            p.write_text(json.dumps(_legacy(rec), ensure_ascii=False, separators=(",", ":")))
    key = json.loads((staging / "build.json").read_text())["key"]
    assert prepare_staging(staging, key, "npy") == {r.block: r for r in written.values()}

    def no_decode(task: Any) -> None:
        raise AssertionError(f"block {task.block} decoded again")

    monkeypatch.setattr(pipeline, "run_block", no_decode)
    resumed = build(plan, tmp_path / "c", opts)
    assert resumed.count == fresh.count == len(plan) - 6
    assert "boxes" in read_manifest(resumed.path).arrays
    assert _files(resumed.path) == _files(fresh.path)
