"""A local CPU build's blocks in threads of the building process or in worker processes: the same bytes, and
``auto`` picks threads only where the files are photo-sized (issue 36)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import cv2
import numpy as np
import pytest

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.builder.worker_kind import THREADS_FROM_BYTES, THREADS_MAX_FILES, use_threads
from cachebuild.errors import OptionError
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import read_manifest
from tests.cachebuild.builder.test_small_plan import _PidReader, _pids


def test_threads_and_processes_give_the_same_bytes_and_threads_start_no_process(imagenet_tree,
                                                                                tmp_path: Path) -> None:
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    threads_before = cv2.getNumThreads()
    built = {}
    for workers in ("threads", "processes"):
        log = tmp_path / f"{workers}.log"
        built[workers] = build(dataclasses.replace(plan, reader=_PidReader(plan.reader, str(log))),
                               tmp_path / workers, BuildOptions(size=40, block_size=4, jobs=2, workers=workers))
        pids = _pids(log)
        assert (pids == {os.getpid()}) == (workers == "threads"), pids  # threads read every file here
    assert cv2.getNumThreads() == threads_before  # one OpenCV thread a block thread, then the caller's again
    a, b = (read_manifest(built[w].path) for w in ("threads", "processes"))
    assert len(a.shards) > 2 and [s.digest for s in a.shards] == [s.digest for s in b.shards]
    assert a.failures == b.failures and a.count == b.count
    for name in ("labels", "sizes"):
        assert np.array_equal(np.load(built["threads"].path / a.arrays[name].file),
                              np.load(built["processes"].path / b.arrays[name].file))


def test_auto_takes_threads_for_photo_sized_files_only(imagenet_tree) -> None:
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    assert plan.file_stats is not None
    mean = int(plan.file_stats[:, 0].clip(min=0).sum()) // len(plan)
    assert mean >= THREADS_FROM_BYTES  # the fixture's photos are ImageNet-sized
    common = {"pool": True, "torch_resize": False, "update": False}
    assert use_threads("auto", plan, **common)
    tiny = dataclasses.replace(plan, file_stats=np.column_stack([np.full(len(plan), 1500), plan.file_stats[:, 1]]))
    assert not use_threads("auto", tiny, **common)  # 40-80 px crops: the per-file Python holds the GIL
    assert use_threads("threads", tiny, **common)  # asked for
    assert not use_threads("processes", plan, **common)
    many = dataclasses.replace(plan, keys=[plan.keys[0]] * (THREADS_MAX_FILES + 1),
                               file_stats=np.repeat(plan.file_stats[:1], THREADS_MAX_FILES + 1, axis=0))
    assert not use_threads("auto", many, **common)  # a long build: the warm processes' 5% outweighs start-up
    assert use_threads("threads", many, **common)
    assert not use_threads("auto", plan, **{**common, "pool": False})  # in-process, Dask or a GPU build
    assert not use_threads("threads", plan, **{**common, "pool": False})
    assert not use_threads("auto", plan, **{**common, "torch_resize": True})  # workers that import torch
    assert not use_threads("auto", plan, **{**common, "update": True})
    assert not use_threads("threads", plan, **common, threaded_sinks=False)  # zarr
    assert not use_threads("auto", dataclasses.replace(plan, root="https://host/photos"), **common)
    assert not use_threads("auto", dataclasses.replace(plan, file_stats=None), **common)


def test_a_zarr_build_keeps_its_processes_even_when_threads_are_asked_for(imagenet_tree, tmp_path: Path) -> None:
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    log = tmp_path / "zarr.log"
    build(dataclasses.replace(plan, reader=_PidReader(plan.reader, str(log))), tmp_path / "z",
          BuildOptions(size=32, block_size=8, chunk_size=8, jobs=2, storage="zarr", workers="threads"))
    assert os.getpid() not in _pids(log)


def test_workers_is_checked() -> None:
    with pytest.raises(OptionError, match="workers"):
        BuildOptions(size=32, workers="fibers")
