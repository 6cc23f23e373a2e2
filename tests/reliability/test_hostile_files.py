"""Hostile and unlucky inputs: what a user can point the builder at, and what it must never do to them.

Rows: ``--force`` on what is not a cache; outputs overlapping the source; damaged manifests; a staging
folder that is not ours; 1-pixel images and any other per-file failure in a worker; symlink loops and
links leaving the root; FIFOs, devices, unreadable and oversized files.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.errors import CacheExistsError, OptionError, OutputError
from cachebuild.sources.folder import folder_plan
from cachebuild.sources.plan import FileReader
from cachebuild.storage.cache import open_cache, read_manifest
from tests.manifest_edits import load_unsealed
from tests.reliability.helpers import cli, cli_env, file_hashes, without_dac_override

FORCE = "--force on a folder that is not a cache"
OVERLAP = "output equal to / inside / containing the source"


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, [*args, "--jobs", "1", "--no-progress", "-q"])
    return res.exit_code, res.output


def _one_line_error(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output
    return errors[0]


def _src_copy(photo_tree: Path, dst: Path) -> Path:
    shutil.copytree(photo_tree, dst)
    return dst


def test_force_never_replaces_what_is_not_a_cache(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = _src_copy(photo_tree, tmp_path / "src")
    good = tmp_path / "good"
    assert _run("folder", str(src), "--size", "16", "--out", str(good))[0] == 0

    # A folder of someone's files at the destination.
    other = tmp_path / "other" / "train"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    shutil.copy(next(src.rglob("*.JPEG")), other / "photo.JPEG")
    # A cache someone added a file to.
    added = tmp_path / "added"
    shutil.copytree(good, added)
    (added / "train" / "my_results.csv").write_text("epoch,acc\n")
    # A cache whose manifest is damaged beyond parsing: we cannot tell we wrote it.
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    (damaged / "train" / "manifest.json").write_text('{"format": "cachebuild", "shards": [')
    # A manifest that is JSON but of another tool.
    foreign = tmp_path / "foreign" / "train"
    foreign.mkdir(parents=True)
    (foreign / "manifest.json").write_text('{"format": "webdataset", "shards": []}')
    (foreign / "data.tar").write_bytes(b"x" * 100)
    # A regular file where the cache folder would be.
    filed = tmp_path / "filed"
    filed.mkdir()
    (filed / "train").write_text("a file")

    cases = {"a folder of other files": other.parent, "a cache with a file added": added,
             "a cache with a damaged manifest": damaged, "another tool's manifest": foreign.parent,
             "a regular file": filed}
    for name, out in cases.items():
        with ledger.trial(FORCE, name):
            before = file_hashes(out)
            code, output = _run("folder", str(src), "--size", "24", "--out", str(out), "--force")
            assert code == 1, (name, output)
            line = _one_line_error(output)
            assert str(out / "train") in line, line
            assert file_hashes(out) == before, f"{name}: files changed"
            assert not (out / "train.partial").exists()

    with ledger.trial(FORCE, "the damaged-manifest message says what is wrong"):
        line = _one_line_error(_run("folder", str(src), "--size", "24", "--out", str(damaged), "--force")[1])
        assert "damaged" in line and "not valid JSON" in line and "rm -r" in line, line

    with ledger.trial(FORCE, "a cache of ours is still replaced"):
        assert _run("folder", str(src), "--size", "24", "--out", str(good), "--force")[0] == 0
        assert read_manifest(good / "train").shape == (24, 24, 3)
        assert not list(good.glob("train.replaced-*"))  # no reader held the old one: deleted


def test_output_overlapping_the_source_is_refused(photo_tree: Path, tmp_path: Path, ledger) -> None:
    root = tmp_path / "data"
    src = _src_copy(photo_tree, root / "photos" / "train")
    before = file_hashes(root)
    cases = {
        # imagenet: `cp -r SRC copy; cachebuild imagenet copy --split train --out copy --force`
        "imagenet SRC --out SRC --force (the split folder is the output)":
            ("imagenet", str(root / "photos"), "--split", "train", "--size", "16", "--out", str(root / "photos"),
             "--force"),
        "folder SRC --out SRC": ("folder", str(src), "--size", "16", "--out", str(src)),
        "folder SRC --out SRC/sub": ("folder", str(src), "--size", "16", "--out", str(src / "caches")),
        "folder SRC --out a folder containing SRC": ("folder", str(src), "--size", "16", "--split", "photos",
                                                     "--out", str(root), "--force"),
    }
    for name, args in cases.items():
        with ledger.trial(OVERLAP, name):
            code, output = _run(*args)
            assert code == 1, (name, output)
            line = _one_line_error(output)
            assert "source" in line and ".cachebuild" in line, line
            assert file_hashes(root) == before, f"{name}: wrote into the source tree"

    with ledger.trial(OVERLAP, "SRC/.cachebuild is allowed and never becomes a class"):
        out = src / ".cachebuild"
        assert _run("folder", str(src), "--size", "16", "--out", str(out))[0] == 0
        assert read_manifest(out / "train").classes == tuple(sorted(p.name for p in photo_tree.iterdir()))
        code, output = _run("folder", str(src), "--size", "16", "--out", str(out))
        assert code == 0 and "up to date" in output, output


def test_a_damaged_manifest_is_named_not_called_different(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = _src_copy(photo_tree, tmp_path / "src")
    out = tmp_path / "c"
    assert _run("folder", str(src), "--size", "16", "--out", str(out))[0] == 0
    m = load_unsealed(out / "train" / "manifest.json")
    m["count"] = m["count"] + 5
    (out / "train" / "manifest.json").write_text(json.dumps(m))
    with ledger.trial("damaged manifest at --out: the problem is named"):
        line = _one_line_error(_run("folder", str(src), "--size", "16", "--out", str(out))[1])
        assert "different cache" not in line and "cannot be used" in line and "count" in line, line
    with ledger.trial("damaged manifest at --out: the problem is named", "--force rebuilds a cache of ours"):
        assert _run("folder", str(src), "--size", "16", "--out", str(out), "--force")[0] == 0
        assert open_cache(out / "train").verify() == []


def test_a_staging_folder_not_made_by_us_is_left_alone(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = _src_copy(photo_tree, tmp_path / "src")
    staging = tmp_path / "c" / "train.partial"
    staging.mkdir(parents=True)
    (staging / "holiday.jpg").write_bytes(b"\xff\xd8 not ours")
    with ledger.trial("<out>.partial that cachebuild did not make"):
        line = _one_line_error(_run("folder", str(src), "--size", "16", "--out", str(tmp_path / "c"))[1])
        assert "not made by cachebuild" in line, line
        assert (staging / "holiday.jpg").read_bytes() == b"\xff\xd8 not ours"


def _png(path: Path, h: int, w: int, seed: int) -> None:
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ok, data = cv2.imencode(path.suffix, img)
    assert ok
    path.write_bytes(data.tobytes())


def test_one_pixel_images_become_samples(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = _src_copy(photo_tree, tmp_path / "src")
    cls = next(p for p in sorted(src.iterdir()) if p.is_dir())
    thin = {"1x500.png": (1, 500), "500x1.png": (500, 1), "1x1.png": (1, 1), "1x333.jpg": (1, 333),
            "2x900.jpg": (2, 900)}
    for i, (name, (h, w)) in enumerate(thin.items()):
        _png(cls / name, h, w, i)
    plan = folder_plan(src)
    for fit in ("crop", "pad", "squash"):
        with ledger.trial("1-pixel-high/-wide images (--jobs 2)", fit):
            res = build(plan, tmp_path / fit, BuildOptions(size=32, fit=fit, jobs=2, block_size=4))
            assert res.count == len(plan) and res.failures == 0
            cache = open_cache(tmp_path / fit)
            got = dict(zip(cache.paths(), cache.sizes.tolist(), strict=True))
            for name, hw in thin.items():
                assert got[f"{cls.name}/{name}"] == list(hw)


class FlakyReader(FileReader):
    """A reader (e.g. a user's own SampleReader) that fails in its own way on one file."""

    def __call__(self, index: int, key: str) -> bytes:
        if key.endswith("_4504.JPEG"):
            raise RuntimeError("reader bug: index out of sync")
        return super().__call__(index, key)


def test_any_per_file_failure_in_a_worker_is_a_recorded_skip(photo_tree: Path, tmp_path: Path, ledger) -> None:
    import dataclasses

    plan = folder_plan(photo_tree)
    plan = dataclasses.replace(plan, reader=FlakyReader(plan.root))
    bad = next(k for k in plan.keys if k.endswith("_4504.JPEG"))
    with ledger.trial("any per-file failure in a worker is a recorded skip"):
        res = build(plan, tmp_path / "c", BuildOptions(size=16, jobs=2, block_size=4))
        m = read_manifest(tmp_path / "c")
        assert res.count == len(plan) - 1
        assert [(f.path, f.reason) for f in m.failures] == [(bad, "RuntimeError: reader bug: index out of sync")]
        again = build(plan, tmp_path / "c", BuildOptions(size=16, jobs=2, block_size=4))
        assert again.status == "up to date"


def test_symlink_loops_are_listed_once(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = tmp_path / "src"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        for f in sorted((photo_tree / sorted(os.listdir(photo_tree))[cls == "b"]).iterdir())[:3]:
            shutil.copy(f, src / cls / f.name)
    os.symlink(".", src / "a" / "loop")  # a folder that contains itself
    os.symlink("../b", src / "b" / "again")  # a loop through the parent
    os.symlink("..", src / "b" / "up")  # the root, holding both classes
    with ledger.trial("symlink loops (ImageFolder: 6 files -> 2,706 samples)"):
        # Listed in a child with bounded memory and time: an unbounded walk of these three links grows
        # exponentially (it took 22 GB before the fix).
        keys = _plan_keys_bounded(src)
        # 6 real files; b/up/a lists a's 3 files once more under class b (as ImageFolder would);
        # every loop back into a folder already listed adds nothing.
        assert len(keys) == 9, keys
        assert sorted(k for k in keys if k.startswith("b/up/")) == \
            sorted(f"b/up/a/{f}" for f in os.listdir(src / "a") if f.endswith(".JPEG"))
        assert build(folder_plan(src), tmp_path / "c", BuildOptions(size=16, jobs=1)).count == 9


def _plan_keys_bounded(src: Path) -> list[str]:
    code = "import json, sys; from cachebuild.sources.folder import folder_plan; " \
           "print(json.dumps(list(folder_plan(sys.argv[1]).keys)))"
    limit = 2 << 30
    r = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=60,
                       env=cli_env(), preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)))
    assert r.returncode == 0, r.stderr[-500:]
    return json.loads(r.stdout)


def test_links_leaving_the_root_are_followed(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = _src_copy(photo_tree, tmp_path / "src")
    outside = tmp_path / "elsewhere" / "extra"
    outside.mkdir(parents=True)
    photos = sorted(photo_tree.rglob("*.JPEG"))
    shutil.copy(photos[0], outside / "x1.JPEG")
    shutil.copy(photos[1], outside / "x2.JPEG")
    cls = sorted(p for p in src.iterdir() if p.is_dir())[0]
    os.symlink(outside, cls / "linked_folder")
    os.symlink(photos[2], cls / "linked_file.JPEG")
    with ledger.trial("symlinks leaving the root (followed, like ImageFolder)"):
        plan = folder_plan(src)
        assert len(plan) == 16 + 3
        res = build(plan, tmp_path / "c", BuildOptions(size=16, jobs=1))
        assert res.count == 19 and res.failures == 0


def test_special_unreadable_and_oversized_files_are_skipped_unread(photo_tree: Path, tmp_path: Path,
                                                                    ledger) -> None:
    src = _src_copy(photo_tree, tmp_path / "src")
    cls = sorted(p for p in src.iterdir() if p.is_dir())[0]
    os.mkfifo(cls / "fifo.JPEG")  # opening it for reading would wait for a writer forever
    os.symlink("/dev/zero", cls / "zero.JPEG")  # reading it would fill memory
    os.symlink("/dev/urandom", cls / "random.JPEG")
    with open(cls / "huge.JPEG", "wb") as f:  # sparse: no disk used, 1 GiB + 1 byte long
        f.truncate((1 << 30) + 1)
    locked = cls / "locked.JPEG"
    shutil.copy(sorted(photo_tree.rglob("*.JPEG"))[0], locked)
    locked.chmod(0)
    out = tmp_path / "c"
    with ledger.trial("FIFO, /dev/zero, /dev/urandom, 1 GiB, permission-denied files"):
        r = cli("folder", str(src), "--size", "16", "--out", str(out), "--jobs", "2", "--no-progress",
                prefix=without_dac_override(), timeout=120, memory=4 << 30)
        assert r.returncode == 0, r.stderr
        reasons = {Path(f.path).name: f.reason for f in read_manifest(out / "train").failures}
        assert reasons == {
            "fifo.JPEG": "not a regular file (a named pipe); not read",
            "zero.JPEG": "not a regular file (a character device); not read",
            "random.JPEG": "not a regular file (a character device); not read",
            "huge.JPEG": "1,073,741,825 bytes, over the 1,073,741,824-byte limit for one image file; not read",
            "locked.JPEG": "unreadable: Permission denied",
        }, reasons
        assert read_manifest(out / "train").count == 16


@pytest.mark.parametrize("bad", [{"fit": "letterbox"}, {"interpolation": "bicubic"}, {"storage": "npz"}])
def test_bad_options_stop_before_any_work(photo_tree: Path, tmp_path: Path, ledger, bad: dict) -> None:
    with ledger.trial("bad build options refused before decoding", str(bad)):
        with pytest.raises(OptionError, match=next(iter(bad))):
            build(folder_plan(photo_tree), tmp_path / "c", BuildOptions(size=16, **bad))
        assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()


def test_library_refuses_like_the_cli(photo_tree: Path, tmp_path: Path) -> None:
    """The checks live in build(), not only in the command line."""
    src = _src_copy(photo_tree, tmp_path / "src")  # the old code replaced it with a cache
    before = file_hashes(src)
    with pytest.raises(OutputError, match="is the source"):
        build(folder_plan(src), src, BuildOptions(size=16, jobs=1, force=True))
    assert file_hashes(src) == before
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(CacheExistsError, match="not a cachebuild cache"):
        build(folder_plan(photo_tree), tmp_path / "c", BuildOptions(size=16, jobs=1, force=True))
    assert (tmp_path / "c" / "keep.txt").read_text() == "x"


def test_a_kept_copy_named_like_a_replaced_cache_is_kept(photo_tree: Path, tmp_path: Path, ledger) -> None:
    """`mv train train.old-2024` (or `train.replaced-2024`, close to the name a --force rebuild gives the cache
    it replaces), then rebuilds: the copies are caches of ours, but not named by a rebuild: never deleted."""
    src = _src_copy(photo_tree, tmp_path / "src")
    out = tmp_path / "c"
    assert _run("folder", str(src), "--size", "16", "--out", str(out))[0] == 0
    (out / "train").rename(out / "train.old-2024")
    shutil.copytree(out / "train.old-2024", out / "train.replaced-2024")
    kept = ("train.old-2024", "train.replaced-2024")
    before = {name: file_hashes(out / name) for name in kept}
    with ledger.trial("a kept copy named like a replaced cache is never deleted"):
        for size in ("16", "20"):  # a build, then a --force rebuild that sweeps replaced versions
            res = CliRunner().invoke(main, ["folder", str(src), "--size", size, "--out", str(out), "--jobs", "1",
                                            "--no-progress", "--force"])
            assert res.exit_code == 0, res.output
        assert {name: file_hashes(out / name) for name in kept} == before
