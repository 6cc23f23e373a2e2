"""The output's environment fails: disk full, read-only, permission denied, a file in the way.

Each must end with one line naming the path and what to do (no traceback), keep the finished blocks,
and the same command must finish the build once the cause is gone. Disk full is a real small tmpfs
mounted by the test when it may mount (root), else an injected ENOSPC at a shard write.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.helpers import build_reference, cli, same_cache, without_dac_override

ARGS = ["--size", "64", "--shard-size", "2", "--jobs", "1", "--no-progress"]


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path | None]:
    """A 256 KiB tmpfs (None where this process may not mount); unmounted afterwards."""
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None or not _mount("-t", "tmpfs", "-o", "size=256k", "tmpfs",
                                                                         str(mnt)):
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def ref(photo_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("envref")
    build_reference("folder", str(photo_tree), "--out", str(out), *ARGS)
    return out / "train"


def test_disk_full_then_room(photo_tree: Path, tmp_path: Path, tmpfs: Path | None, ref: Path, ledger) -> None:
    """16 samples of 12 KB at 64 px, 8 shards: a 256 KiB disk fills part way; then there is room."""
    row = "disk full (ENOSPC): one line, resumes when there is room"
    with ledger.trial(row, "tmpfs" if tmpfs else "injected ENOSPC"):
        out = (tmpfs or tmp_path) / "c"
        fault = {} if tmpfs else {"CB_FAULT": "enospc:shard-write:9"}
        r = cli("folder", str(photo_tree), "--out", str(out), *ARGS, **fault)
        line = _error_line(r)
        staging = out / "train.partial"
        assert line.startswith(f"Error: {staging}: no space left on the device"), line
        assert "rerun the same command" in line and "finished blocks" in line, line
        finished = list((staging / "blocks").glob("block-*.json"))
        assert finished, "the blocks finished before the disk filled must be kept"
        if tmpfs:
            assert _mount("-o", "remount,size=8m", str(tmpfs))
        r = cli("folder", str(photo_tree), "--out", str(out), *ARGS, "-v")
        assert r.returncode == 0, r.stderr
        assert f"{len(finished)} of 8 blocks already built" in r.stderr
        assert same_cache(ref, out / "train") == []


def test_read_only_filesystem(photo_tree: Path, tmp_path: Path, tmpfs: Path | None, ledger) -> None:
    with ledger.trial("read-only filesystem (EROFS): one line", "tmpfs" if tmpfs else "injected EROFS"):
        if tmpfs is not None:
            assert _mount("-o", "remount,ro", str(tmpfs))
            line = _error_line(cli("folder", str(photo_tree), "--out", str(tmpfs / "c"), *ARGS))
            assert line == f"Error: {tmpfs / 'c'}: read-only filesystem: choose an --out on a writable one; " \
                           f"then rerun the same command", line
        else:  # remounted read-only under a running build
            out = tmp_path / "c"
            line = _error_line(cli("folder", str(photo_tree), "--out", str(out), *ARGS,
                                   CB_FAULT="erofs:shard-write:5"))
            assert line.startswith(f"Error: {out / 'train.partial'}: read-only filesystem"), line


def test_permission_denied(photo_tree: Path, tmp_path: Path, ref: Path, ledger) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    row = "permission denied (EACCES): one line, resumes when fixed"
    with ledger.trial(row, "--out in a folder without write permission"):
        r = cli("folder", str(photo_tree), "--out", str(locked / "c"), *ARGS, prefix=without_dac_override())
        line = _error_line(r)
        assert line.startswith(f"Error: {locked / 'c'}: permission denied"), line
    with ledger.trial(row, "the staging folder made read-only part way"):
        out = tmp_path / "c"
        r = cli("folder", str(photo_tree), "--out", str(out), *ARGS, CB_FAULT="kill:record:3")
        assert r.returncode == -9
        (out / "train.partial").chmod(0o555)
        r = cli("folder", str(photo_tree), "--out", str(out), *ARGS, prefix=without_dac_override())
        line = _error_line(r)
        assert "permission denied" in line and str(out / "train.partial") in line, line
        (out / "train.partial").chmod(0o755)
        r = cli("folder", str(photo_tree), "--out", str(out), *ARGS, "-v")
        assert r.returncode == 0 and "3 of 8 blocks already built" in r.stderr, r.stderr
        assert same_cache(ref, out / "train") == []


def test_out_under_a_regular_file(photo_tree: Path, tmp_path: Path, ledger) -> None:
    (tmp_path / "report.pdf").write_bytes(b"%PDF-1.4")
    for out in (tmp_path / "report.pdf", tmp_path / "report.pdf" / "caches"):
        with ledger.trial("--out under a regular file: one line", out.name):
            line = _error_line(cli("folder", str(photo_tree), "--out", str(out), *ARGS))
            assert line == f"Error: {tmp_path / 'report.pdf'} is a file, not a folder, so {out / 'train'} cannot " \
                           f"be made there: choose another --out", line
            assert (tmp_path / "report.pdf").read_bytes() == b"%PDF-1.4"
