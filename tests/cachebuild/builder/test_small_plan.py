"""Small local plans at the default --jobs are built in the calling process (no worker start-up), with the
same bytes as a build in worker processes; anything else keeps the workers."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import cv2
import joblib
import numpy as np

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.builder.small_plan import IN_PROCESS_MAX, IN_PROCESS_MAX_BYTES, in_process, runs_in_process
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import read_manifest


@dataclasses.dataclass(frozen=True)
class _PidReader:
    """The plan's reader, noting the pid of every process that reads a source file (picklable for workers)."""

    inner: object
    log: str

    def __call__(self, i: int, key: str):
        with open(self.log, "a", encoding="utf-8") as f:  # and whether torch came in (it should not: issue 36)
            f.write(f"{os.getpid()} {int('torch' in sys.modules)}\n")
        return self.inner(i, key)  # type: ignore[operator]


def _pids(log: Path) -> set[int]:
    return {int(line.split()[0]) for line in log.read_text().splitlines()}


def test_a_small_plan_is_built_here_with_the_bytes_of_any_build(imagenet_tree, tmp_path: Path) -> None:
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    here_log = tmp_path / "here.log"
    threads = cv2.getNumThreads()
    here = build(dataclasses.replace(plan, reader=_PidReader(plan.reader, str(here_log))), tmp_path / "a",
                 BuildOptions(size=48, block_size=4))
    assert _pids(here_log) == {os.getpid()}  # every file read in this process: no worker started
    assert cv2.getNumThreads() == threads  # the caller's setting came back
    # --jobs 1 (the caller's thread settings) gives the bytes of --jobs 2 (test_build.test_jobs_do_not_change_a_byte)
    workers = build(plan, tmp_path / "b", BuildOptions(size=48, block_size=4, jobs=1))
    worker_log = tmp_path / "workers.log"
    two = build(dataclasses.replace(plan, reader=_PidReader(plan.reader, str(worker_log))), tmp_path / "c",
                BuildOptions(size=48, block_size=4, jobs=2, workers="processes"))
    assert os.getpid() not in _pids(worker_log)
    # the CPU build's workers never import torch (its import was ~2 s of CPU a worker)
    assert {line.split()[1] for line in worker_log.read_text().splitlines()} == {"0"}
    assert [s.digest for s in read_manifest(two.path).shards] == [s.digest for s in read_manifest(here.path).shards]
    ma, mb = read_manifest(here.path), read_manifest(workers.path)
    assert here.count == workers.count > 4 and len(ma.shards) > 1
    assert [s.digest for s in ma.shards] == [s.digest for s in mb.shards]
    labels = [np.load(c.path / m.arrays["labels"].file) for c, m in ((here, ma), (workers, mb))]
    assert np.array_equal(*labels)


def test_what_keeps_the_workers(imagenet_tree) -> None:
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    assert runs_in_process(-1, plan)
    assert not runs_in_process(2, plan)  # --jobs given
    many = dataclasses.replace(plan, keys=[plan.keys[0]] * (IN_PROCESS_MAX + 1))
    assert not runs_in_process(-1, many)  # a plan worth the start-up
    big = dataclasses.replace(plan, file_stats=np.array([[IN_PROCESS_MAX_BYTES, 0], [1, 0]]))
    assert not runs_in_process(-1, big)  # few files, but large ones
    assert not runs_in_process(-1, dataclasses.replace(plan, root="https://host/photos"))  # fsspec threads ran here
    with joblib.parallel_config(backend="threading"):  # another backend (--dask-scheduler sets one)
        assert not runs_in_process(-1, plan)


def test_in_process_uses_one_thread_while_the_blocks_run() -> None:
    before = cv2.getNumThreads()
    with in_process(True):
        assert cv2.getNumThreads() == 1
    assert cv2.getNumThreads() == before
    with in_process(False):
        assert cv2.getNumThreads() == before


def test_workers_with_a_large_share_resize_with_torch_and_give_the_same_bytes(imagenet_tree, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """Above TORCH_RESIZE_FROM samples a worker, fresh workers import torch for its faster kernel: same bytes.
    A worker reused from a build without torch keeps numpy's resize (no import mid-build: see _init_worker)."""
    from joblib.externals.loky import get_reusable_executor

    import cachebuild.builder.pipeline as pipeline

    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    torch_in = {}
    hashes = {}
    for name, threshold in (("numpy", 10**9), ("torch", 1), ("reused", 1)):
        get_reusable_executor().shutdown(wait=True)  # workers of earlier builds (and tests): start from new ones
        if name == "reused":  # ... which a build without torch starts, and the next build reuses
            monkeypatch.setattr(pipeline, "TORCH_RESIZE_FROM", 10**9)
            build(plan, tmp_path / "warm", BuildOptions(size=24, block_size=4, jobs=2, workers="processes"))
        monkeypatch.setattr(pipeline, "TORCH_RESIZE_FROM", threshold)
        log = tmp_path / f"{name}.log"
        done = build(dataclasses.replace(plan, reader=_PidReader(plan.reader, str(log))), tmp_path / name,
                     BuildOptions(size=24, block_size=4, jobs=2, workers="processes"))
        hashes[name] = [s.digest for s in read_manifest(done.path).shards]
        torch_in[name] = {line.split()[1] for line in log.read_text().splitlines()}
    get_reusable_executor().shutdown(wait=True)
    assert torch_in["numpy"] == {"0"} and torch_in["reused"] == {"0"}
    # torch is imported at worker start, so it is there from the first file each worker reads
    assert torch_in["torch"] == {"1"}
    assert hashes["torch"] == hashes["numpy"] == hashes["reused"] and len(hashes["numpy"]) > 1



def test_the_build_parent_starts_its_workers_without_importing_opencv() -> None:
    """The parent plans, pickles blocks and writes the manifest: it needs no decoder before its workers run,
    and every module it imports on the way sat on the whole build's critical path (issue 36). (It imports
    OpenCV at the very end, for the manifest's tool versions.)"""
    import subprocess

    code = ("import sys\n"
            "import cachebuild.cli, cachebuild.cli_build, cachebuild.builder.pipeline, cachebuild.sources.folder\n"
            "import cachebuild.sources.imagenet, cachebuild.storage.kinds.npy\n"
            "from cachebuild.builder.sample import geometry, probe\n"
            "print(sorted(m for m in ('cv2', 'simplejpeg', 'torch', 'scipy') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
    r = subprocess.run([sys.executable, "-c", "import sys; import cachebuild.builder.sample.decode; "
                        "print('cv2' in sys.modules)"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.stdout.strip() == "True", r.stderr[-2000:]  # the probe above would see one
