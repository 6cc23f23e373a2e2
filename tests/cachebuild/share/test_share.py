"""pull / push against real loopback servers (moto's S3, an aiohttp file server): byte-for-byte round trips,
every file checked on arrival, manifest last, resumable without fetching again what arrived, bad input refused
with nothing written outside the destination."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheNotFoundError
from cachebuild.storage.cache import read_manifest
from loaders.dataset import CachedImageDataset
from tests.loaders_fixtures import make_cache, make_images
from tests.manifest_edits import load_unsealed
from tests.same_key import same_key_caches
from tests.share_races import upload_fails_on
from tests.trees import file_names, tree_bytes


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, to show that nothing was written."""
    return tree_bytes(root)


def _flip(data: bytes, at: int | None = None) -> bytes:
    b = bytearray(data)
    b[len(b) // 2 if at is None else at] ^= 0x01
    return bytes(b)


def _two_splits(root: Path) -> None:
    make_cache(root / "train", n=70, storage="npy", shard_size=16, h=16, w=12)
    make_cache(root / "val", n=40, storage="zarr", shard_size=16, h=16, w=12, compression="zstd")


# ---------------------------------------------------------------- S3 (moto)


def test_push_then_pull_round_trips_a_folder_of_caches_byte_for_byte(tmp_path, s3):
    src = tmp_path / "src"
    _two_splits(src)  # npy and zarr (zstd) side by side, as `cachebuild imagenet --out` makes them
    url = s3.url("caches/in")
    r = _cli("push", src, url, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "in/train: pushed" in r.output and "in/val: pushed" in r.output
    puts = [q.path for q in s3.log if q.method == "PUT"]
    for split in ("train", "val"):
        mine = [p for p in puts if f"/caches/in/{split}/" in p and not p.endswith("push-in-progress.json")]
        assert mine[-1].endswith(f"/{split}/manifest.json")  # every data file went before the manifest
        assert len(mine) == json.loads((src / split / "manifest.json").read_text())["files"]["count"] + 2
        assert not s3.fs.exists(s3.url(f"caches/in/{split}/push-in-progress.json"))
    assert _cli("push", src, url, "--no-progress").output.count("up to date") == 2

    dest = tmp_path / "nvme" / "in"
    r = _cli("pull", url, dest, "--no-progress")
    assert r.exit_code == 0, r.output
    for split in ("train", "val"):
        assert tree_bytes(dest / split) == tree_bytes(src / split)  # byte for byte, manifest included
    assert not (tmp_path / "nvme" / "in" / "train.partial").exists()
    assert np.array_equal(CachedImageDataset(dest / "val").gather(np.arange(40)), make_images(40, 16, 12))
    assert _cli("pull", url, dest).output.count("up to date") == 2


@pytest.mark.parametrize("storage,victim", [("npy", "images-00002.npy"), ("zarr", "images.zarr/c/2/0/0/0")])
def test_a_flipped_byte_in_one_remote_object_is_caught_by_pull_and_verify(tmp_path, s3, storage, victim):
    root, _, _ = make_cache(tmp_path / "c", n=70, storage=storage, shard_size=16, h=16, w=12)
    url = s3.url("team/c")
    assert _cli("push", root, url).exit_code == 0
    good = s3.fs.cat(s3.url(f"team/c/{victim}"))
    s3.fs.pipe(s3.url(f"team/c/{victim}"), _flip(good))

    dest = tmp_path / "local" / "c"
    r = _cli("pull", url, dest, "--no-progress")
    assert r.exit_code == 1 and victim in r.output and "xxh3-128" in r.output and "Traceback" not in r.output
    assert not dest.exists()  # never looks complete
    staged = tree_bytes(tmp_path / "local" / "c.partial")
    expected = {k: v for k, v in tree_bytes(root).items() if k not in (victim, "manifest.json", "files.json")}
    assert {k: v for k, v in staged.items() if k != "pull.json"} == expected  # the others kept, intact
    r = _cli("verify", url)
    assert r.exit_code == 1 and victim.rsplit("/", 4)[0] in r.output

    s3.fs.pipe(s3.url(f"team/c/{victim}"), good)  # the remote fixed
    s3.log.clear()
    r = _cli("pull", url, dest, "--no-progress")
    assert r.exit_code == 0 and "already there" in r.output, r.output
    fetched = {q.path.split("/team/c/", 1)[1] for q in s3.log if q.method == "GET" and "/team/c/" in q.path}
    assert fetched == {"manifest.json", "files.json", victim}  # only what was missing
    assert tree_bytes(dest) == tree_bytes(root)


def test_an_interrupted_push_shows_no_cache_and_resumes_sending_only_the_rest(tmp_path, s3):
    root, _, _ = make_cache(tmp_path / "c", n=70, storage="npy", shard_size=16, h=16, w=12)
    url = s3.url("team/c")
    with upload_fails_on("images-00003.npy"):
        r = _cli("push", root, url, "--no-progress")
    assert r.exit_code == 1 and "images-00003.npy" in r.output and "rerun" in r.output
    with pytest.raises(CacheNotFoundError):  # a reader of the URL sees no cache, never a half one
        CachedImageDataset(url)
    s3.log.clear()
    r = _cli("push", root, url, "--no-progress")
    assert r.exit_code == 0 and "already there" in r.output, r.output
    put = sorted(q.path.split("/team/c/", 1)[1] for q in s3.log if q.method == "PUT")
    assert put == ["files.json", "images-00003.npy", "manifest.json", "push-in-progress.json"]
    dest = tmp_path / "back"
    assert _cli("pull", url, dest).exit_code == 0 and tree_bytes(dest) == tree_bytes(root)


def test_push_replaces_a_different_remote_cache_only_with_force(tmp_path, s3):
    a, _, _ = make_cache(tmp_path / "a", n=70, storage="npy", shard_size=16, h=16, w=12)
    b, _, _ = make_cache(tmp_path / "b", n=30, storage="npy", shard_size=16, h=16, w=12)
    url = s3.url("team/c")
    assert _cli("push", a, url).exit_code == 0
    r = _cli("push", b, url)
    assert r.exit_code == 1 and "different cache" in r.output and "--force" in r.output
    assert s3.fs.cat(s3.url("team/c/manifest.json")) == (a / "manifest.json").read_bytes()  # untouched
    r = _cli("push", b, url, "--force", "--no-progress")
    assert r.exit_code == 0, r.output
    remote = sorted(p.split("/team/c/", 1)[1] for p in s3.fs.find(s3.url("team/c")))
    assert remote == sorted(tree_bytes(b))  # a's extra shards are gone, nothing else left behind
    dest = tmp_path / "pulled"
    assert _cli("pull", url, dest).exit_code == 0 and tree_bytes(dest) == tree_bytes(b)


def test_push_never_writes_into_a_prefix_holding_something_else(tmp_path, s3):
    root, _, _ = make_cache(tmp_path / "c", n=20)
    s3.fs.pipe(s3.url("data/notes.txt"), b"mine")
    for flags in ([], ["--force"]):
        r = _cli("push", root, s3.url("data"), *flags)
        assert r.exit_code == 1 and "no cachebuild cache" in r.output
    assert s3.fs.find(s3.url("data")) == [f"{s3.name}/data/notes.txt"]


def test_a_cache_without_a_file_table_is_verified_whole(tmp_path, s3):
    """Caches built before files.json: pushed after a full verify, pulled by listing, verified whole on arrival."""
    root, _images, _ = make_cache(tmp_path / "c", n=70, storage="npy", shard_size=16, h=16, w=12)
    m = load_unsealed(root / "manifest.json")
    del m["files"]
    (root / "manifest.json").write_text(json.dumps(m))
    (root / "files.json").unlink()
    url = s3.url("old/c")
    assert _cli("push", root, url).exit_code == 0
    dest = tmp_path / "pulled"
    r = _cli("pull", url, dest)
    assert r.exit_code == 0, r.output
    assert tree_bytes(dest) == tree_bytes(root)
    s3.fs.pipe(s3.url("old/c/images-00001.npy"), _flip(s3.fs.cat(s3.url("old/c/images-00001.npy")), at=-5))
    r = _cli("pull", url, tmp_path / "again")
    assert r.exit_code == 1 and "images-00001.npy" in r.output and "checksum mismatch" in r.output
    assert not (tmp_path / "again").exists()


# ---------------------------------------------------------------- HTTP


def _served(tmp_path: Path, http_server, n: int = 200):
    root, _images, _ = make_cache(tmp_path / "site" / "c", n=n, storage="npy", shard_size=16, h=32, w=32)
    server = http_server(tmp_path / "site")
    return server, server.url_for("c"), root


def test_http_pull_killed_half_way_resumes_fetching_only_what_was_missing(tmp_path, http_server):
    server, url, root = _served(tmp_path, http_server)
    server.fail("c/images-00007.npy", "stall")  # in flight when the pull is killed
    dest = tmp_path / "out" / "c"
    staging = tmp_path / "out" / "c.partial"
    others = {k for k in tree_bytes(root) if k not in ("images-00007.npy", "manifest.json", "files.json")}
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild", "pull", url, str(dest), "--jobs", "2",
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (staging.is_dir() and others <= file_names(staging)):
            time.sleep(0.02)
        assert others <= file_names(staging), "the pull must get that far"
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not dest.exists()
    server.clear()
    r = _cli("pull", url, dest, "--no-progress")
    assert r.exit_code == 0 and "pulled 1 files" in r.output and f"{len(others)} already there" in r.output, r.output
    assert sorted(set(server.log.paths())) == ["/c/files.json", "/c/images-00007.npy", "/c/manifest.json"]
    served = [q for q in server.log if q.status < 300]  # (the killed pull's stalled request ends with a 503)
    assert sum(q.bytes_sent for q in served if q.path == "/c/images-00007.npy") == (
        root / "images-00007.npy").stat().st_size
    assert tree_bytes(dest) == tree_bytes(root)


def test_http_pull_checks_every_file(tmp_path, http_server):
    _server, url, root = _served(tmp_path, http_server, n=60)
    shard = root / "images-00001.npy"
    shard.write_bytes(_flip(shard.read_bytes()))  # damaged at the source, same size
    r = _cli("pull", url, tmp_path / "out")
    assert r.exit_code == 1 and "images-00001.npy" in r.output and "1 of" in r.output
    assert not (tmp_path / "out").exists()


def test_large_files_travel_in_ranges_and_are_checked(tmp_path, http_server, monkeypatch):
    import cachebuild.share.transfer as transfer

    monkeypatch.setattr(transfer, "PIECE_BYTES", 10_000)  # every shard (49 kB) in several range requests
    server, url, root = _served(tmp_path, http_server, n=48)
    assert _cli("pull", url, tmp_path / "out").exit_code == 0
    ranges = [q for q in server.log if q.path == "/c/images-00000.npy" and q.method == "GET"]
    assert len(ranges) == 5 and all(q.range for q in ranges)
    assert tree_bytes(tmp_path / "out") == tree_bytes(root)


# ---------------------------------------------------------------- bad input


def test_pull_of_something_that_is_not_a_cache_writes_nothing(tmp_path, http_server, s3):
    (tmp_path / "site").mkdir()
    server = http_server(tmp_path / "site")
    before = _tree(tmp_path)
    for url in (server.url_for("nothing-here"), s3.url("empty/prefix")):
        r = _cli("pull", url, tmp_path / "out" / "c")
        assert r.exit_code == 1 and "not a cachebuild cache" in r.output and "Traceback" not in r.output
    assert _tree(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["manifest", "table"])
@pytest.mark.parametrize("bad", ["../x.npy", "/etc/passwd", "http://127.0.0.1:1/x.npy", "a/../../x.npy"])
def test_pull_refuses_names_outside_the_cache_before_writing_anything(tmp_path, http_server, where, bad):
    _server, url, root = _served(tmp_path, http_server, n=40)
    m = load_unsealed(root / "manifest.json")
    if where == "manifest":
        m["shards"][0]["file"] = bad
    else:  # a table naming a file outside, with the manifest's checksum of the table made to match
        table = json.loads((root / "files.json").read_text())
        table["files"].append([bad, 4, xxhash.xxh3_128_hexdigest(b"evil")])
        data = json.dumps(table).encode()
        (root / "files.json").write_bytes(data)
        m["files"].update(digest=xxhash.xxh3_128_hexdigest(data), count=len(table["files"]))
    (root / "manifest.json").write_text(json.dumps(m))
    before = _tree(tmp_path)
    r = _cli("pull", url, tmp_path / "out" / "c")
    assert r.exit_code == 1 and "not a plain relative name inside the cache" in r.output
    assert _tree(tmp_path) == before and not (tmp_path / "out").exists()


def test_same_build_key_with_other_contents_is_a_different_cache(tmp_path, s3):
    # Before: push and pull compared build keys, so b was "up to date" where a was, and the URL or the
    # folder kept a's pixels while the user believed b had arrived.
    a, b = same_key_caches(tmp_path)
    url = s3.url("team/same-key")
    assert _cli("push", a, url, "--no-progress").exit_code == 0
    for args in (["push", b, url], ["pull", b, a]):
        r = _cli(*args, "--no-progress")
        assert r.exit_code == 1 and "same fingerprint" in r.output and "other contents" in r.output, r.output
        assert "--force" in r.output
    assert tree_bytes(a) != tree_bytes(b)  # neither refusal touched a, here or at the URL
    assert s3.fs.cat(s3.url("team/same-key/manifest.json")) == (a / "manifest.json").read_bytes()
    assert _cli("push", b, url, "--force", "--no-progress").exit_code == 0
    assert _cli("pull", url, a, "--force", "--no-progress").exit_code == 0
    assert tree_bytes(a) == tree_bytes(b)
    r = _cli("push", b, url, "--no-progress")  # the same contents: still up to date, nothing sent again
    assert r.exit_code == 0 and "up to date" in r.output, r.output


def test_pull_replaces_a_different_local_cache_only_with_force_and_readers_keep_the_old_one(tmp_path):
    old_root, old, _ = make_cache(tmp_path / "dest", n=40, storage="npy", shard_size=8)
    new_root, _new, _ = make_cache(tmp_path / "shared" / "c", n=24, storage="zarr", shard_size=8, h=10, w=10)
    reading = CachedImageDataset(old_root)
    r = _cli("pull", new_root, old_root)
    assert r.exit_code == 1 and "different cache" in r.output and "--force" in r.output
    assert np.array_equal(CachedImageDataset(old_root).gather(np.arange(40)), old)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a cache")
    for flags in ([], ["--force"]):
        r = _cli("pull", new_root, tmp_path / "mine", *flags)
        assert r.exit_code == 1 and "not a cachebuild cache" in r.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "not a cache"
    r = _cli("pull", new_root, old_root, "--force")
    assert r.exit_code == 0, r.output
    assert tree_bytes(old_root) == tree_bytes(new_root)
    assert np.array_equal(reading.gather(np.arange(40)), old)  # the job that had it open still reads the old cache
    assert read_manifest(old_root).count == 24
