"""pull / push never destroy what cachebuild did not write, and never leave a copy that looks complete but is
not: foreign files beside a cache, a foreign ``DEST.partial``, another tool's manifest at a URL, a
destination inside the cache being pulled or under a regular file, a damaged local copy, an interrupted
``push --force``. Real caches, the loopback S3 server (moto on 127.0.0.1)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheNotFoundError
from loaders.dataset import CachedImageDataset
from tests.loaders_fixtures import make_cache
from tests.trees import file_names, tree_bytes


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _remote(s3, prefix: str) -> list[str]:
    return sorted(p.split(f"/{prefix}/", 1)[1] for p in s3.fs.find(s3.url(prefix)))


# ---------------------------------------------------------------- local destinations


@pytest.mark.parametrize("foreign", ["a file added", "a damaged manifest", "another tool's manifest"])
def test_pull_force_never_replaces_a_folder_holding_what_cachebuild_did_not_write(tmp_path, foreign):
    # Before: --force set the folder aside and the sweep deleted it, the user's file with it.
    src, _, _ = make_cache(tmp_path / "src", n=40)
    dest, _, _ = make_cache(tmp_path / "dest", n=30, h=9, w=9)
    if foreign == "a file added":
        (dest / "notes.txt").write_text("mine")
    elif foreign == "a damaged manifest":
        (dest / "manifest.json").write_text('{"format": "cachebuild", ')
    else:
        (dest / "manifest.json").write_text('{"format": "other-tool", "items": 3}')
    before = tree_bytes(dest)
    r = _cli("pull", src, dest, "--force", "--no-progress")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "even with --force" in r.output and "another destination" in r.output, r.output
    assert tree_bytes(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "dest.lock", "src"]  # nothing set aside


def test_pull_leaves_a_partial_folder_it_did_not_make_alone(tmp_path):
    # Before: "<DEST>.partial" without our marker was rmtree'd as "another source's" staging.
    src, _, _ = make_cache(tmp_path / "src", n=40)
    mine = tmp_path / "c.partial"
    mine.mkdir()
    (mine / "thesis.tex").write_text("mine")
    r = _cli("pull", src, tmp_path / "c", "--no-progress")
    assert r.exit_code == 1 and "c.partial" in r.output and "not made by cachebuild" in r.output, r.output
    assert (mine / "thesis.tex").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
    assert not (tmp_path / "c").exists()


def test_a_pull_of_another_cache_still_discards_its_own_unfinished_staging(tmp_path):
    a, _, _ = make_cache(tmp_path / "a", n=40)
    b, _, _ = make_cache(tmp_path / "b", n=24, h=10, w=10)
    staging = tmp_path / "c.partial"
    staging.mkdir()
    (staging / "pull.json").write_text(json.dumps({"source": str(a), "manifest_sha256": "0" * 64}))
    (staging / "images-00000.npy").write_bytes(b"half of another cache")
    r = _cli("pull", b, tmp_path / "c", "--no-progress")
    assert r.exit_code == 0, r.output
    assert tree_bytes(tmp_path / "c") == tree_bytes(b) and not staging.exists()


@pytest.mark.parametrize("command", ["pull", "push"])
def test_a_destination_inside_the_cache_being_copied_is_refused_before_writing(tmp_path, command):
    # Before: the copy (and its lock and staging folder) was written into the source cache's folder.
    src, _, _ = make_cache(tmp_path / "src", n=40)
    before = tree_bytes(src)
    r = _cli(command, src, src / "copy", "--no-progress")
    assert r.exit_code == 1 and "inside" in r.output and "Traceback" not in r.output, r.output
    assert tree_bytes(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_destination_under_a_regular_file_is_one_line(tmp_path):
    # Before: a FileExistsError traceback from making the lock file's folder.
    src, _, _ = make_cache(tmp_path / "src", n=40)
    (tmp_path / "afile").write_text("x")
    r = _cli("pull", src, tmp_path / "afile" / "c")
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert f"{tmp_path / 'afile'} is a file, not a folder" in r.output
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_pull_never_calls_a_damaged_copy_up_to_date_and_force_pulls_it_again(tmp_path, damage):
    # Before: the manifest matched, so "up to date" was printed (exit 0), with --force too.
    src, images, _ = make_cache(tmp_path / "src", n=40)
    dest = tmp_path / "dest"
    assert _cli("pull", src, dest).exit_code == 0
    victim = dest / "images-00001.npy"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:-7])
    r = _cli("pull", src, dest, "--no-progress")
    assert r.exit_code == 1 and "images-00001.npy" in r.output and "--force" in r.output, r.output
    assert "up to date" not in r.output
    r = _cli("pull", src, dest, "--force", "--no-progress")
    assert r.exit_code == 0 and "pulled" in r.output, r.output
    assert tree_bytes(dest) == tree_bytes(src)
    assert np.array_equal(CachedImageDataset(dest).gather(np.arange(40)), images)
    assert _cli("pull", src, dest, "--force").output.strip().endswith("up to date (6 files)")


# ---------------------------------------------------------------- remote destinations


@pytest.mark.parametrize("manifest", [b'{"tool": "other", "version": 3}', b"not json at all"])
def test_push_force_never_replaces_a_manifest_cachebuild_did_not_write(tmp_path, s3, manifest):
    # Before: --force deleted the other tool's manifest.json and overwrote its paths.json.
    root, _, _ = make_cache(tmp_path / "c", n=20)
    s3.fs.pipe(s3.url("data/manifest.json"), manifest)
    s3.fs.pipe(s3.url("data/paths.json"), b"mine")
    r = _cli("push", root, s3.url("data"), "--force", "--no-progress")
    assert r.exit_code == 1 and "not a cachebuild manifest" in r.output and "Traceback" not in r.output, r.output
    assert _remote(s3, "data") == ["manifest.json", "paths.json"]
    assert s3.fs.cat(s3.url("data/manifest.json")) == manifest and s3.fs.cat(s3.url("data/paths.json")) == b"mine"


def test_push_force_interrupted_while_taking_the_old_cache_down_resumes(tmp_path, s3):
    # Before: the rerun found files but no manifest and no marker, and refused for good ("no cachebuild cache").
    from cachebuild.errors import RemoteError
    from cachebuild.storage.locations.url import FsspecLocation

    a, _, _ = make_cache(tmp_path / "a", n=70, shard_size=16, h=16, w=12)
    b, images_b, _ = make_cache(tmp_path / "b", n=30, shard_size=16, h=16, w=10)
    url = s3.url("team/c")
    s3.fs.pipe(s3.url("team/c-notes/readme.txt"), b"a neighbour")
    assert _cli("push", a, url, "--no-progress").exit_code == 0
    s3.fs.pipe(s3.url("team/c/README.txt"), b"mine, beside the cache")
    real = FsspecLocation.remove

    def half_then_reset(self, *names):  # a bulk delete cut off half way by a dropped connection
        if len(names) > 1:
            real(self, *names[: len(names) // 2])
            raise RemoteError(f"{self.describe()}: cannot delete {len(names)} file(s): connection reset")
        return real(self, *names)

    with pytest.MonkeyPatch.context() as mp:  # not the fixture's monkeypatch: undoing that drops the AWS env
        mp.setattr(FsspecLocation, "remove", half_then_reset)
        r = _cli("push", b, url, "--force", "--no-progress")
    assert r.exit_code == 1 and "connection reset" in r.output, r.output
    with pytest.raises(CacheNotFoundError, match="not a cachebuild cache"):  # no cache, never a half one
        CachedImageDataset(url)
    r = _cli("push", b, url, "--force", "--no-progress")
    assert r.exit_code == 0 and "pushed" in r.output, r.output
    assert _remote(s3, "team/c") == sorted([*tree_bytes(b), "README.txt"])  # a's leftovers gone, the user's file kept
    assert s3.fs.cat(s3.url("team/c/README.txt")) == b"mine, beside the cache"
    assert s3.fs.cat(s3.url("team/c-notes/readme.txt")) == b"a neighbour"
    dest = tmp_path / "back"
    assert _cli("pull", url, dest, "--no-progress").exit_code == 0 and tree_bytes(dest) == tree_bytes(b)
    assert np.array_equal(CachedImageDataset(url).gather(np.arange(30)), images_b)


# ---------------------------------------------------------------- a pull and what happens around it


def _inverted(root: Path, images: np.ndarray) -> None:
    """Replace the cache at ``root`` by one of the same layout and names, every pixel other."""
    from cachebuild.storage.cache import write_cache

    write_cache(root, 255 - images, (np.arange(len(images)) * 3) % 5, [f"class{k}" for k in range(5)],
                storage="npy", shard_size=16, replace=True)


def test_a_url_cache_replaced_during_a_pull_never_becomes_a_mixed_local_cache(tmp_path, http_server):
    from cachebuild.errors import TransferError
    from cachebuild.share import pull

    root, images, _ = make_cache(tmp_path / "site" / "c", n=80, storage="npy", shard_size=16, h=16, w=12)
    server = http_server(tmp_path / "site")
    url = server.url_for("c")
    server.fail("c/images-00002.npy", "stall")  # in flight while the cache is replaced
    dest, staging = tmp_path / "out" / "c", tmp_path / "out" / "c.partial"
    others = {"images-00000.npy", "images-00001.npy", "images-00003.npy", "images-00004.npy"}
    got: list[BaseException] = []
    t = threading.Thread(target=lambda: got.extend(_raises(lambda: pull(url, dest, jobs=2, progress=False))))
    t.start()
    deadline = time.time() + 60
    while not (staging.is_dir() and others <= file_names(staging)) and time.time() < deadline:
        time.sleep(0.02)
    assert t.is_alive(), "the pull must still be waiting for the stalled file"
    _inverted(root, images)  # someone replaces the cache at the URL (the server serves the new files)
    server.clear()  # the stalled request is answered (503, retried): with the new cache's bytes
    t.join(60)
    assert len(got) == 1 and isinstance(got[0], TransferError) and "images-00002.npy" in str(got[0]), got
    assert not dest.exists()  # no cache made of the old one's files and a new one's
    assert pull(url, dest, progress=False)[0].status == "pulled"  # the rerun: the new cache, whole
    assert tree_bytes(dest) == tree_bytes(root)
    assert np.array_equal(CachedImageDataset(dest).gather(np.arange(80)), 255 - images)


def _raises(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as e:  # handed to the test's thread
        return [e]
    return []


def test_a_build_takes_over_the_staging_folder_of_an_unfinished_pull(tmp_path, http_server, monkeypatch):
    # Before: the build said the pull's staging folder "was not made by cachebuild" and stopped.
    import cv2

    make_cache(tmp_path / "site" / "train", n=40)
    server = http_server(tmp_path / "site")
    server.fail("train/images-00001.npy", 500, times=None)
    monkeypatch.setenv("CACHEBUILD_RETRIES", "2")  # the pull fails at once (10 tries back off ~10 s)
    r = _cli("pull", server.url_for("train"), tmp_path / "out" / "train", "--no-progress")
    assert r.exit_code == 1 and (tmp_path / "out" / "train.partial" / "pull.json").is_file(), r.output
    src = tmp_path / "tree"
    for k in range(4):
        (src / f"class{k % 2}").mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(src / f"class{k % 2}" / f"{k}.bmp"), np.full((20, 24, 3), 40 * k, dtype=np.uint8))
    r = _cli("folder", src, "--size", "16", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert _cli("verify", tmp_path / "out" / "train").exit_code == 0
    assert not (tmp_path / "out" / "train.partial").exists()
