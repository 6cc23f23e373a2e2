"""SIGKILL of a real build at random points, then the same command again: the resumed cache must be
byte-identical to an uninterrupted build and verify, with nothing left behind.

The points (tests/reliability/faults.py): inside a worker mid-block, between blocks, during the manifest
write, around the commit's renames (with --force: between moving the old cache aside and the new one in),
during zarr compaction (the source has broken files mid-plan, so zarr blocks must move), and a worker
alone killed (the OOM killer): that run must end with one line, the next resumes. The fast rows run in
``make test``; ``make reliability`` runs them all (``RELIABILITY_SEED`` picks other random points).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from cachebuild.samples.broken import write_empty_file, write_truncated_jpeg
from tests.reliability.helpers import build_reference, cli, same_cache

ROW = "SIGKILL of a build, then resume: byte-identical + verify"
WORKER_ROW = "a worker SIGKILLed alone (OOM killer): one line, then resume"
SEED = int(os.environ.get("RELIABILITY_SEED", "0"))

FORMATS = {
    "npy": [],
    "zarr": ["--format", "zarr", "--chunk-size", "1"],
    "zarr+zstd": ["--format", "zarr", "--chunk-size", "1", "--compression", "zstd"],
}


@pytest.fixture(scope="module")
def source(photo_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """18 files, 2 of them broken and sorted mid-plan (zarr blocks after them move down at the end)."""
    src = tmp_path_factory.mktemp("killsrc") / "train"
    shutil.copytree(photo_tree, src)
    first = sorted(p for p in src.iterdir() if p.is_dir())[0]
    names = sorted(p.name for p in first.iterdir())
    write_truncated_jpeg(first, names[2].replace(".JPEG", "_cut.JPEG"))
    write_empty_file(first, names[4].replace(".JPEG", "_empty.JPEG"))
    return src


def _args(fmt: str, jobs: int = 1) -> list[str]:
    return ["--size", "32", "--shard-size", "2", "--jobs", str(jobs), "--no-progress", *FORMATS[fmt]]


@pytest.fixture(scope="module")
def refs(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted builds, made on first use."""
    root = tmp_path_factory.mktemp("refs")

    class Refs(dict):
        def __missing__(self, fmt: str) -> Path:
            build_reference("folder", str(source), "--out", str(root / fmt), *_args(fmt))
            self[fmt] = root / fmt / "train"
            return self[fmt]

    return Refs()


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name not in ("train", "train.lock"))


def kill_then_resume(ledger, source: Path, refs: dict[str, Path], out: Path, fmt: str, fault: str,
                     *, force: bool = False, jobs: int = 2) -> None:
    """One trial: the build (``jobs`` workers: threads for npy, processes for zarr; 1: in-process) killed at
    ``fault``, then rerun; with ``force``, over an older cache. The reference is a --jobs 1 build: workers never
    change a byte."""
    args = ["folder", str(source), "--out", str(out), *_args(fmt, jobs), *(["--force"] if force else [])]
    row = WORKER_ROW if fault.startswith("kill-self") else ROW
    with ledger.trial(row, f"{fmt} {fault}{' --force' if force else ''} (seed {SEED})"):
        if force:
            build_reference("folder", str(source), "--out", str(out), *_args(fmt), "--size", "24", "--force")
        killed = cli(*args, CB_FAULT=fault)
        if fault.startswith("kill-self"):
            assert killed.returncode == 1, killed.stderr
            last = killed.stderr.strip().splitlines()[-1]
            assert last.startswith("Error: a worker process building") and "rerun the same command" in last, last
            assert "Traceback" not in killed.stderr
        else:
            assert killed.returncode == -9, f"the fault was not reached: {killed.stderr[-500:]}"
        build_reference(*args)  # the same command again, here: only the kill needs a process of its own
        assert same_cache(refs[fmt], out / "train") == []
        assert _leftovers(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_kill_points(ledger, source: Path, refs: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """Random points of every kind over npy, zarr and zarr+zstd: in a worker mid-block and between blocks
    (--jobs 2: threads for npy, processes for zarr), in the manifest write, before the commit's rename and in
    zarr compaction (the parent's work: --jobs 1 reaches it sooner); for npy also the commit's renames under
    --force; for zarr a worker process killed alone."""
    rng = random.Random(f"{SEED}-{fmt}")
    n_decode, n_record, n_compact = {"npy": (3, 2, 0), "zarr": (2, 2, 3), "zarr+zstd": (1, 1, 2)}[fmt]
    in_workers = [f"kill:decode:{rng.randint(1, 8)}" for _ in range(n_decode)]
    in_workers += [f"kill:record:{rng.randint(1, 3)}" for _ in range(n_record)]
    in_parent = [f"kill:compact:{rng.randint(1, 6)}" for _ in range(n_compact)] + ["kill:manifest:1", "kill:rename:1"]
    for i, fault in enumerate(in_workers):
        kill_then_resume(ledger, source, refs, tmp_path / f"w{i}", fmt, fault, jobs=2)
    for i, fault in enumerate(in_parent):
        kill_then_resume(ledger, source, refs, tmp_path / f"p{i}", fmt, fault, jobs=1)
    if fmt == "npy":
        for n in (1, 2):  # before moving the old cache aside; between that and the new one's rename
            kill_then_resume(ledger, source, refs, tmp_path / f"force-{n}", fmt, f"kill:rename:{n}", force=True,
                             jobs=1)
        kill_then_resume(ledger, source, refs, tmp_path / "force-after", fmt, "kill:rename-after:2", force=True,
                         jobs=1)
    else:  # a worker process killed alone: only a process pool has one (zarr's; a threaded build is killed
        # whole, as the kill:decode trials above are, and resumes the same way)
        kill_then_resume(ledger, source, refs, tmp_path / "worker", fmt, f"kill-self:decode:{rng.randint(1, 5)}")


def test_fast_kill_points(ledger, source: Path, refs: dict[str, Path], tmp_path: Path) -> None:
    """The default run's share, in-process (--jobs 1) to stay quick: one kill mid-block, one in zarr
    compaction (the manifest write's kill is in test_random_kill_points, for every format)."""
    rng = random.Random(SEED)
    kill_then_resume(ledger, source, refs, tmp_path / "a", "npy", f"kill:decode:{rng.randint(1, 9)}", jobs=1)
    kill_then_resume(ledger, source, refs, tmp_path / "c", "zarr", f"kill:compact:{rng.randint(1, 6)}", jobs=1)
