"""What runs a build's blocks, by one rule: threads of the building process, processes where a worker needs its
own (zarr's sinks, a GPU each), a caller's joblib backend over both; the bytes are the same whatever runs them."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import cv2
import joblib
import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.builder.sample import one_thread_each
from cachebuild.cli import main
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import read_manifest


@dataclasses.dataclass(frozen=True)
class _PidReader:
    """The plan's reader, noting the pid of every process that reads a source file (picklable for workers)."""

    inner: object
    log: str

    def __call__(self, i: int, key: str):
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        return self.inner(i, key)  # type: ignore[operator]


def _pids(log: Path) -> set[int]:
    return {int(line) for line in log.read_text().splitlines()}


def _digests(path: Path) -> list[str]:
    return [s.digest for s in read_manifest(path).shards]


def test_threads_by_default_processes_by_the_callers_backend_and_the_same_bytes(imagenet_tree, tmp_path: Path):
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    cv2_threads = cv2.getNumThreads()
    logs = {name: tmp_path / f"{name}.log" for name in ("threads", "loky", "one")}
    traced = {name: dataclasses.replace(plan, reader=_PidReader(plan.reader, str(log))) for name, log in logs.items()}
    threads = build(traced["threads"], tmp_path / "threads", BuildOptions(size=40, block_size=4, jobs=2))
    with joblib.parallel_config(backend="loky"):  # a caller's backend wins (--dask-scheduler sets dask's)
        loky = build(traced["loky"], tmp_path / "loky", BuildOptions(size=40, block_size=4, jobs=2))
    one = build(traced["one"], tmp_path / "one", BuildOptions(size=40, block_size=4, jobs=1))
    assert _pids(logs["threads"]) == _pids(logs["one"]) == {os.getpid()}  # no process started
    assert os.getpid() not in _pids(logs["loky"])
    assert cv2.getNumThreads() == cv2_threads  # one OpenCV thread while the blocks ran, the caller's again after
    a = read_manifest(threads.path)
    assert len(a.shards) > 2 and _digests(threads.path) == _digests(loky.path) == _digests(one.path)
    for other in (loky, one):
        b = read_manifest(other.path)
        assert a.failures == b.failures and a.count == b.count
        for name in ("labels", "sizes"):
            assert np.array_equal(np.load(threads.path / a.arrays[name].file),
                                  np.load(other.path / b.arrays[name].file))


def test_a_zarr_build_runs_its_blocks_in_worker_processes(imagenet_tree, tmp_path: Path) -> None:
    """zarr's sinks set process-wide zarr settings while they write: threads must not share them."""
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    log = tmp_path / "zarr.log"
    build(dataclasses.replace(plan, reader=_PidReader(plan.reader, str(log))), tmp_path / "z",
          BuildOptions(size=32, block_size=8, chunk_size=8, jobs=2, storage="zarr"))
    assert os.getpid() not in _pids(log)


def test_one_thread_each_holds_opencv_and_torch_to_one_thread_and_gives_them_back() -> None:
    import torch

    before = (cv2.getNumThreads(), torch.get_num_threads())
    with one_thread_each():
        assert (cv2.getNumThreads(), torch.get_num_threads()) == (1, 1)
    assert (cv2.getNumThreads(), torch.get_num_threads()) == before


def test_torch_imported_during_a_build_runs_on_one_thread_and_its_count_comes_back(tmp_path: Path) -> None:
    """A build that meets its first large downscale imports torch then: its kernel on one thread (torch's own
    threads spin up for every small image), and the process's count as torch set it once the build is done."""
    import subprocess

    code = ("import sys, numpy as np\n"
            "from cachebuild.builder.sample import ResizeSpec, decode_into, one_thread_each\n"
            "src = np.random.default_rng(0).integers(0, 256, (500, 600, 3), dtype=np.uint8)\n"
            "with one_thread_each():\n"
            "    assert 'torch' not in sys.modules\n"
            "    decode_into(src, ResizeSpec(64), np.empty((64, 64, 3), np.uint8))\n"
            "    import torch\n"
            "    inside = torch.get_num_threads()\n"
            "print(inside, torch.get_num_threads())\n")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr[-2000:]
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, timeout=120, env=env, check=True).stdout.strip()
    assert r.stdout.split() == ["1", default]


@pytest.mark.parametrize(("flag", "value", "names"), [("--workers", "threads", "threads"),
                                                      ("--codec", "jpeg", "--format jpeg")])
def test_the_spellings_of_earlier_releases_are_errors_naming_what_to_write(imagenet_tree, tmp_path: Path, flag: str,
                                                                           value: str, names: str) -> None:
    r = CliRunner().invoke(main, ["imagenet", str(imagenet_tree["root"]), "--size", "32", "--out",
                                  str(tmp_path / "c"), flag, value])
    assert r.exit_code == 2 and f"{flag} is no longer a flag" in r.output and names in r.output, r.output
    assert not (tmp_path / "c").exists()
