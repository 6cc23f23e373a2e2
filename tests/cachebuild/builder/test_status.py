"""status (stale or not, from the build's own fingerprint inputs, nothing decoded), ls, verify --quick,
expect_fingerprint, and what a shared cache records about who built it."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import FingerprintMismatchError
from cachebuild.storage.cache import current_host, current_user, read_manifest, write_cache
from loaders.dataset import CachedImageDataset, DatasetOptions
from tests.loaders_fixtures import make_cache, make_images


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def built(imagenet_clean, tmp_path):
    """A copy of a small ImageNet tree and the cache of its train split."""
    src = tmp_path / "src"
    shutil.copytree(imagenet_clean["root"], src)
    r = _cli("imagenet", src, "--split", "train", "--size", "16", "--out", tmp_path / "out", "-j", "1",
             "--no-progress")
    assert r.exit_code == 0, r.output
    return src, tmp_path / "out" / "train"


def test_status_is_up_to_date_then_stale_after_add_remove_touch(built, monkeypatch):
    src, cache = built
    import cachebuild.builder.sample as decode

    def no_decoding(*a, **k):
        raise AssertionError("status must not decode anything")

    monkeypatch.setattr(decode, "decode_into", no_decoding)
    r = _cli("status", cache, "--source", src)
    assert r.exit_code == 0 and "up to date" in r.output, r.output
    assert _cli("status", cache).exit_code == 0  # the source root the manifest records
    assert _cli("status", cache, "--source", src / "train").exit_code == 0  # the split folder, as the build allows

    classes = sorted(p for p in (src / "train").iterdir() if p.is_dir())
    files = sorted(classes[0].iterdir())
    shutil.copy(files[0], classes[1] / "added_copy.JPEG")  # added
    files[1].unlink()  # removed
    files[2].write_bytes(files[0].read_bytes())  # modified: other bytes
    st = files[3].stat()
    os.utime(files[3], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: a new mtime, the same bytes
    r = _cli("status", cache, "--source", src, "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.output)
    assert d["status"] == "stale" and (d["added"], d["removed"], d["modified"], d["touched"]) == (1, 1, 1, 1)
    assert d["examples"]["added"] == [f"{classes[1].name}/added_copy.JPEG"]
    assert d["examples"]["removed"] == [f"{classes[0].name}/{files[1].name}"]
    assert d["examples"]["modified"] == [f"{classes[0].name}/{files[2].name}"]
    assert d["examples"]["touched"] == [f"{classes[0].name}/{files[3].name}"]
    assert d["source_digest"]["cache"] != d["source_digest"]["source"]
    r = _cli("status", cache, "--source", src)
    assert r.exit_code == 1 and "stale: 1 added, 1 removed, 1 modified; 1 touched (new mtimes, the same bytes" \
        in r.output, r.output


def test_status_says_when_an_up_to_date_cache_was_written_by_an_older_format(built, tmp_path):
    """Up to date with its source, but a build at its --out asks for --update: status says that too, and
    after the --update it no longer does."""
    from tests.legacy_caches import as_sha256_cache

    src, cache = built
    assert "format version" not in _cli("status", cache, "--source", src).output
    as_sha256_cache(cache, 3)
    r = _cli("status", cache, "--source", src)
    assert r.exit_code == 0 and "up to date" in r.output, r.output
    assert "written in format version 3 (this release writes 4)" in r.output and "--update" in r.output
    assert json.loads(_cli("status", cache, "--source", src, "--json").output)["format_version"] == 3
    r = _cli("imagenet", src, "--split", "train", "--size", "16", "--out", tmp_path / "out", "-j", "1",
             "--no-progress", "--update")
    assert r.exit_code == 0, r.output
    r = _cli("status", cache, "--source", src, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["format_version"] == 4, r.output


def test_status_of_something_else_exits_2(built, tmp_path):
    src, cache = built
    (tmp_path / "empty").mkdir()
    r = _cli("status", tmp_path / "empty", "--source", src)
    assert r.exit_code == 2 and "not a cache" in r.output
    r = _cli("status", tmp_path / "empty", "--json")
    assert r.exit_code == 2 and json.loads(r.output)["status"] == "not a cache"
    r = _cli("status", cache, "--source", tmp_path / "nowhere")
    assert r.exit_code == 2 and "nowhere" in r.output and "Traceback" not in r.output


def test_a_build_records_who_built_it_and_its_per_file_inputs(built):
    _, cache = built
    m = read_manifest(cache)
    assert m.built_by == {"user": current_user(), "host": current_host()}
    table = json.loads((cache / "source_files.json").read_text())
    assert len(table["keys"]) == m.source["files"] == m.count + len(m.failures)
    r = _cli("info", cache)
    assert f"fingerprint: {m.build_key[:12]}" in r.output and current_user() in r.output


def test_ls_lists_caches_with_their_description_and_marks_the_rest(tmp_path):
    root = tmp_path / "shared"
    make_cache(root / "in-224" / "train", n=40, storage="npy")
    make_cache(root / "in-224" / "val", n=12, storage="zarr")
    (root / "in-96" / "train.partial").mkdir(parents=True)  # an unfinished build
    reader = CachedImageDataset(root / "in-224" / "val")
    write_cache(root / "in-224" / "val", make_images(10), np.zeros(10, int), ["x"], storage="zarr", replace=True)
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a cache")
    r = _cli("ls", root)
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].split()[:3] == ["PATH", "DATASET/SPLIT", "SHAPE"]
    body = {line.split()[0]: line for line in lines[1:]}
    train = read_manifest(root / "in-224" / "train")
    assert "arrays/train" in body["in-224/train"] and "8x6x3" in body["in-224/train"]
    assert train.build_key[:12] in body["in-224/train"] and " 40 " in body["in-224/train"]
    assert "(unfinished)" in r.output and "(replaced)" in r.output
    assert not any("notes" in line for line in lines)
    rows = json.loads(_cli("ls", root, "--json").output)
    by_path = {row["path"]: row for row in rows}
    assert by_path["in-224/val"]["count"] == 10 and by_path["in-224/val"]["storage"] == "zarr"
    assert by_path["in-224/train"]["bytes"] == train.files["bytes"]
    assert by_path["in-96/train.partial"]["state"] == "unfinished"
    assert [row["state"] for row in rows].count("replaced") == 1
    del reader


def test_ls_of_a_bucket_never_lists_inside_a_cache(tmp_path, s3):
    make_cache(tmp_path / "c" / "train", n=70, storage="zarr", shard_size=8)  # 9 chunk objects
    make_cache(tmp_path / "c" / "val", n=20, storage="npy")
    assert _cli("push", tmp_path / "c", s3.url("team/c")).exit_code == 0
    s3.log.clear()
    rows = json.loads(_cli("ls", s3.url("team"), "--json").output)
    assert sorted(r["path"] for r in rows) == ["c/train", "c/val"]
    assert {r["count"] for r in rows} == {70, 20}
    listings = [q for q in s3.log if q.path == f"/{s3.name}"]
    assert len(listings) == 4  # team/, team/c/, team/c/train/, team/c/val/: never images.zarr/ or its chunks


def test_verify_quick_checks_structure_without_reading_pixels(tmp_path, http_server):
    root, _, _ = make_cache(tmp_path / "site" / "c", n=200, storage="npy", shard_size=16, h=32, w=32)
    server = http_server(tmp_path / "site")
    url = server.url_for("c")
    for where in (root, url):
        r = _cli("verify", "--quick", where)
        assert r.exit_code == 0 and "ok (quick" in r.output, r.output
    shard_reads = [q for q in server.log if "/images-" in q.path and q.method == "GET"]
    assert shard_reads and all(q.bytes_sent <= 4096 for q in shard_reads)  # headers only: no pixel re-hashed
    shard = root / "images-00003.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert _cli("verify", "--quick", root).exit_code == 0  # same sizes and headers: only a full verify sees it
    assert _cli("verify", root).exit_code == 1
    shard.write_bytes(bytes(data[:-100]))
    for where in (root, url):
        r = _cli("verify", "--quick", where)
        assert r.exit_code == 1 and "images-00003.npy" in r.output


def test_verify_quick_names_a_missing_zarr_chunk_and_a_side_array_of_the_wrong_shape(tmp_path):
    root, _, _ = make_cache(tmp_path / "c", n=40, storage="zarr", shard_size=8)
    (root / "images.zarr" / "c" / "2" / "0" / "0" / "0").unlink()
    np.save(root / "sizes.npy", np.zeros((39, 2), np.int32))
    r = _cli("verify", "--quick", root)
    assert r.exit_code == 1
    assert "c/2/0/0/0" in r.output and "sizes.npy" in r.output


def test_expect_fingerprint_accepts_the_cache_and_refuses_a_rebuilt_one(tmp_path):
    root, images, _ = make_cache(tmp_path / "c", n=30)
    key = read_manifest(root).build_key
    ds = CachedImageDataset(root, DatasetOptions(expect_fingerprint=key[:12].upper()))
    assert np.array_equal(ds.gather(np.arange(30)), images)
    make_cache(tmp_path / "c", n=31)  # rebuilt: other data
    new = read_manifest(root).build_key
    with pytest.raises(FingerprintMismatchError) as e:
        CachedImageDataset(root, DatasetOptions(expect_fingerprint=key[:12]))
    msg = str(e.value)
    assert "\n" not in msg and key[:12] in msg and new[:12] in msg
    for bad in ("", "xyz", "beaf95"):
        with pytest.raises(ValueError, match="8 to 64 hex digits"):
            CachedImageDataset(root, DatasetOptions(expect_fingerprint=bad))


def test_files_are_group_shareable_under_a_group_umask(tmp_path, imagenet_clean):
    """With umask 002 (a team folder) every file and folder cachebuild writes is group-writable: no 0600
    temporary file survives into a cache, a pulled copy or a lock file."""
    old = os.umask(0o002)
    try:
        out = tmp_path / "team"
        assert _cli("imagenet", imagenet_clean["root"], "--split", "val", "--size", "16", "--out", out, "-j", "1",
                    "--format", "zarr", "--no-progress").exit_code == 0
        assert _cli("pull", out / "val", tmp_path / "node" / "val").exit_code == 0
    finally:
        os.umask(old)
    paths = [p for p in tmp_path.rglob("*") if "team" in p.parts or "node" in p.parts]
    assert any(p.name.endswith(".lock") for p in paths) and len(paths) > 20
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        want = 0o070 if p.is_dir() else 0o060
        assert mode & want == want, (p, oct(mode))


def test_pull_up_to_date_when_dest_was_built_here_from_the_same_source(tmp_path):
    """Same build key = same bytes: a pull over a cache built locally from the same source fetches nothing."""
    images = make_images(20)
    a = tmp_path / "a"
    b = tmp_path / "b"
    write_cache(a, images, np.zeros(20, int), ["x"])
    write_cache(b, images, np.zeros(20, int), ["x"])
    before = {p: p.stat().st_mtime_ns for p in b.rglob("*")}
    r = _cli("pull", a, b)
    assert r.exit_code == 0 and "up to date" in r.output
    assert {p: p.stat().st_mtime_ns for p in b.rglob("*")} == before


@pytest.mark.parametrize("kind", ["wds", "parquet"])
def test_status_replans_shard_sources_from_the_recipe_the_build_recorded(kind, wds_set, hf_set, tmp_path):
    """A WebDataset or Parquet cache: status re-plans with the same kind of source and options (the dataset
    name alone would have said "class-folder tree"), up to date, then stale once a shard is rewritten."""

    src_files = wds_set["shards"] if kind == "wds" else hf_set["files"]
    src = tmp_path / "src"
    src.mkdir()
    for f in src_files:
        shutil.copy2(f, src / Path(f).name)
    extra = ["--classes", str(tmp_path / "classes.txt")] if kind == "wds" else []
    if kind == "wds":
        (tmp_path / "classes.txt").write_text("".join(f"c{i}\n" for i in range(4)))
    r = _cli(kind, src, "--size", "16", "--jobs", "1", "--out", tmp_path / "out", *extra)
    assert r.exit_code == 0, r.output
    cache = next(p for p in (tmp_path / "out").iterdir() if (p / "manifest.json").is_file())
    assert json.loads((cache / "manifest.json").read_text())["source"]["recipe"]["kind"] == kind
    r = _cli("status", cache)
    assert r.exit_code == 0 and "up to date" in r.output, r.output
    victim = sorted(src.iterdir())[0]
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    r = _cli("status", cache, "--json")
    assert r.exit_code == 1 and json.loads(r.output)["status"] == "stale", r.output


def test_status_from_another_folder_compares_against_the_tree_the_build_named(imagenet_clean, tmp_path, monkeypatch):
    """A build named its source relatively: status, run from anywhere, plans the same tree (the recipe records
    it absolute), never a folder of the same name where status runs."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    shutil.copytree(imagenet_clean["train_dir"], here / "ds")
    shutil.copytree(imagenet_clean["val_dir"], elsewhere / "ds")  # another tree, under the same relative name
    monkeypatch.chdir(here)
    r = _cli("folder", "ds", "--size", "16", "--out", "c", "-j", "1", "--no-progress")
    assert r.exit_code == 0, r.output
    cache = here / "c" / "train"
    assert read_manifest(cache).source["recipe"]["src"] == str(here / "ds")
    for cwd in (elsewhere, tmp_path):
        monkeypatch.chdir(cwd)
        r = _cli("status", cache)
        assert r.exit_code == 0 and f"up to date with {here / 'ds'}" in r.output, (cwd, r.output)


def test_status_of_a_cache_that_recorded_a_relative_source_plans_it_from_its_recorded_root(imagenet_clean, tmp_path,
                                                                                         monkeypatch):
    """Caches of earlier releases recorded the source as it was named (``ds``): status finds it from the absolute
    root the manifest records, wherever it runs; a name that leads nowhere near that root is one line asking for
    --source."""
    from tests.manifest_edits import load_unsealed

    shutil.copytree(imagenet_clean["root"], tmp_path / "work" / "ds")
    monkeypatch.chdir(tmp_path / "work")
    for kind, name in (("folder", "ds/train"), ("imagenet", "ds")):
        out = tmp_path / "work" / f"c-{kind}"
        r = _cli(kind, name, "--size", "16", "--out", out, "-j", "1", "--no-progress")
        assert r.exit_code == 0, r.output
        manifest = out / "train" / "manifest.json"
        d = load_unsealed(manifest)
        d["source"]["recipe"]["src"] = name  # as an earlier release wrote it
        manifest.write_text(json.dumps(d))
    (tmp_path / "away" / "ds" / "train").mkdir(parents=True)  # a decoy of the same relative name
    monkeypatch.chdir(tmp_path / "away")
    for kind in ("folder", "imagenet"):
        r = _cli("status", tmp_path / "work" / f"c-{kind}" / "train")
        assert r.exit_code == 0 and "up to date" in r.output, (kind, r.output)
    manifest = tmp_path / "work" / "c-folder" / "train" / "manifest.json"
    d = load_unsealed(manifest)
    d["source"]["recipe"]["src"] = "elsewhere/pics"
    manifest.write_text(json.dumps(d))
    r = _cli("status", manifest.parent)
    assert r.exit_code == 2 and "elsewhere/pics" in r.output and "--source" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
