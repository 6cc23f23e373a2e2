"""Rows that needed the storage layer's guarantees (readers pinned to the cache they opened, a codec for
names that are not UTF-8):

- readers under load: 8 reader processes on one cache while ``--force`` rebuilds it with other
  parameters; every batch whole and from the cache each reader opened, or a named error; none mixed.
- file names that are not valid UTF-8, end to end (``cachebuild/format/manifest.py::encode_path`` is the codec;
  ``save_paths``/``load_paths``, the block records' and the manifest's failure paths must use it).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.samples.broken import write_truncated_jpeg
from cachebuild.sources.folder import folder_plan
from cachebuild.storage.cache import open_cache, read_manifest, write_cache
from tests.reliability.helpers import read_under_load

READERS = 8
N = 96


def _images(generation: int, side: int) -> np.ndarray:
    """Sample i of a generation: channel 0 of pixel (0, 0) = i, channel 1 = the generation, the rest a
    pattern of both, so a sample from another cache, index or generation, or a torn one, shows."""
    i = np.arange(N)[:, None, None, None]
    img = ((i * 7 + generation * 31 + np.arange(side)[:, None, None] * 3 + np.arange(side)[:, None] * 5
            + np.arange(3)) % 251).astype(np.uint8)
    img = np.broadcast_to(img, (N, side, side, 3)).copy()
    img[:, 0, 0, 0] = np.arange(N)
    img[:, 0, 0, 1] = 0 if generation == 0 else 1 + (generation - 1) % 255  # never 0 again: the readers' cache
    return img


def _reader(path: str, seconds: float, ready: multiprocessing.Queue, go: Any, result: multiprocessing.Queue) -> None:
    """Open once and read a batch (say so), wait for the first rebuild, then read random batches for
    ``seconds``, every 20th batch from a fresh copy of the dataset (what a DataLoader worker of the next
    epoch holds: the opened manifest, files mapped anew): count whole and mixed batches, named errors."""
    from loaders.dataset import CachedImageDataset

    ds = CachedImageDataset(path)
    result.put(read_under_load(ds, _images(0, ds.shape[0]), seconds, ready, go))


@pytest.mark.slow  # ~1 minute a storage: `make reliability`, not `make test`
@pytest.mark.parametrize("storage", ["npy", "zarr"])
def test_readers_under_load(tmp_path: Path, ledger, storage: str) -> None:
    cache = tmp_path / "c"
    write_cache(cache, _images(0, 24), np.arange(N) % 5, [f"k{i}" for i in range(5)], storage=storage,
                shard_size=16, replace=True)
    ctx = multiprocessing.get_context("spawn")
    ready: multiprocessing.Queue = ctx.Queue()
    result: multiprocessing.Queue = ctx.Queue()
    go = ctx.Event()
    procs = [ctx.Process(target=_reader, args=(str(cache), 8.0, ready, go, result)) for _ in range(READERS)]
    for p in procs:
        p.start()
    assert all(ready.get(timeout=120) for _ in procs)  # every reader has opened the cache and read it right
    generation = 1
    t_end = time.time() + 8
    while time.time() < t_end:  # --force rebuilds with other parameters (another size), again and again
        side = 16 if generation % 2 else 32
        write_cache(cache, _images(generation, side), np.arange(N) % 5, [f"k{i}" for i in range(5)],
                    storage=storage, shard_size=8 + 8 * (generation % 3), replace=True)
        generation += 1
        go.set()
    totals = [result.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    row = f"readers under load ({storage}): 8 readers while --force rebuilds"
    lost = [f"{storage}: {whole} whole, {mixed} mixed, {named} named errors ({error[:80]})"
            for whole, mixed, named, error in totals if mixed or not whole + named]
    ledger.add(row, len(totals), len(totals) - len(lost), len(lost), "; ".join(lost[:2]),
               detail=f"{sum(t[0] for t in totals)} whole batches, {sum(t[2] for t in totals)} named "
                      f"errors, {sum(t[1] for t in totals)} mixed over {generation - 1} rebuilds")
    assert lost == []


def test_non_utf8_file_names_round_trip(photo_tree: Path, tmp_path: Path, ledger) -> None:
    src = tmp_path / "src"
    shutil.copytree(photo_tree, src)
    cls = sorted(p for p in src.iterdir() if p.is_dir())[0]
    good = os.fsdecode(b"bad_\xff\xfe_name.JPEG")
    shutil.copy(sorted(cls.iterdir())[0], cls / good)
    broken = write_truncated_jpeg(cls, os.fsdecode(b"cut_\xe9t\xe9.JPEG"))
    with ledger.trial("file names that are not UTF-8: built, stored losslessly"):
        plan = folder_plan(src)
        res = build(plan, tmp_path / "c", BuildOptions(size=16, jobs=2, block_size=4))
        assert res.count == 17 and res.failures == 1
        paths = open_cache(tmp_path / "c").paths()
        assert f"{cls.name}/{good}" in paths
        assert os.fsencode(paths[paths.index(f"{cls.name}/{good}")]).endswith(b"bad_\xff\xfe_name.JPEG")
        assert (src / paths[paths.index(f"{cls.name}/{good}")]).is_file()
        assert [os.fsencode(f.path) for f in read_manifest(tmp_path / "c").failures] == \
            [os.fsencode(f"{cls.name}/{broken.name}")]
        again = build(plan, tmp_path / "c", BuildOptions(size=16, jobs=2, block_size=4))
        assert again.status == "up to date"
