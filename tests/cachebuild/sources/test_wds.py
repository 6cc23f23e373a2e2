"""WebDataset tar shards as a source: what webdataset itself reads, the same pixels as the folder tree,
bad input listed (never extracted), URLs through the loopback servers."""

from __future__ import annotations

import gc
import io
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.errors import CacheExistsError, SourceError
from cachebuild.sources.plan import block_reader
from cachebuild.sources.shards.files import close_handles
from cachebuild.sources.shards.tar_index import index_tar
from cachebuild.sources.shards.wds import IMAGE_KEYS, WdsLayout, wds_plan
from cachebuild.storage.cache import open_cache, read_manifest
from tests.kill_helpers import build_killed_after_blocks
from tests.shard_fixtures import SIZE, cache_view


def _wds_names(info) -> dict[str, str]:
    """provenance 'shard.tar#key' -> the name of the source image packed there ('KIND:name' for the quirky and
    broken copies of an image)."""
    return {f"{s['shard'].name}#{s['key']}": (f"{s['kind']}:" if s["kind"] else "") + s["image"].name
            for s in info["samples"] if s["image"] is not None}


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachebuild", *args], capture_output=True, text=True, **kw)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_plan_sees_what_webdataset_reads(wds_set):
    """webdataset's own reader as the oracle: same samples in the same order, same labels, same image bytes;
    the samples it yields without an image or a label are exactly those our plan lists as bad."""
    import webdataset

    plan = wds_plan(wds_set["pattern"])
    theirs = []
    ds = webdataset.WebDataset([str(s) for s in wds_set["shards"]], shardshuffle=False,
                               handler=webdataset.ignore_and_continue, empty_check=False)
    for sample in ds:
        theirs.append((f"{Path(sample['__url__']).name}#{sample['__key__']}", sample))
    # webdataset leaves its shard streams for the garbage collector to close (and the cut one referenced from
    # its read error): close them here, under this test's warning filter
    del ds, sample
    gc.collect()
    names = {str(s) for s in wds_set["shards"]}
    for obj in gc.get_objects():
        if type(obj) is io.BufferedReader and obj.name in names:
            obj.close()
    assert [k for k, _ in theirs] == list(plan.keys)
    problems = plan.reader.table.problems
    for i, (key, sample) in enumerate(theirs):
        image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        if image is None or "cls" not in sample or i in problems:
            assert i in problems, key
            continue
        assert plan.labels[i] == int(sample["cls"]), key
        assert plan.reader(i, plan.keys[i]) == image, key
    assert len(problems) == 3  # no label, no image, the member cut by the end of the last shard
    assert plan.split == "train" and plan.dataset == "imagenet1k"
    assert plan.classes == [str(i) for i in range(4)]  # no --classes: named by index


def test_same_pixels_and_labels_as_the_folder_tree(wds_set, folder_cache, tmp_path):
    """The tree's images packed as shuffled shards give, image by image, the folder cache's pixels and labels;
    the same broken files fail, plus the samples the shards themselves break."""
    plan = wds_plan(wds_set["pattern"])
    result = build(plan, tmp_path / "wds", BuildOptions(size=SIZE, jobs=2, block_size=8))
    names = _wds_names(wds_set)
    view = cache_view(result.path, names)
    b = wds_set["broken"]
    cut = b["truncated"]["image"].name
    plain = {n for n in view.by_name if ":" not in n}
    assert plain == set(folder_cache.by_name) - {cut} - {e["image"].name for e in wds_set["lost"]}
    for name, (pixels, label) in view.by_name.items():  # quirky copies hold their original's pixels too
        ref_pixels, ref_label = folder_cache.by_name[name.split(":")[-1]]
        assert np.array_equal(pixels, ref_pixels) and label == ref_label, name
    assert sorted(n.split(":")[0] for n in view.by_name if ":" in n) == sorted(
        [*wds_set["quirks"], "dotdot", "absolute"])
    in_tree = {Path(p).name for p in folder_cache.failures if "_broken_unreadable" not in p}  # a link: not packed
    failed = {names.get(p, p) for p in view.failures}
    no_image = f"{b['no_image']['shard'].name}#broken_no_image"
    assert failed == in_tree | {cut, f"no_label:{b['no_label']['image'].name}", no_image}
    assert open_cache(result.path).verify() == []


def test_bad_samples_are_listed_with_shard_key_and_reason(wds_set, tmp_path):
    before = {p for p in Path("/").glob("etc/x*")}
    plan = wds_plan(wds_set["pattern"])
    result = build(plan, tmp_path / "c", BuildOptions(size=SIZE, jobs=1))
    m = read_manifest(result.path)
    reasons = {f.path: f.reason for f in m.failures}
    b = wds_set["broken"]
    prov = {k: f"{e['shard'].name}#{e['key']}" for k, e in b.items()}
    assert reasons[prov["no_label"]].startswith("no label: the sample has no .cls member")
    assert reasons[prov["no_image"]].startswith("no image: none of its members (cls, json)")
    assert reasons[prov["truncated"]].startswith("truncated: the shard ends at byte")
    assert any("_broken_truncated" in p and "truncated JPEG" in r for p, r in reasons.items())
    assert any("_broken_not_an_image" in p and "not an image" in r for p, r in reasons.items())
    # members named ../../x.jpg and /etc/x.jpg are samples like any other, read by offset: their names are
    # provenance only, nothing is written beside the shards, above them, or at /etc/x
    paths = open_cache(result.path).paths()
    assert prov["dotdot"] in paths and prov["absolute"] in paths
    assert prov["dotdot"].endswith("#../../x") and prov["absolute"].endswith("#/etc/x")
    shard_dir = wds_set["shards"][0].parent
    for where in (shard_dir, shard_dir.parent, shard_dir.parent.parent, Path.cwd(), Path.cwd().parent.parent):
        assert not list(where.glob("x.*")) and not (where / "x").exists()
    assert {p for p in Path("/").glob("etc/x*")} == before
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert all(p == "c" or p.startswith("c/") or p == "c.lock" for p in written), written


def test_jobs_do_not_change_a_byte_and_resume_skips_finished_blocks(wds_set, tmp_path):
    plan = wds_plan(wds_set["pattern"])
    a = build(plan, tmp_path / "j1", BuildOptions(size=SIZE, jobs=1, block_size=8))
    b = build(plan, tmp_path / "j2", BuildOptions(size=SIZE, jobs=2, block_size=8))
    ma, mb = read_manifest(a.path), read_manifest(b.path)
    assert [s.digest for s in ma.shards] == [s.digest for s in mb.shards]
    for name in ("labels", "sizes", "paths"):
        assert (a.path / ma.arrays[name].file).read_bytes() == (b.path / mb.arrays[name].file).read_bytes()
    assert ma.failures == mb.failures
    again = build(wds_plan(wds_set["pattern"]), a.path, BuildOptions(size=SIZE, jobs=1, block_size=8))
    assert again.status == "up to date"


def test_a_touched_shard_makes_the_cache_stale(wds_set, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(wds_set["shards"][0].parent, src)
    build(wds_plan(src), tmp_path / "c", BuildOptions(size=SIZE, jobs=1))
    os.utime(sorted(src.glob("*.tar"))[2], ns=(time.time_ns() + 10**9,) * 2)
    with pytest.raises(CacheExistsError):
        build(wds_plan(src), tmp_path / "c", BuildOptions(size=SIZE, jobs=1))
    # a shard rewritten between planning and reading stops the build rather than read the wrong bytes
    plan = wds_plan(src)
    with open(sorted(src.glob("*.tar"))[1], "ab") as f:
        f.write(b"\0" * 10240)
    close_handles()
    with pytest.raises(SourceError, match=r"imagenet1k-train-0001\.tar changed since it was planned"):
        build(plan, tmp_path / "d", BuildOptions(size=SIZE, jobs=1))


def test_a_task_ships_only_its_block_and_a_worker_opens_each_shard_once(wds_set, monkeypatch):
    plan = wds_plan(wds_set["pattern"])
    whole = len(pickle.dumps(plan.reader))
    part = block_reader(plan.reader, 8, 16)  # samples 8..15: the end of shard 0 and the start of shard 1
    assert len(pickle.dumps(part)) < whole / 2 and len(part.table) == 8
    assert [s.name for s in part.shards] == [s.name for s in plan.reader.shards[:2]]
    assert [part(i, plan.keys[i]) for i in range(8, 16) if i not in plan.reader.table.problems] == \
        [plan.reader(i, plan.keys[i]) for i in range(8, 16) if i not in plan.reader.table.problems]
    with pytest.raises(IndexError):
        part(0, plan.keys[0])
    import cachebuild.sources.shards.files as files

    opened = []
    real_open = os.open
    monkeypatch.setattr(files.os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    monkeypatch.setattr(files, "_handles", files._Handles())
    for i in range(len(plan)):
        if i not in plan.reader.table.problems:
            plan.reader(i, plan.keys[i])
    assert sorted(opened) == sorted({str(s) for s in wds_set["shards"]})


def test_label_from_a_json_field_and_class_names(wds_set, tmp_path):
    names = tmp_path / "classes.txt"
    names.write_text("tench\ngoldfish\nwhite shark\n")  # one class too few: label 3 is out of range
    plan = wds_plan(wds_set["pattern"], layout=WdsLayout(label_key="label"), classes=["tench", "goldfish", "shark"])
    by_cls = wds_plan(wds_set["pattern"])
    problems = plan.reader.table.problems
    for i, k in enumerate(plan.keys):
        if i in problems:
            continue
        assert plan.labels[i] == by_cls.labels[i] < 3, k
    out_of_range = [i for i, r in problems.items() if r.startswith("label 3 is not a class index")]
    assert out_of_range and all(by_cls.labels[i] == 3 for i in out_of_range)
    nolabel = plan.keys.index(f"{wds_set['broken']['no_label']['shard'].name}#broken_no_label")
    assert problems[nolabel].startswith("no label: the sample has no .json member")
    assert plan.classes == ["tench", "goldfish", "shark"]
    assert plan.source_digest != by_cls.source_digest


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return path


def test_damaged_tars(wds_set, tmp_path):
    jpeg = wds_set["images"][0].data
    good = _tar(tmp_path / "a-0.tar", [("k1.cls", b"0"), ("k1.jpg", jpeg), ("k2.cls", b"1"), ("k2.jpg", jpeg)])
    data = good.read_bytes()
    # garbage over the second sample's header: the first sample is kept, the rest listed as lost
    second = data.index(b"k2.cls")
    (tmp_path / "a-1.tar").write_bytes(data[:second] + b"\x07" * 512 + data[second + 512 :])
    plan = wds_plan(str(tmp_path / "a-{0..1}.tar"))
    assert plan.keys[:2] == ["a-0.tar#k1", "a-0.tar#k2"] and plan.keys[2] == "a-1.tar#k1"
    damage = plan.keys[3]
    assert damage.startswith("a-1.tar#@") and "members after it are lost" in plan.reader.table.problems[3]
    assert len(plan) == 4
    # a compressed shard is refused up front, naming the file and the fix
    gz = tmp_path / "z.tar.gz"
    with tarfile.open(gz, "w:gz") as tar:
        tar.add(good, arcname="k.jpg")
    with pytest.raises(SourceError, match=r"z\.tar\.gz: compressed tar.*decompress"):
        wds_plan(str(gz))
    # index_tar on its own: a cut inside the first header block is "not a tar"
    assert index_tar(io.BytesIO(data[:100]), 100).damage.startswith("not a tar file")


def test_empty_and_missing_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"empty holds no WebDataset \.tar shards"):
        wds_plan(tmp_path / "empty")
    with pytest.raises(SourceError, match=r"x-1\.tar does not exist \(from .*x-\{0\.\.2\}\.tar\)"):
        _tar(tmp_path / "x-0.tar", [])
        wds_plan(str(tmp_path / "x-{0..2}.tar"))
    with pytest.raises(SourceError, match="hold no samples"):
        wds_plan(str(tmp_path / "x-0.tar"))
    r = CliRunner().invoke(main, ["wds", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "holds no WebDataset .tar shards" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_splits_in_one_folder(wds_set, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shards = wds_set["shards"]
    shutil.copy(shards[0], src / "in1k-train-0000.tar")
    shutil.copy(shards[1], src / "in1k-train-0001.tar")
    shutil.copy(shards[2], src / "in1k-validation-0000.tar")
    with pytest.raises(SourceError, match=r"several splits \(train, validation\): pass --split"):
        wds_plan(src)
    val = wds_plan(src, split="validation")
    assert val.split == "validation" and {k.split("#")[0] for k in val.keys} == {"in1k-validation-0000.tar"}
    assert {k.split("#")[0] for k in wds_plan(src, split="train").keys} == {"in1k-train-0000.tar",
                                                                            "in1k-train-0001.tar"}
    with pytest.raises(SourceError, match="no shards of split 'test'"):
        wds_plan(src, split="test")


def test_cli_builds_named_classes_from_a_brace_pattern(wds_set, tmp_path):
    classes = tmp_path / "classes.txt"
    classes.write_text("\n".join(w.split(",")[0] for w in ("tench", "goldfish", "white shark", "tiger shark")) + "\n")
    r = CliRunner().invoke(main, ["wds", wds_set["pattern"], "--classes", str(classes), "--size", str(SIZE),
                                  "--out", str(tmp_path / "out"), "-j", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "out" / "train")
    assert m.classes == ("tench", "goldfish", "white shark", "tiger shark") and m.dataset == "imagenet1k"
    assert m.source["root"] == str(wds_set["shards"][0].parent)
    r = CliRunner().invoke(main, ["wds", wds_set["pattern"], "--classes", str(tmp_path / "nope.txt"),
                                  "--out", str(tmp_path / "o2")])
    assert r.exit_code != 0 and "nope.txt: cannot read the class names" in r.output


def test_a_brace_pattern_without_braceexpand_names_the_extra(wds_set, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "braceexpand", None)  # as if not installed: the real guard runs
    r = CliRunner().invoke(main, ["wds", wds_set["pattern"], "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and r.output.strip() == (
        f"Error: {wds_set['pattern']}: a brace pattern needs braceexpand: pip install 'cachebuild[wds]' (or name "
        f"the shards by a folder, a prefix or a glob)")
    assert wds_plan(str(wds_set["shards"][0].parent), split="train").keys  # a folder needs no braceexpand


@pytest.mark.slow  # ~10 s; the default run shows resuming after a stopped URL build (test_http_faults_...)
def test_sigkill_then_resume_is_byte_identical(wds_set, tmp_path):
    common = ["--size", str(SIZE), "--shard-size", "4", "--jobs", "1", "--no-progress"]
    ref = _cli("wds", wds_set["pattern"], "--out", str(tmp_path / "ref"), *common)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed"
    n_done = build_killed_after_blocks(["wds", wds_set["pattern"], "--out", str(out), *common],
                                       out / "train.partial" / "blocks")
    assert 3 <= n_done < 16, "the kill must land part way"
    resumed = _cli("wds", wds_set["pattern"], "--out", str(out), *common, "-v")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    ref_dir, got_dir = tmp_path / "ref" / "train", out / "train"
    for p in sorted(ref_dir.iterdir()):
        if p.name != "manifest.json":
            assert (got_dir / p.name).read_bytes() == p.read_bytes(), p.name
    assert read_manifest(ref_dir).failures == read_manifest(got_dir).failures


# ---------------------------------------------------------------- URLs

def test_http_shards_give_the_local_cache_reading_by_range(wds_set, http_server, tmp_path):
    server = http_server(wds_set["shards"][0].parent.parent)
    folder = wds_set["shards"][0].parent.name
    local = build(wds_plan(wds_set["pattern"]), tmp_path / "local", BuildOptions(size=SIZE, jobs=1, block_size=16))
    n = len(wds_set["shards"])
    url = f"{server.url}/{folder}/imagenet1k-train-{{0000..{n - 1:04d}}}.tar"
    plan = wds_plan(url)
    assert plan.root == f"{server.url}/{folder}" and plan.keys == wds_plan(wds_set["pattern"]).keys
    server.clear()
    remote = build(plan, tmp_path / "remote", BuildOptions(size=SIZE, jobs=1, block_size=16))
    ml, mr = read_manifest(local.path), read_manifest(remote.path)
    assert [s.digest for s in ml.shards] == [s.digest for s in mr.shards] and ml.failures == mr.failures
    assert mr.source["root"] == plan.root
    gets = server.log.matching("GET")
    total = sum(s.stat().st_size for s in wds_set["shards"])
    assert all(r.range is not None and r.status == 206 for r in gets)
    assert len(gets) <= 2 * n + len(plan) // 16 + 2  # a few readahead requests per block, not one per sample
    assert server.log.bytes() < 2 * total
    # a folder URL is listed through its index page
    listed = wds_plan(f"{server.url}/{folder}/")
    assert listed.keys == plan.keys and listed.source_digest == plan.source_digest


def test_http_faults_retry_then_stop_and_resume(wds_set, http_server, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_RETRIES", "3")  # the remote layer's tries, read at each call
    server = http_server(wds_set["shards"][0].parent)
    url = f"{server.url}/imagenet1k-train-{{0000..{len(wds_set['shards']) - 1:04d}}}.tar"
    plan = wds_plan(url)
    ref = build(wds_plan(wds_set["pattern"]), tmp_path / "ref", BuildOptions(size=SIZE, jobs=1, block_size=8))
    ref_shards = [s.digest for s in read_manifest(ref.path).shards]
    server.clear()
    server.fail("imagenet1k-train-0002.tar", "drop", times=1)  # a dropped connection is retried
    server.fail("imagenet1k-train-0003.tar", 503, times=1)  # so is a server error
    ok = build(plan, tmp_path / "ok", BuildOptions(size=SIZE, jobs=1, block_size=8))
    assert [s.digest for s in read_manifest(ok.path).shards] == ref_shards
    assert server.log.matching("GET", "/imagenet1k-train-0003.tar")[0].status == 503
    assert server.log.matching("GET", "/imagenet1k-train-0002.tar")[0].bytes_sent > 0  # cut mid-body
    server.fail("imagenet1k-train-0004.tar", 503, times=None)  # a server that keeps failing stops the build
    close_handles()  # as a fresh worker: nothing read ahead
    out = tmp_path / "c"
    with pytest.raises(SourceError, match=r"imagenet1k-train-0004\.tar: reading failed 3 times"):
        build(plan, out / "train", BuildOptions(size=SIZE, jobs=1, block_size=8))
    kept = list((out / "train.partial" / "blocks").glob("*.json"))
    assert kept and not (out / "train").exists()
    server.clear()
    r = CliRunner().invoke(main, ["wds", url, "--size", str(SIZE), "--shard-size", "8", "-j", "1", "--out", str(out),
                                  "--no-progress", "-v"])
    assert r.exit_code == 0, r.output
    assert "resuming" in r.output
    assert [s.digest for s in read_manifest(out / "train").shards] == ref_shards


def test_url_errors_are_one_line(wds_set, http_server, tmp_path):
    server = http_server(wds_set["shards"][0].parent)
    with pytest.raises(SourceError, match=r"nope-1\.tar does not exist"):
        wds_plan(f"{server.url}/nope-{{1..2}}.tar")
    server.fail("imagenet1k-train-0001.tar", 403, times=None, methods=("GET", "HEAD"))
    r = CliRunner().invoke(main, ["wds", f"{server.url}/imagenet1k-train-{{0000..0002}}.tar", "-j", "1", "--out",
                                  str(tmp_path / "o")])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert "imagenet1k-train-0001.tar does not exist (or cannot be listed)" in r.output  # fsspec: 403 on HEAD+GET
    server.fail("imagenet1k-train-0001.tar", 403, times=None, methods=("GET",))  # listed, then refused
    r = CliRunner().invoke(main, ["wds", f"{server.url}/imagenet1k-train-{{0000..0002}}.tar", "-j", "1", "--out",
                                  str(tmp_path / "o")])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert "imagenet1k-train-0001.tar: access denied (HTTP 403)" in r.output  # permanent: not retried


def test_s3_prefix_gives_the_local_cache(wds_set, s3, tmp_path):
    for shard in wds_set["shards"]:
        s3.fs.put_file(str(shard), s3.url(f"in1k-wds/{shard.name}"))
    s3.fs.put_file(str(wds_set["shards"][0]), s3.url("other/ignored.tar"))
    plan = wds_plan(s3.url("in1k-wds/"))
    assert plan.root == s3.url("in1k-wds") and plan.keys == wds_plan(wds_set["pattern"]).keys
    assert all("ETag" in s.version for s in plan.reader.shards)
    s3.log.clear()
    remote = build(plan, tmp_path / "remote", BuildOptions(size=SIZE, jobs=1, block_size=16))
    local = build(wds_plan(wds_set["pattern"]), tmp_path / "local", BuildOptions(size=SIZE, jobs=1, block_size=16))
    assert [s.digest for s in read_manifest(remote.path).shards] == \
        [s.digest for s in read_manifest(local.path).shards]
    gets = s3.log.matching("GET")
    assert gets and all(r.range is not None for r in gets)
    assert s3.log.bytes() < 2 * sum(s.stat().st_size for s in wds_set["shards"])


@pytest.mark.slow
def test_cli_builds_url_shards_on_a_dask_cluster(wds_set, http_server, tmp_path):
    from dask.distributed import LocalCluster

    server = http_server(wds_set["shards"][0].parent)
    url = f"{server.url}/"
    common = ["--size", str(SIZE), "--shard-size", "8", "--no-progress"]
    local = _cli("wds", wds_set["pattern"], "--out", str(tmp_path / "local"), "-j", "1", *common)
    assert local.returncode == 0, local.stderr
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        r = _cli("wds", url, "--out", str(tmp_path / "dask"), "--dask-scheduler", cluster.scheduler_address,
                 *common, "-v")
    assert r.returncode == 0, r.stderr
    ref, got = read_manifest(tmp_path / "local" / "train"), read_manifest(tmp_path / "dask" / "train")
    assert [s.digest for s in ref.shards] == [s.digest for s in got.shards] and ref.failures == got.failures
