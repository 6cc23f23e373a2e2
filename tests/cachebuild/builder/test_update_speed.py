"""The fast paths an update of a large tree takes: each gives what the plain path gave."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest

from cachebuild.builder.update import _old_samples, gc_paused
from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import decode_paths, encode_paths
from cachebuild.sources.plan import stat_files


def _stat_by_path(root: Path, keys: list[str]) -> np.ndarray:
    out = np.full((len(keys), 2), -1, dtype=np.int64)
    for i, key in enumerate(keys):
        try:
            st = os.stat(os.path.join(root, key))
        except OSError:
            continue
        out[i] = (st.st_size, st.st_mtime_ns)
    return out


def test_stat_files_by_open_folder_equals_stat_by_path(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "a" / "1.jpg").write_bytes(b"x" * 3)
    (tmp_path / "a" / "2.jpg").write_bytes(b"y" * 7)
    (tmp_path / "b" / "deep" / "3.jpg").write_bytes(b"z")
    (tmp_path / "top.jpg").write_bytes(b"w" * 11)
    os.utime(tmp_path / "a" / "2.jpg", ns=(1, 123_456_789_000))
    os.symlink(tmp_path / "a", tmp_path / "linked")  # a folder link: followed, as a stat of the path follows it
    os.symlink(tmp_path / "nowhere.jpg", tmp_path / "a" / "dangling.jpg")
    (tmp_path / "plain").write_bytes(b"not a folder")
    keys = ["a/1.jpg", "a/2.jpg", "a/dangling.jpg", "a/gone.jpg", "b/deep/3.jpg", "top.jpg", "linked/2.jpg",
            "missing/1.jpg", "plain/1.jpg", "a/1.jpg"]  # a folder seen again after others: opened again
    got = stat_files(tmp_path, keys)
    assert got.dtype == np.int64 and got.shape == (len(keys), 2) and got.flags.c_contiguous
    assert np.array_equal(got, _stat_by_path(tmp_path, keys))
    assert got[1].tolist() == [7, 123_456_789_000]
    assert got[2].tolist() == got[3].tolist() == got[7].tolist() == got[8].tolist() == [-1, -1]
    assert stat_files(tmp_path, []).shape == (0, 2)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder")
def test_stat_files_in_a_folder_it_cannot_open_for_reading(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "1.jpg").write_bytes(b"abc")
    os.chmod(tmp_path / "c", 0o100)  # search only: a stat by path still works
    try:
        assert stat_files(tmp_path, ["c/1.jpg"])[0, 0] == 3
    finally:
        os.chmod(tmp_path / "c", 0o700)


def test_decode_paths_all_plain_or_some_escaped() -> None:
    plain = ["n01/a.JPEG", "n02/b.JPEG"]
    assert decode_paths(json.loads(json.dumps(encode_paths(plain)))) == plain
    odd = ["n01/a.JPEG", os.fsdecode(b"n02/\xff.JPEG")]
    assert decode_paths(json.loads(json.dumps(encode_paths(odd)))) == odd


def test_old_samples_identity_and_with_failures() -> None:
    keys = ["a", "b", "c", "d"]
    assert _old_samples(keys, list(keys), "x").tolist() == [0, 1, 2, 3]
    assert _old_samples(keys, ["a", "c"], "x").tolist() == [0, -1, 1, -1]
    with pytest.raises(CacheBuildError, match=r"paths\.json does not follow"):
        _old_samples(keys, ["c", "a"], "x")


def test_gc_paused_restores_the_callers_setting() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # the caller had it off: it stays off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a block failed")
    assert gc.isenabled()
