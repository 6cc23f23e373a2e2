"""The builder's promises: deterministic, atomic and resumable, honest about bad input, verifiable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.errors import CacheExistsError, DecodeError
from cachebuild.sources.folder import folder_plan
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache, read_manifest
from tests.kill_helpers import build_killed_after_blocks
from tests.legacy_caches import as_sha256_cache


def _train_plan(info):
    return imagenet_plans(info["root"], "train")[0]


def _pixels(path: Path) -> np.ndarray:
    c = open_cache(path)
    return c.gather(np.arange(len(c)))


def test_jobs_do_not_change_a_byte(imagenet_tree, tmp_path):
    plan = _train_plan(imagenet_tree)
    a = build(plan, tmp_path / "j1", BuildOptions(size=64, jobs=1, block_size=8))
    b = build(plan, tmp_path / "j2", BuildOptions(size=64, jobs=2, block_size=8))
    assert a.count == b.count > 0
    ma, mb = read_manifest(a.path), read_manifest(b.path)
    assert [s.digest for s in ma.shards] == [s.digest for s in mb.shards]
    for name in ("labels", "sizes", "paths"):
        assert (a.path / ma.arrays[name].file).read_bytes() == (b.path / mb.arrays[name].file).read_bytes()
    assert np.array_equal(_pixels(a.path), _pixels(b.path))


def test_npy_and_zarr_hold_the_same_pixels(imagenet_tree, tmp_path):
    plan = _train_plan(imagenet_tree)
    npy = build(plan, tmp_path / "npy", BuildOptions(size=48, jobs=1, block_size=8))
    zarr = build(plan, tmp_path / "zarr", BuildOptions(size=48, jobs=1, block_size=8, storage="zarr",
                                                        chunk_size=3, compression="zstd"))
    assert np.array_equal(_pixels(npy.path), _pixels(zarr.path))
    assert np.array_equal(open_cache(npy.path).labels, open_cache(zarr.path).labels)
    assert not list(zarr.path.glob("*.npy.tmp")) and not list(zarr.path.glob("images-*.npy"))
    import zarr as zarr_lib  # readable without this package

    arr = zarr_lib.open_array(str(zarr.path / "images.zarr"), mode="r")
    assert arr.shape == (zarr.count, 48, 48, 3) and arr.chunks == (3, 48, 48, 3)


def _failures_in_the_middle(info, dst: Path):
    """A copy of the train tree with its broken files moved into the second of four classes, so that
    blocks after them must move down (in the original they all sort last)."""
    shutil.copytree(info["train_dir"], dst, symlinks=True)
    classes = sorted(p for p in dst.iterdir() if p.is_dir())
    for f in sorted(dst.rglob("*_broken_*")):
        f.rename(classes[1] / f.name)
    plan = folder_plan(dst)
    bad = [i for i, k in enumerate(plan.keys) if "_broken_" in k]
    assert len(bad) == 6 and bad[0] > 0 and bad[-1] < len(plan) - 12
    return plan


def test_zarr_blocks_with_failures_move_into_place(imagenet_tree, tmp_path):
    """Workers write zarr chunks from each block's plan position; the bad files leave gaps that are
    closed afterwards: same pixels as npy whatever --jobs, checksums intact, nothing stale left over."""
    plan = _failures_in_the_middle(imagenet_tree, tmp_path / "src")
    opts = {"size": 32, "block_size": 7, "storage": "zarr", "chunk_size": 2}  # blocks round down to 6
    assert BuildOptions(**opts).resolved_block() == 6
    npy = build(plan, tmp_path / "npy", BuildOptions(size=32, jobs=1, block_size=6))
    z1 = build(plan, tmp_path / "z1", BuildOptions(jobs=1, **opts))
    z2 = build(plan, tmp_path / "z2", BuildOptions(jobs=2, **opts))
    assert z1.failures == 6 and z1.count == len(plan) - 6
    ref = _pixels(npy.path)
    assert np.array_equal(_pixels(z1.path), ref) and np.array_equal(_pixels(z2.path), ref)
    for c in (z1, z2):
        assert open_cache(c.path).verify() == []
        # zarr keeps the digest (xxh3-128) of each shard range's pixels: the npy shards' rows, as stored
        assert [s.digest for s in read_manifest(c.path).shards] == [
            xxhash.xxh3_128_hexdigest(np.load(npy.path / s.file)) for s in read_manifest(npy.path).shards]
    chunks = sorted(p.relative_to(z1.path) for p in (z1.path / "images.zarr").rglob("*") if p.is_file())
    assert chunks == sorted(p.relative_to(z2.path) for p in (z2.path / "images.zarr").rglob("*") if p.is_file())
    for rel in chunks:
        assert (z1.path / rel).read_bytes() == (z2.path / rel).read_bytes(), rel
    assert len(chunks) == 1 + -(-z1.count // 2)  # zarr.json + one file per chunk: no chunk past the end


def test_bad_files_are_skipped_and_listed(imagenet_tree, tmp_path):
    plan = _train_plan(imagenet_tree)
    result = build(plan, tmp_path / "c", BuildOptions(size=32, jobs=1))
    m = read_manifest(result.path)
    reasons = {Path(f.path).name.split("_broken_")[-1]: f.reason for f in m.failures}
    assert set(reasons) == {"truncated.JPEG", "empty.JPEG", "not_an_image.JPEG", "pixel_bomb.JPEG",
                            "pixel_bomb_sof.JPEG", "unreadable.JPEG"}
    assert "truncated" in reasons["truncated.JPEG"]
    assert "empty" in reasons["empty.JPEG"]
    assert "not an image" in reasons["not_an_image.JPEG"]
    assert "refused before decoding" in reasons["pixel_bomb.JPEG"]
    assert "unreadable" in reasons["unreadable.JPEG"]
    assert m.count == len(plan) - 6
    # Sample i is the i-th readable file of the plan: provenance and labels line up.
    paths = open_cache(result.path).paths()
    readable = [k for k in plan.keys if "_broken_" not in k]
    assert paths == readable
    label_of = dict(zip(plan.keys, plan.labels.tolist(), strict=True))
    assert open_cache(result.path).labels.tolist() == [label_of[p] for p in paths]


def test_on_error_fail_names_the_file_and_keeps_finished_blocks(imagenet_tree, tmp_path):
    plan = _train_plan(imagenet_tree)
    out = tmp_path / "c"
    with pytest.raises(DecodeError) as err:
        build(plan, out, BuildOptions(size=32, jobs=1, block_size=4, on_error="fail"))
    assert "_broken_" in err.value.path
    assert not out.exists()  # nothing half-built is visible
    staging = out.with_name("c.partial")
    finished = list((staging / "blocks").glob("block-*.json"))
    assert finished, "blocks before the bad file must be kept for a resume"
    # The same source and parameters with --on-error skip finish from there.
    result = build(plan, out, BuildOptions(size=32, jobs=1, block_size=4))
    assert result.count == len(plan) - 6 and not staging.exists()


def test_up_to_date_different_and_force(imagenet_clean, tmp_path):
    plan = _train_plan(imagenet_clean)
    out = tmp_path / "c"
    first = build(plan, out, BuildOptions(size=32, jobs=1))
    mtime = (out / "manifest.json").stat().st_mtime_ns
    again = build(plan, out, BuildOptions(size=32, jobs=1))
    assert again.status == "up to date" and (out / "manifest.json").stat().st_mtime_ns == mtime
    with pytest.raises(CacheExistsError):
        build(plan, out, BuildOptions(size=40, jobs=1))
    assert read_manifest(out).shape == (32, 32, 3)  # untouched
    forced = build(plan, out, BuildOptions(size=40, jobs=1, force=True))
    assert forced.status == "built" and read_manifest(out).shape == (40, 40, 3)
    assert first.count == forced.count
    assert not list(tmp_path.glob("c.replaced-*"))  # no reader held the old one: deleted


def test_a_forced_rebuild_names_what_it_replaces(imagenet_clean, tmp_path):
    """--force at an --out of another recipe says what differs, as the refusal without it and --update do."""
    train = tmp_path / "train"
    shutil.copytree(imagenet_clean["train_dir"], train)
    out = tmp_path / "c"
    args = ["folder", str(train), "--out", str(out), "-j", "1", "--no-progress"]
    assert CliRunner().invoke(main, [*args, "--size", "32"]).exit_code == 0
    r = CliRunner().invoke(main, [*args, "--size", "40", "--force"])
    assert r.exit_code == 0, r.output
    assert f"{out / 'train'}: replacing a cache of another recipe (size 32 -> 40)" in r.output, r.output
    victim = next(train.rglob("*.JPEG"))
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    r = CliRunner().invoke(main, [*args, "--size", "40", "--force"])
    assert r.exit_code == 0 and "replacing this recipe's cache of another state of the source" in r.output, r.output


def test_exif_orientation_is_an_option_of_the_pixels_the_key_and_the_recipe(imagenet_tree, tmp_path):
    """--exif-orientation apply turns the sample photos' EXIF-rotated JPEG upright (and records its upright
    size); every other sample keeps its bytes. It is part of the build key and of the recipe: a build or an
    update at the other's --out names it; the default adds nothing to the key, so caches of earlier releases
    (which recorded "ignored") keep theirs."""
    from PIL import Image

    from cachebuild.builder.options import build_key, recipe_differences

    exif = imagenet_tree["quirks"]["exif"]
    train = str(imagenet_tree["train_dir"])
    base = ["folder", train, "--size", "48", "--fit", "squash", "-j", "1", "--no-progress"]
    for name, extra in (("ignore", []), ("apply", ["--exif-orientation", "apply"])):
        r = CliRunner().invoke(main, [*base, "--out", str(tmp_path / name), *extra])
        assert r.exit_code == 0, r.output
    ignore, apply = (open_cache(tmp_path / name / "train") for name in ("ignore", "apply"))
    i = ignore.paths().index(str(Path(exif["path"]).relative_to(train)))
    upright = np.asarray(Image.fromarray(exif["upright"]).resize((48, 48), Image.BILINEAR))
    a, b = apply.gather([i])[0].astype(float), ignore.gather([i])[0].astype(float)
    assert np.abs(a - upright).mean() < 4 < np.abs(b - upright).mean()
    w, h = exif["size"]  # as displayed
    assert apply.sizes[i].tolist() == [h, w] and ignore.sizes[i].tolist() == [w, h]
    others = np.arange(len(ignore)) != i
    assert np.array_equal(ignore.gather(np.flatnonzero(others)), apply.gather(np.flatnonzero(others)))
    assert (ignore.manifest.build["exif_orientation"], apply.manifest.build["exif_orientation"]) == ("ignore", "apply")
    assert ignore.manifest.build_key != apply.manifest.build_key
    for extra in ([], ["--update"]):
        r = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "ignore"), "--exif-orientation", "apply", *extra])
        assert r.exit_code != 0 and "exif_orientation ignore -> apply" in r.output, r.output
    plan = folder_plan(train)
    assert "exif_orientation" not in build_key(plan, BuildOptions(size=48))[1]
    assert recipe_differences({**ignore.manifest.build, "exif_orientation": "ignored"}, build_key(
        plan, BuildOptions(size=48, fit="squash"))[1]) == []


def test_a_cache_of_another_release_is_named_as_such(imagenet_clean, tmp_path):
    """A cache written by a release with another format version (and so another build key) is not
    called "a different cache" of other sources: the message says which release wrote it and that
    --force rebuilds it; nothing is touched without --force."""
    plan = _train_plan(imagenet_clean)
    out = tmp_path / "c"
    build(plan, out, BuildOptions(size=32, jobs=1))
    path = out / "manifest.json"
    as_sha256_cache(out, 2)  # as the previous release wrote it (format 2, sha256): its key names that format
    d = path.read_bytes()
    with pytest.raises(CacheExistsError, match=r"another cachebuild release \(format version 2; this one writes 4\)"
                                               r"; it reads as it is: pass --update"):
        build(plan, out, BuildOptions(size=32, jobs=1))
    assert path.read_bytes() == d
    assert build(plan, out, BuildOptions(size=32, jobs=1, force=True)).status == "built"
    assert read_manifest(out).format_version == 4


def test_a_changed_source_file_changes_the_fingerprint(imagenet_clean, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(imagenet_clean["train_dir"], src)
    build(folder_plan(src), tmp_path / "c", BuildOptions(size=32, jobs=1))
    victim = sorted(src.rglob("*.JPEG"))[0]
    victim.write_bytes(victim.read_bytes())  # same bytes, new mtime: cannot be assumed unchanged
    os.utime(victim, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    with pytest.raises(CacheExistsError):
        build(folder_plan(src), tmp_path / "c", BuildOptions(size=32, jobs=1))


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_source_file_rewritten_after_planning_is_skipped_not_built_under_the_old_fingerprint(
        imagenet_clean, tmp_path, jobs):
    """The fingerprint is taken when the build plans; a file rewritten before its worker reads it used to
    be decoded anyway: new pixels under the old (size, mtime). It is a listed skip now, and `status`
    calls the cache stale, naming the file."""
    from cachebuild.builder.status import cache_status

    src = tmp_path / "src"
    shutil.copytree(imagenet_clean["train_dir"], src)
    plan = folder_plan(src)
    victim = src / plan.keys[3]
    other = src / plan.keys[20]
    victim.write_bytes(other.read_bytes())  # another photo in its place, after planning
    res = build(plan, tmp_path / "c", BuildOptions(size=32, jobs=jobs, block_size=8))
    m = read_manifest(res.path)
    assert [f.path for f in m.failures] == [plan.keys[3]] and m.count == len(plan) - 1
    assert "changed after the build planned it" in m.failures[0].reason
    report = cache_status(res.path, str(src))
    assert report.status == "stale" and report.modified == 1 and report.examples["modified"] == [plan.keys[3]]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachebuild", *args], capture_output=True, text=True, **kw)


# npy behind slow: a killed and resumed npy build is in the default run too (tests/reliability/test_kill_points).
@pytest.mark.parametrize("storage", [pytest.param("npy", marks=pytest.mark.slow), "zarr"])
def test_sigkill_then_resume_is_byte_identical(imagenet_tree, tmp_path, storage):
    src = imagenet_tree["root"]
    common = ["--split", "train", "--size", "64", "--shard-size", "4", "--jobs", "1", "--no-progress",
              "--format", storage, "--chunk-size", "2"]
    ref = _cli("imagenet", str(src), "--out", str(tmp_path / "ref"), *common)
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed"
    n_done = build_killed_after_blocks(["imagenet", str(src), "--out", str(out), *common],
                                       out / "train.partial" / "blocks")
    assert 3 <= n_done < 14, "the kill must land part way"
    assert not (out / "train").exists()
    resumed = _cli("imagenet", str(src), "--out", str(out), *common, "-v")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    for name in ("labels.npy", "sizes.npy", "paths.json"):
        assert (out / "train" / name).read_bytes() == (tmp_path / "ref" / "train" / name).read_bytes()
    ref_dir = tmp_path / "ref" / "train"
    images = sorted(p.relative_to(ref_dir) for p in ref_dir.rglob("*") if p.is_file())
    images = [rel for rel in images if rel.parts[0].startswith("images")]  # npy shards or the zarr store
    assert len(images) > 3
    for rel in images:
        assert (out / "train" / rel).read_bytes() == (ref_dir / rel).read_bytes(), rel
    m_ref, m_res = read_manifest(tmp_path / "ref" / "train"), read_manifest(out / "train")
    assert m_ref.shards == m_res.shards and m_ref.failures == m_res.failures


def test_cli_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    runner = CliRunner()
    cases = [
        (["imagenet", str(tmp_path / "missing")], "does not exist"),
        (["imagenet", str(empty)], "not an ImageNet layout"),
        (["folder", str(empty)], "no class folders"),
        (["folder", str(tmp_path / "flat")], "no class folders"),
        (["imagenet", str(empty), "--size", "0"], "'--size'"),
        (["cifar10", str(empty)], "cifar"),
        (["info", str(empty)], "not a cachebuild cache"),
    ]
    for args, expected in cases:
        r = runner.invoke(main, [*args, "--out", str(tmp_path / "o")] if args[0] != "info" else args)
        assert r.exit_code != 0, args
        assert expected.lower() in r.output.lower(), (args, r.output)
        assert "Traceback" not in r.output
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)
    assert not (tmp_path / "o").exists()


def test_cli_build_info_verify_and_a_flipped_byte(imagenet_clean, tmp_path):
    runner = CliRunner()
    out = tmp_path / "c"
    r = runner.invoke(main, ["imagenet", str(imagenet_clean["root"]), "--size", "32", "--out", str(out), "-j", "1"])
    assert r.exit_code == 0, r.output
    assert "samples" in r.output and "img/s" in r.output
    r = runner.invoke(main, ["info", str(out / "val"), "--json"])
    m = json.loads(r.output)
    assert m["format"] == "cachebuild" and m["count"] == 10 and m["shape"] == [32, 32, 3]
    assert runner.invoke(main, ["verify", str(out / "val")]).exit_code == 0
    shard = out / "val" / m["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    r = runner.invoke(main, ["verify", str(out / "val")])
    assert r.exit_code == 1 and "checksum mismatch" in r.output


def test_default_out_is_documented_home(imagenet_clean, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(main, ["imagenet", str(imagenet_clean["root"]), "--split", "val", "--size", "16", "-j", "1"])
    assert r.exit_code == 0, r.output
    assert read_manifest(tmp_path / "home" / "imagenet-16" / "val").count == 10


def test_backend_is_the_callers_choice(imagenet_clean, tmp_path):
    # No backend is fixed inside: a caller's joblib config (threads here; dask on a cluster) is used.
    from joblib import parallel_config

    plan = _train_plan(imagenet_clean)
    ref = build(plan, tmp_path / "ref", BuildOptions(size=32, jobs=1, block_size=8))
    with parallel_config(backend="threading", n_jobs=2):
        threaded = build(plan, tmp_path / "threads", BuildOptions(size=32, jobs=2, block_size=8))
    assert read_manifest(ref.path).shards == read_manifest(threaded.path).shards


def test_a_second_concurrent_build_of_the_same_output_is_refused(imagenet_clean, tmp_path):
    import fcntl

    from cachebuild.errors import CacheBuildError

    plan = _train_plan(imagenet_clean)
    out = tmp_path / "c"
    with open(tmp_path / "c.lock", "a") as held:  # what a running build holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CacheBuildError, match="another cachebuild process is building"):
            build(plan, out, BuildOptions(size=16, jobs=1))
        assert not out.exists() and not (tmp_path / "c.partial").exists()
    assert build(plan, out, BuildOptions(size=16, jobs=1)).status == "built"  # released: goes ahead


def _zarr_build_killed_then_resumed(info, tmp_path, monkeypatch, module, name, dying) -> Path:
    """Build a zarr cache of a plan with failures mid-plan while ``module.name`` is ``dying`` (which raises
    KeyboardInterrupt, a stand-in for a kill); resume it normally; it must equal the npy build, intact."""
    plan = _failures_in_the_middle(info, tmp_path / "src")
    opts = BuildOptions(size=32, jobs=1, block_size=4, storage="zarr", chunk_size=2)
    monkeypatch.setattr(module, name, dying)
    with pytest.raises(KeyboardInterrupt):
        build(plan, tmp_path / "z", opts)
    monkeypatch.undo()
    resumed = build(plan, tmp_path / "z", opts)
    npy = build(plan, tmp_path / "npy", BuildOptions(size=32, jobs=1, block_size=4))
    assert np.array_equal(_pixels(resumed.path), _pixels(npy.path))
    assert open_cache(resumed.path).verify() == []
    return resumed.path


def test_zarr_build_killed_while_moving_blocks_resumes_correctly(imagenet_tree, tmp_path, monkeypatch):
    """Moving blocks down in place is not repeatable (a move overwrites samples a later one reads): a
    build stopped part way through must decode the moved blocks again, not commit clobbered pixels."""
    import cachebuild.storage.kinds.zarr as zarr_staging

    real = zarr_staging.compact_zarr

    def stopped_after_two_moves(staging, moves, count):
        assert len(moves) > 2
        real(staging, moves[:2], count)  # clobbers sources of later moves, then "dies"
        raise KeyboardInterrupt

    _zarr_build_killed_then_resumed(imagenet_tree, tmp_path, monkeypatch, zarr_staging, "compact_zarr",
                                    stopped_after_two_moves)


def test_small_plans_make_enough_blocks_to_keep_every_worker_busy():
    """The block size follows the plan length (never --jobs): ~64 MB shards for ImageNet, but at least
    64 blocks for a small build, whose last block would otherwise run alone for a large share of it."""
    assert BuildOptions(size=224).resolved_block(1_281_167) == 384
    assert BuildOptions(size=224).resolved_block(8000) == 128
    assert BuildOptions(size=96).resolved_block(410) == 64
    assert BuildOptions(size=224, block_size=1000).resolved_block(8000) == 1000
    zarr = BuildOptions(size=224, storage="zarr")
    assert zarr.resolved_block(8000) % zarr.resolved_chunk() == 0


def test_cli_builds_on_a_dask_cluster(imagenet_tree, tmp_path):
    """`--dask-scheduler` runs the blocks on the cluster's workers (joblib's dask backend) and gives the
    same cache as a local build; an unreachable scheduler is a one-line error."""
    from dask.distributed import Client, LocalCluster

    src = imagenet_tree["root"]
    common = ["--split", "train", "--size", "32", "--shard-size", "8", "--no-progress"]
    local = _cli("imagenet", str(src), "--out", str(tmp_path / "local"), "-j", "1", *common)
    assert local.returncode == 0, local.stderr
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        r = _cli("imagenet", str(src), "--out", str(tmp_path / "dask"), "--dask-scheduler", cluster.scheduler_address,
                 *common, "-v")
        assert r.returncode == 0, r.stderr
        assert "building on the Dask cluster" in r.stderr
        computed = client.run_on_scheduler(lambda dask_scheduler: {  # seconds of compute per task prefix
            k: tp.all_durations.get("compute", 0.0) for k, tp in dask_scheduler.task_prefixes.items()})
        assert any("run_block" in k and t > 0 for k, t in computed.items()), computed
    ref, got = read_manifest(tmp_path / "local" / "train"), read_manifest(tmp_path / "dask" / "train")
    assert ref.shards == got.shards and ref.failures == got.failures
    assert np.array_equal(_pixels(tmp_path / "local" / "train"), _pixels(tmp_path / "dask" / "train"))
    bad = _cli("imagenet", str(src), "--out", str(tmp_path / "x"), "--dask-scheduler", "tcp://127.0.0.1:9", *common,
               env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
    assert bad.returncode != 0 and "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_zarr_build_killed_after_moving_blocks_does_not_move_them_twice(imagenet_tree, tmp_path, monkeypatch):
    """Killed after the blocks moved but before the commit: the resumed build must not move them again
    (their sources are gone), only commit."""
    import cachebuild.builder.pipeline as finish

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    path = _zarr_build_killed_then_resumed(imagenet_tree, tmp_path, monkeypatch, finish, "save_side_arrays", killed)
    assert not (path / "compacting.json").exists()
