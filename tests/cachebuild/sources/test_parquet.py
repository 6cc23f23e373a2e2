"""Hugging Face Parquet files as a source: what `datasets` itself reads, the same pixels as the folder tree,
bad rows listed, clear errors for files without the columns, URLs through the loopback servers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.errors import DecodeError, SourceError
from cachebuild.sources.shards.files import close_handles
from cachebuild.sources.shards.parquet import ParquetColumns, parquet_plan
from cachebuild.storage.cache import open_cache, read_manifest
from support.parquet_layout import hf_features_metadata, write_hf_parquet
from tests.shard_fixtures import SIZE, cache_view


def _hf_names(info) -> dict[str, str]:
    """provenance 'file.parquet#row' -> the name of the source image in that row."""
    return {f"{r['file'].name}#{r['row']}": r["image"].name for r in info["rows"] if r["image"] is not None}


def _data(info) -> Path:
    return info["files"][0].parent


def test_plan_sees_what_datasets_reads(hf_set, tmp_path, monkeypatch):
    """`datasets.load_dataset("parquet")` as the oracle: same rows in the same order, labels, class names and
    image bytes as our plan records; the rows it has without bytes or label are the ones we list as bad."""
    for var, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
                       "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}.items():
        monkeypatch.setenv(var, value)
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    datasets.disable_progress_bars()
    files = [str(f) for f in hf_set["files"]]
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf-cache"))
    ds = ds.cast_column("image", datasets.Image(decode=False))
    plan = parquet_plan(_data(hf_set))
    assert len(ds) == len(plan)
    assert list(plan.keys) == [f"{r['file'].name}#{r['row']}" for r in hf_set["rows"]]
    assert ds.features["label"].names == plan.classes
    problems = plan.reader.table.problems
    bad = []
    for i, row in enumerate(ds):
        if row["label"] is None or row["image"]["bytes"] is None:
            bad.append(i)
            continue
        assert plan.labels[i] == row["label"], plan.keys[i]
        assert plan.reader(i, plan.keys[i]) == row["image"]["bytes"], plan.keys[i]
    assert len(bad) == 2 and set(problems) == {i for i in bad if ds[i]["label"] is None}
    no_bytes = next(i for i in bad if ds[i]["image"]["bytes"] is None)
    with pytest.raises(DecodeError, match="no image bytes"):
        plan.reader(no_bytes, plan.keys[no_bytes])
    assert plan.split == "train" and plan.dataset == "imagenet-1k"


def test_same_pixels_and_labels_as_the_folder_tree(hf_set, folder_cache, tmp_path):
    plan = parquet_plan(_data(hf_set))
    result = build(plan, tmp_path / "hf", BuildOptions(size=SIZE, jobs=2, block_size=8))
    names = _hf_names(hf_set)
    view = cache_view(result.path, names)
    assert set(view.by_name) == set(folder_cache.by_name) | {hf_set["broken"]["null_label"]["image"].name}
    for name, (pixels, label) in folder_cache.by_name.items():
        assert np.array_equal(view.by_name[name][0], pixels) and view.by_name[name][1] == label, name
    in_tree = {Path(p).name for p in folder_cache.failures if "_broken_unreadable" not in p}  # a link: not packed
    b = hf_set["broken"]
    failed = {names.get(p, p) for p in view.failures}
    prov = {k: f"{e['file'].name}#{e['row']}" for k, e in b.items()}
    assert failed == in_tree | {prov["no_bytes"], b["null_label"]["image"].name}
    assert view.failures[prov["no_bytes"]].startswith("the row has no image bytes")
    assert view.failures[prov["null_label"]] == "no label (null)"
    assert view.manifest.classes == tuple(plan.classes) and open_cache(result.path).verify() == []
    one = build(plan, tmp_path / "hf1", BuildOptions(size=SIZE, jobs=1, block_size=8))
    assert [s.digest for s in read_manifest(one.path).shards] == [s.digest for s in view.manifest.shards]


def test_a_row_group_is_read_once_per_block(hf_set, monkeypatch):
    """A worker reads a row group's image column once and serves the block's samples in it from memory (it
    keeps the last one, so the next block starting in the same group reads nothing)."""
    plan = parquet_plan(_data(hf_set))
    reads = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, *a, **k: reads.append(i) or real(self, i, *a, **k))
    close_handles()
    block, runs, last = 8, 0, None
    c = plan.reader.table.columns
    for lo in range(0, len(plan), block):
        reader = plan.reader.for_block(lo, lo + block)
        for i in range(lo, min(lo + block, len(plan))):
            if i in plan.reader.table.problems:
                continue
            group = (int(c["file"][i]), int(c["group"][i]))
            runs, last = runs + (group != last), group
            try:
                reader(i, plan.keys[i])
            except Exception as e:  # the row without bytes
                assert "no image bytes" in str(e)
    n_groups = sum(pq.ParquetFile(f).metadata.num_row_groups for f in hf_set["files"])
    assert len(reads) == runs == n_groups < len(plan) // 3


def _table(**columns) -> pa.Table:
    return pa.table(columns)


def test_columns_by_name_binary_images_and_legacy_metadata(hf_set, tmp_path):
    images = hf_set["images"][:6]
    legacy = write_hf_parquet(images, tmp_path / "legacy", ["a", "b", "c", "d"], n_files=1, legacy_metadata=True)
    plan = parquet_plan(_data(legacy))
    assert plan.classes == ["a", "b", "c", "d"] and len(plan) == 6
    # a plain binary image column and other column names, no metadata: named by the user
    t = _table(jpg=pa.array([im.data for im in images], pa.binary()), cls=pa.array([im.label for im in images]))
    (tmp_path / "plain").mkdir()
    pq.write_table(t, tmp_path / "plain" / "part-0.parquet")
    with pytest.raises(SourceError, match=r"part-0\.parquet has no image column: no column 'image'.*"
                                          r"\(its columns: jpg, cls\); pass --image-column NAME"):
        parquet_plan(tmp_path / "plain")
    named = parquet_plan(tmp_path / "plain", columns=ParquetColumns(image="jpg", label="cls"),
                         classes=["w", "x", "y", "z"])
    assert [named.reader(i, k) for i, k in enumerate(named.keys)] == [im.data for im in images]
    assert named.labels.tolist() == [im.label for im in images] and named.classes == ["w", "x", "y", "z"]
    with pytest.raises(SourceError, match=r"has no column 'photo' \(its columns: jpg, cls\)"):
        parquet_plan(tmp_path / "plain", columns=ParquetColumns(image="photo", label="cls"))
    # string labels are not class indices
    pq.write_table(_table(image=pa.array([b"x"]), label=pa.array(["cat"])), tmp_path / "str.parquet")
    with pytest.raises(SourceError, match=r"label column 'label' is string, not integers"):
        parquet_plan(tmp_path / "str.parquet")


def test_bad_files_and_labels(hf_set, tmp_path):
    images = hf_set["images"][:4]
    src = tmp_path / "ds" / "data"
    src.mkdir(parents=True)
    meta = {b"huggingface": hf_features_metadata(["a", "b"])}
    t = _table(image=pa.array([{"bytes": im.data, "path": im.name} for im in images]),
               label=pa.array([0, -1, 1, 7], pa.int64())).replace_schema_metadata(meta)
    pq.write_table(t, src / "test-00000-of-00001.parquet")
    plan = parquet_plan(src)
    assert plan.split == "test" and plan.dataset == "ds"
    assert plan.reader.table.problems == {1: "no label (a negative label means unlabelled)",
                                          3: "label 7 is not a class index: expected 0..1"}
    (src / "test-00000-of-00001.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SourceError, match=r"test-00000-of-00001\.parquet is not a readable Parquet file"):
        parquet_plan(src)
    empty = tmp_path / "nothing"
    empty.mkdir()
    r = CliRunner().invoke(main, ["parquet", str(empty), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "nothing holds no Parquet files" in r.output
    no_image = tmp_path / "noimg.parquet"
    pq.write_table(_table(text=pa.array(["hi"]), label=pa.array([0])), no_image)
    r = CliRunner().invoke(main, ["parquet", str(no_image), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1
    assert "noimg.parquet has no image column" in r.output and "(its columns: text, label)" in r.output


def test_cli_picks_the_split_and_names_the_dataset(hf_set, tmp_path):
    root = tmp_path / "imagenet-1k"
    shutil.copytree(_data(hf_set), root / "data")
    first = hf_set["files"][0]
    shutil.copy(first, root / "data" / "validation-00000-of-00001.parquet")
    r = CliRunner().invoke(main, ["parquet", str(root / "data"), "--size", str(SIZE), "-j", "1", "--no-progress"],
                           env={"CACHEBUILD_HOME": str(tmp_path / "home")})
    assert r.exit_code != 0 and "several splits (train, validation): pass --split" in r.output
    r = CliRunner().invoke(main, ["parquet", str(root / "data"), "--split", "validation", "--size", str(SIZE), "-j",
                                  "1", "--no-progress"], env={"CACHEBUILD_HOME": str(tmp_path / "home")})
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "home" / f"imagenet-1k-{SIZE}" / "validation")
    assert m.source["files"] == pq.ParquetFile(first).metadata.num_rows
    assert json.loads(json.dumps(m.extra))["source_format"] == "parquet"
    assert all(p.startswith("validation-00000-of-00001.parquet#") for p in open_cache(
        tmp_path / "home" / f"imagenet-1k-{SIZE}" / "validation").paths())


def test_http_glob_and_s3_prefix_give_the_local_cache(hf_set, http_server, s3, tmp_path):
    opts = BuildOptions(size=SIZE, jobs=1, block_size=16)
    local = read_manifest(build(parquet_plan(_data(hf_set)), tmp_path / "local", opts).path)
    total = sum(f.stat().st_size for f in hf_set["files"])
    server = http_server(_data(hf_set).parent)
    plan = parquet_plan(f"{server.url}/data/train-*.parquet")
    assert plan.root == f"{server.url}/data" and plan.keys == parquet_plan(_data(hf_set)).keys
    server.clear()
    close_handles()
    got = read_manifest(build(plan, tmp_path / "http", opts).path)
    assert [s.digest for s in got.shards] == [s.digest for s in local.shards] and got.failures == local.failures
    assert all(r.status == 206 for r in server.log.matching("GET")) and server.log.bytes() < 2 * total
    for f in hf_set["files"]:
        s3.fs.put_file(str(f), s3.url(f"imagenet-1k/data/{f.name}"))
    plan = parquet_plan(s3.url("imagenet-1k/data/"))
    assert plan.dataset == "imagenet-1k" and plan.classes == parquet_plan(_data(hf_set)).classes
    s3.log.clear()
    got = read_manifest(build(plan, tmp_path / "s3", opts).path)
    assert [s.digest for s in got.shards] == [s.digest for s in local.shards]
    assert s3.log.bytes() < 2 * total
