"""``--update``: a changed source decodes only what changed, and the result is a fresh build's, byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from kill_helpers import build_killed_after_blocks

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.builder.status import cache_status
from cachebuild.errors import CacheBuildError, CacheExistsError
from cachebuild.sources.folder import folder_plan
from cachebuild.storage.cache import open_cache, read_manifest
from cachebuild.storage.columns import add_column
from tests.legacy_caches import as_sha256_cache

HOUR_NS = 3600 * 10**9
# what a fresh build and an update may differ in: when they ran, and who ran them
_TIMES = ("created", "built_by")


def _copy_tree(src: Path, dst: Path, age_ns: int = HOUR_NS) -> Path:
    """A copy of a source tree whose files are ``age_ns`` old (older than any racy window)."""
    shutil.copytree(src, dst, symlinks=True)  # the tree's broken files include a dangling link
    for f in dst.rglob("*"):
        if f.is_file() and not f.is_symlink():
            t = f.stat().st_mtime_ns - age_ns
            os.utime(f, ns=(t, t))
    return dst


def _change(root: Path) -> dict[str, int]:
    """Two files added, two removed, one rewritten, one moved to another class; what a fresh build decodes."""
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    files = [sorted(f for f in c.iterdir() if f.is_file()) for c in classes]
    shutil.copyfile(files[0][0], classes[1] / "added_a.JPEG")
    shutil.copyfile(files[2][1], classes[0] / "added_b.JPEG")
    files[1][2].unlink()
    files[3][0].unlink()
    files[2][3].write_bytes(files[0][1].read_bytes())  # rewritten: another photo, a new mtime
    files[0][4].rename(classes[2] / files[0][4].name)  # moved: another path and label, same bytes and mtime
    return {"added": 2, "removed": 2}


def _assert_same_cache(a: Path, b: Path) -> None:
    """Pixels, labels, paths, side arrays, file table and every manifest field but the times: equal."""
    ra, rb = open_cache(a), open_cache(b)
    assert len(ra) == len(rb) > 0
    idx = np.arange(len(ra))
    assert ra.gather(idx).tobytes() == rb.gather(idx).tobytes()
    for name in ("labels.npy", "sizes.npy", "paths.json", "files.json", "source_files.json"):
        if (a / name).exists() or (b / name).exists():
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    for m in (ma, mb):
        for k in (*_TIMES, "checksum"):
            m.pop(k, None)
        m["source"].get("inputs", {}).pop("listed_ns", None)
    assert ma == mb
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


@pytest.mark.parametrize("storage", ["npy", "zarr", "jpeg"])
def test_an_update_equals_a_fresh_build_of_the_changed_tree(imagenet_tree, tmp_path, storage):
    src = _copy_tree(imagenet_tree["root"] / "train", tmp_path / "src")
    opts = dict(size=32, jobs=1, storage=storage, block_size=8, progress=False)
    out = tmp_path / "cache"
    first = build(folder_plan(src), out, BuildOptions(**opts))
    assert first.decoded == first.count + first.failures and first.reused == 0
    held = open_cache(out)  # a reader of the old cache, open across the update
    old_first = held.gather(np.arange(3))
    _change(src)
    plan = folder_plan(src)
    got = build(plan, out, BuildOptions(**opts, update=True))
    fresh = build(plan, tmp_path / "fresh", BuildOptions(**opts))
    _assert_same_cache(out, tmp_path / "fresh")
    assert got.count == fresh.count and got.failures == fresh.failures
    # decoded: the added, rewritten and moved files, and those that failed before (never trusted as failed)
    assert got.decoded == 2 + 1 + 1 + first.failures, (got.decoded, got.reused)
    assert got.reused == len(plan) - got.decoded
    assert cache_status(out, src).status == "up to date"
    assert held.gather(np.arange(3)).tobytes() == old_first.tobytes()  # the old cache, whole, for its reader
    # same stats again, but the 3 files written just now are racy (maybe rewritten unseen): their bytes are
    # compared with the digests the update recorded, the same: none is decoded (but those that fail)
    again = build(plan, out, BuildOptions(**opts, update=True))
    assert (again.decoded, again.reused) == (fresh.failures, len(plan) - fresh.failures)
    _assert_same_cache(out, tmp_path / "fresh")


@pytest.mark.parametrize("storage", ["npy", "zarr", "jpeg"])
def test_an_update_of_a_sha256_cache_is_a_fresh_build_of_this_format(imagenet_clean, tmp_path, storage):
    """A cache of the previous release (format 2, sha256; 3 with a column) updates into format 4: every sample
    reused, none decoded, verified against its sha256 first and hashed anew, so the result is a fresh build's,
    column carried; a damaged shard of it is refused, not carried."""
    src = _copy_tree(imagenet_clean["root"] / "train", tmp_path / "src")
    opts = dict(size=32, jobs=1, storage=storage, block_size=8, progress=False)
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(**opts))
    as_sha256_cache(out, 2)
    np.save(tmp_path / "a.npy", np.arange(read_manifest(out).count))
    add_column(out, "a", tmp_path / "a.npy")
    assert read_manifest(out).format_version == 3
    shard = out / read_manifest(out).shards[1].file if storage != "zarr" else out / "images.zarr/c/0/0/0/0"
    good = shard.read_bytes()
    at = 1000 if storage == "zarr" else len(good) - 300  # a byte of a sample (a zarr chunk's tail is unused rows)
    shard.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])
    with pytest.raises(CacheBuildError, match="fails its checksums"):
        build(folder_plan(src), out, BuildOptions(**opts, update=True))
    shard.write_bytes(good)
    got = build(folder_plan(src), out, BuildOptions(**opts, update=True))
    assert got.reused == got.count > 0 and got.decoded == 0
    fresh = tmp_path / "fresh"
    build(folder_plan(src), fresh, BuildOptions(**opts))
    add_column(fresh, "a", tmp_path / "a.npy")
    _assert_same_cache(out, fresh)
    m = read_manifest(out)
    assert m.format_version == 4 and m.digest_algorithm == "xxh3-128" and open_cache(out).verify() == []


def test_an_update_refuses_another_recipe_naming_what_differs(imagenet_tree, tmp_path):
    src = _copy_tree(imagenet_tree["root"] / "val", tmp_path / "src")
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(size=32, jobs=1, progress=False))
    (src / sorted(os.listdir(src))[0] / "new.JPEG").write_bytes(next((src).rglob("*.JPEG")).read_bytes())
    before = sorted(out.iterdir())
    with pytest.raises(CacheExistsError, match=r"another recipe \(fit crop -> squash; size 32 -> 40\)"):
        build(folder_plan(src), out, BuildOptions(size=40, fit="squash", jobs=1, progress=False, update=True))
    with pytest.raises(CacheExistsError, match="storage npy -> zarr"):
        build(folder_plan(src), out, BuildOptions(size=32, storage="zarr", jobs=1, progress=False, update=True))
    assert sorted(out.iterdir()) == before and not (tmp_path / "cache.partial").exists()
    with pytest.raises(ValueError, match="update and force exclude each other"):
        BuildOptions(size=32, update=True, force=True)


def _bmp_tree(root: Path, age_ns: int) -> Path:
    """Class folders of BMPs (a BMP's size follows from its shape alone: a rewrite can keep it)."""
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            cv2.imwrite(str(root / c / f"{i}.bmp"), rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    for f in root.rglob("*.bmp"):
        t = f.stat().st_mtime_ns - age_ns
        os.utime(f, ns=(t, t))
    return root


def _rewrite_keeping_stat(path: Path) -> None:
    st = path.stat()
    cv2.imwrite(str(path), np.full((40, 50, 3), 7, np.uint8))
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_rewrite_in_the_listing_tick_is_decoded_again_an_old_one_is_trusted(tmp_path):
    """Racy entries: a file whose mtime is within RACY_NS of the old listing may have been rewritten unseen
    (same size, same mtime), so its bytes are compared with the digest the build recorded: the rewritten one is
    decoded again, the others reused; older ones are trusted by size and mtime (as rsync is)."""
    opts = BuildOptions(size=16, jobs=1, progress=False)
    racy = _bmp_tree(tmp_path / "racy", age_ns=0)  # written just now: the build lists it in the same second
    build(folder_plan(racy), tmp_path / "c1", opts)
    _rewrite_keeping_stat(racy / "a" / "0.bmp")
    got = build(folder_plan(racy), tmp_path / "c1", BuildOptions(size=16, jobs=1, progress=False, update=True))
    assert got.decoded == 1 and got.reused == 11  # all within the window: all compared, the rewritten one differs
    assert open_cache(tmp_path / "c1").gather(np.array([0])).max() == 7  # its new pixels
    build(folder_plan(racy), tmp_path / "f1", opts)
    _assert_same_cache(tmp_path / "c1", tmp_path / "f1")

    old = _bmp_tree(tmp_path / "old", age_ns=HOUR_NS)
    build(folder_plan(old), tmp_path / "c2", opts)
    _rewrite_keeping_stat(old / "a" / "0.bmp")
    (old / "b" / "5.bmp").unlink()
    got = build(folder_plan(old), tmp_path / "c2", BuildOptions(size=16, jobs=1, progress=False, update=True))
    assert got.decoded == 0 and got.reused == 11
    assert open_cache(tmp_path / "c2").gather(np.array([0])).max() > 7  # the old pixels: trusted, as documented


def test_an_update_of_a_damaged_cache_carries_nothing_over(imagenet_tree, tmp_path):
    src = _copy_tree(imagenet_tree["root"] / "val", tmp_path / "src")
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(size=32, jobs=1, progress=False))
    shard = sorted(out.glob("images-*.npy"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    next(src.rglob("*.JPEG")).unlink()
    with pytest.raises(CacheBuildError, match=r"fails its checksums.*nothing damaged is carried over"):
        build(folder_plan(src), out, BuildOptions(size=32, jobs=1, progress=False, update=True))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachebuild", *args], capture_output=True, text=True)


def test_a_killed_update_resumes_and_its_json_counts(imagenet_tree, tmp_path):
    """SIGKILL part way through an update, rerun: it resumes from its blocks and ends as a fresh build."""
    src = _copy_tree(imagenet_tree["root"], tmp_path / "src")
    common = ["--split", "train", "--size", "48", "--shard-size", "2", "--jobs", "1", "--no-progress"]
    out = tmp_path / "out"
    assert _cli("imagenet", str(src), "--out", str(out), *common).returncode == 0
    _change(src / "train")
    for f in sorted((src / "train").rglob("*"))[::3]:  # a third of the files touched: decoded again
        if f.is_file():
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**9))
    blocks = out / "train.partial" / "blocks"
    n_done = build_killed_after_blocks(["imagenet", str(src), "--out", str(out), *common, "--update"], blocks)
    assert n_done >= 1 and (out / "train.partial").is_dir(), "the kill must land part way"
    summary = tmp_path / "summary.json"
    resumed = _cli("imagenet", str(src), "--out", str(out), *common, "--update", "-v", "--json", str(summary))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    fresh = _cli("imagenet", str(src), "--out", str(tmp_path / "fresh"), *common)
    assert fresh.returncode == 0, fresh.stderr
    _assert_same_cache(out / "train", tmp_path / "fresh" / "train")
    doc = json.loads(summary.read_text())
    m = read_manifest(out / "train")
    assert all(isinstance(doc[k], int) for k in ("decoded", "reused", "skipped"))
    assert doc["decoded"] + doc["reused"] == m.source["files"] and doc["skipped"] == len(m.failures)
    assert doc["reused"] > 0 and doc["decoded"] > 0 and doc["seconds"] >= doc["plan_seconds"] > 0


@pytest.mark.parametrize("storage", ["npy", "zarr", "jpeg"])
def test_touched_files_leave_the_other_shards_taken_whole(imagenet_tree, tmp_path, storage):
    """Files touched, none added or removed: the blocks stay where they were, and a kind with one file per block
    takes every untouched block's shard whole (a hard link: nothing read or hashed); the result is a fresh build's."""
    src = _copy_tree(imagenet_tree["root"] / "train", tmp_path / "src")
    opts = dict(size=32, jobs=1, storage=storage, block_size=4, progress=False)
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(**opts))
    inodes = {p.name: p.stat().st_ino for p in out.glob("images-*")}
    files = sorted(f for f in src.rglob("*.JPEG") if f.is_file() and not f.is_symlink())
    touched, rewritten = files[5], files[20]
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))  # the same bytes
    rewritten.write_bytes(files[0].read_bytes())  # other bytes: decoded again
    plan = folder_plan(src)
    got = build(plan, out, BuildOptions(**opts, update=True))
    build(plan, tmp_path / "fresh", BuildOptions(**opts))
    _assert_same_cache(out, tmp_path / "fresh")
    failed = len(read_manifest(out).failures)
    assert (got.decoded, got.reused) == (1 + failed, len(plan) - 1 - failed)
    if storage != "zarr":  # one file per block: the untouched blocks' shards are the old files
        same = [name for name, ino in inodes.items() if (out / name).stat().st_ino == ino]
        assert len(same) >= len(inodes) - 3, (same, inodes)


def _path_scores(cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """Two columns that say which sample a row belongs to: a crc of its path, and (n, 3) float soft labels."""
    import zlib

    paths = open_cache(cache).paths()
    crc = np.array([zlib.crc32(p.encode()) for p in paths], dtype=np.int64)
    return crc, np.stack([crc % 7, crc % 11, crc % 13], axis=1).astype(np.float32)


def test_an_update_carries_columns_over_by_path(imagenet_tree, tmp_path):
    """A column's rows follow their samples' paths into the updated cache: a file rewritten keeps its row, a
    removed one's row goes, the rows are in the new sample order, and the cache verifies; the columns commit
    with the cache (no moment without them)."""
    from cachebuild.storage.columns import add_column

    src = _copy_tree(imagenet_tree["root"] / "val", tmp_path / "src")
    opts = dict(size=16, jobs=1, progress=False)
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(**opts))
    crc, soft = _path_scores(out)
    np.save(tmp_path / "crc.npy", crc)
    np.save(tmp_path / "soft.npy", soft)
    add_column(out, "crc", tmp_path / "crc.npy")
    add_column(out, "soft", tmp_path / "soft.npy")
    files = sorted(f for f in src.rglob("*.JPEG") if f.is_file() and not f.is_symlink())
    files[0].write_bytes(files[2].read_bytes())  # rewritten: decoded again, its row kept
    t = files[0].stat().st_mtime_ns - HOUR_NS  # not racy: the update after is up to date
    os.utime(files[0], ns=(t, t))
    files[1].unlink()
    got = build(folder_plan(src), out, BuildOptions(**opts, update=True))
    assert got.decoded >= 1 and got.reused > 0
    reader = open_cache(out)
    assert sorted(reader.manifest.columns) == ["crc", "soft"] and reader.manifest.format_version == 4
    want_crc, want_soft = _path_scores(out)  # what each new sample's row must be, from its path
    assert len(want_crc) == reader.manifest.count == len(crc) - 1
    np.testing.assert_array_equal(reader.column("crc"), want_crc)
    np.testing.assert_array_equal(reader.column("soft"), want_soft)
    assert reader.verify() == []
    assert not any(n.startswith("columns/") for n, _, _ in json.loads((out / "files.json").read_text())["files"])
    assert build(folder_plan(src), out, BuildOptions(**opts, update=True)).status == "up to date"


def test_an_update_with_a_file_a_column_has_no_row_for_is_refused(imagenet_tree, tmp_path):
    """A file added since has no row in the columns: refused by name before anything is written (the cache is
    left as it was); a damaged column file is refused, not carried."""
    from cachebuild.storage.columns import add_column

    src = _copy_tree(imagenet_tree["root"] / "val", tmp_path / "src")
    opts = dict(size=16, jobs=1, progress=False)
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(**opts))
    np.save(tmp_path / "score.npy", np.arange(read_manifest(out).count))
    add_column(out, "score", tmp_path / "score.npy")
    before = (out / "manifest.json").read_bytes()
    added = next(src.rglob("*.JPEG"))
    shutil.copy(added, added.with_name("zz_added.JPEG"))
    with pytest.raises(CacheExistsError, match=r"has columns \(score\).*1 planned file.*zz_added.JPEG.*columns rm"):
        build(folder_plan(src), out, BuildOptions(**opts, update=True))
    assert (out / "manifest.json").read_bytes() == before
    added.with_name("zz_added.JPEG").unlink()
    os.utime(added, ns=(added.stat().st_atime_ns, added.stat().st_mtime_ns + 10**9))
    column = out / read_manifest(out).columns["score"].file
    column.chmod(0o644)
    data = bytearray(column.read_bytes())
    data[-1] ^= 1
    column.write_bytes(bytes(data))
    with pytest.raises(CacheBuildError, match=r"column file .*score.* does not match the checksum"):
        build(folder_plan(src), out, BuildOptions(**opts, update=True))
    assert (out / "manifest.json").read_bytes() == before


def _copied_as_cp_r(src: Path, dst: Path) -> Path:
    """``cp -r src dst``: the same bytes, every file's mtime new."""
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copyfile)
    return dst


def test_a_copied_tree_updates_without_decoding_a_file(imagenet_tree, tmp_path):
    """A source copied with cp -r (same bytes, new mtimes): --update reads and digests each file, finds its bytes
    the ones the cache was built from, and decodes none of them (the files that failed are tried again); status
    calls them touched, not modified. The result is a fresh build of the copy, its digests included."""
    from cachebuild.format.manifest import SOURCE_DIGEST

    src = _copy_tree(imagenet_tree["root"] / "train", tmp_path / "src")
    opts = dict(size=32, jobs=2, block_size=8, progress=False)
    out = tmp_path / "cache"
    first = build(folder_plan(src), out, BuildOptions(**opts))
    table = json.loads((out / "source_files.json").read_text())
    assert table["digest"] == SOURCE_DIGEST.name == "xxh3-64"
    for key, digest in zip(table["keys"], table["digests"], strict=True):
        path = src / key
        readable = path.is_file()  # the dangling link is never read
        assert digest == (SOURCE_DIGEST.of(path.read_bytes()) if readable else None), key
    copy = _copied_as_cp_r(src, tmp_path / "copy")
    plan = folder_plan(copy)
    st = cache_status(out, copy)
    regular = sum(1 for k in plan.keys if (copy / k).is_file())
    assert (st.status, st.added, st.removed, st.modified, st.touched) == ("stale", 0, 0, 0, regular), st
    got = build(plan, out, BuildOptions(**opts, update=True))
    assert (got.decoded, got.reused) == (first.failures, first.count), got
    build(plan, tmp_path / "fresh", BuildOptions(**opts))
    _assert_same_cache(out, tmp_path / "fresh")
    assert cache_status(out, copy).status == "up to date"


def test_a_same_size_rewrite_with_a_new_mtime_is_decoded_its_untouched_neighbours_are_not(tmp_path):
    """BMPs keep their size when rewritten: the digest tells a rewrite (decoded, new pixels) from a touch (reused),
    and status counts one modified, one touched."""
    src = _bmp_tree(tmp_path / "src", age_ns=HOUR_NS)
    opts = dict(size=16, jobs=1, progress=False)
    build(folder_plan(src), tmp_path / "c", BuildOptions(**opts))
    rewritten, touched = src / "a" / "0.bmp", src / "b" / "3.bmp"
    _rewrite_keeping_stat(rewritten)
    for f in (rewritten, touched):
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    st = cache_status(tmp_path / "c", src)
    assert (st.modified, st.touched) == (1, 1) and st.examples == {"modified": ["a/0.bmp"], "touched": ["b/3.bmp"]}
    got = build(folder_plan(src), tmp_path / "c", BuildOptions(**opts, update=True))
    assert (got.decoded, got.reused) == (1, 11)
    assert open_cache(tmp_path / "c").gather(np.array([0])).max() == 7  # the rewrite's pixels
    build(folder_plan(src), tmp_path / "f", BuildOptions(**opts))
    _assert_same_cache(tmp_path / "c", tmp_path / "f")


def test_a_cache_without_digests_updates_by_stat_as_before_and_gains_them(imagenet_clean, tmp_path):
    """A cache of an earlier release records no digest of its source files' bytes: it reads, and a copied tree
    updates by decoding every file (what that release did), the result a fresh build, digests included; a
    table of an algorithm this release does not compute is read as having none."""
    from cachebuild.storage import open_location
    from cachebuild.storage.cache import load_source_inputs

    src = _copy_tree(imagenet_clean["train_dir"], tmp_path / "src")
    opts = dict(size=32, jobs=1, progress=False)
    out = tmp_path / "cache"
    build(folder_plan(src), out, BuildOptions(**opts))
    as_sha256_cache(out, 2)  # as the previous release wrote it: no digests
    assert "digests" not in json.loads((out / "source_files.json").read_text())
    assert load_source_inputs(open_location(out), read_manifest(out)).digests is None
    assert open_cache(out).verify() == []
    copy = _copied_as_cp_r(src, tmp_path / "copy")
    st = cache_status(out, copy)
    assert (st.modified, st.touched) == (len(folder_plan(copy)), 0)
    got = build(folder_plan(copy), out, BuildOptions(**opts, update=True))
    assert (got.decoded, got.reused) == (got.count, 0)
    build(folder_plan(copy), tmp_path / "fresh", BuildOptions(**opts))
    _assert_same_cache(out, tmp_path / "fresh")


def test_a_shard_linked_in_again_leaves_no_temporary_file(tmp_path):
    """A killed update may have linked an old shard in already; linking it again (the resumed update) must not
    leave its temporary name behind (rename(2) of a hard link over another of the same file does nothing)."""
    from cachebuild.storage.kinds.base import link_shard

    old = tmp_path / "old.npy"
    old.write_bytes(b"shard bytes")
    staged = tmp_path / "staging" / "images-00003.npy"
    staged.parent.mkdir()
    link_shard(old, staged)
    link_shard(old, staged)  # the resumed update, the same block taken whole again
    assert sorted(p.name for p in staged.parent.iterdir()) == ["images-00003.npy"]
    assert staged.read_bytes() == b"shard bytes"
