"""Readers of a cache at a URL while ``push --force`` replaces it, again and again (moto's S3 on 127.0.0.1, a
plain bucket and a versioned one, and the writable HTTP range server of tests/servers.py, whose ETags pin).

Every generation has the same layout (same file names, same sizes), only other pixels: the case where a
reader that is not pinned to the file versions it opened reads the new cache's bytes at its old offsets.
Each reader counts batches that are whole (every sample equal to the generation it opened) and named
errors (it then opens the cache again, as a restarted job does); a batch of any other pixels is *mixed*,
and there must be none. Readers pause now and then (a long training step), so that some sleep through a
whole push and read again after it: without the version pinning those reads are mixed (measured with
``CACHEBUILD_PIN_VERSIONS=0``).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachebuild.share.push import push
from cachebuild.storage.cache import write_cache
from tests.reliability.helpers import read_under_load

READERS = 4
N = 96
SIDE = 24
GENERATIONS = 4


def _images(generation: int) -> np.ndarray:
    """Sample i of a generation: pixel (0, 0) holds i and the generation, the rest a pattern of both."""
    i = np.arange(N)[:, None, None, None]
    img = ((i * 7 + generation * 31 + np.arange(SIDE)[:, None, None] * 3 + np.arange(SIDE)[:, None] * 5
            + np.arange(3)) % 251).astype(np.uint8)
    img = np.broadcast_to(img, (N, SIDE, SIDE, 3)).copy()
    img[:, 0, 0, 0] = np.arange(N)
    img[:, 0, 0, 1] = generation
    return img


def _deploy(src: Path, dest: Path) -> None:
    """``src``'s files over ``dest``'s, each one whole at once (a copy renamed into place), the manifest last."""
    dest.mkdir(parents=True, exist_ok=True)
    files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.name == "manifest.json")
    for f in files:
        target = dest / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target.with_name(target.name + ".deploying"))
        os.replace(target.with_name(target.name + ".deploying"), target)


def _reader(url: str, seconds: float, ready: Any, go: Any, result: Any) -> None:
    from loaders.dataset import CachedImageDataset

    def open_() -> tuple[Any, np.ndarray]:
        ds = CachedImageDataset(url)
        return ds, _images(int(ds.manifest.dataset.removeprefix("gen")))

    def why(got: np.ndarray, expected: np.ndarray) -> str:
        return (f"wrong pixels: generations {sorted(set(got[:, 0, 0, 1].tolist()))} in a batch of generation "
                f"{expected[0, 0, 0, 1]}")

    # pausing now and then (a long step), a reader can sleep through a whole push and read again after it
    result.put(read_under_load(*open_(), seconds, ready, go, reopen=open_, pause=0.8, why=why))


@pytest.mark.slow  # ~30 s: `make reliability`, not `make test`
@pytest.mark.parametrize("store", ["s3", "s3 versioned", "http"])
def test_url_readers_while_push_force_replaces_the_cache(tmp_path: Path, request, ledger, store: str) -> None:
    """Plain bucket, and an HTTP server with ETags (pinned by If-Match): readers get whole batches or a named
    error (then reopen). Versioned bucket: readers read the generation they opened to the end (its versions
    stay), so whole batches only."""
    versioned = store == "s3 versioned"
    replace = functools.partial(push, force=True, progress=False)
    if store == "http":  # HTTP has no DELETE for push --force: the site's files are replaced as a deploy does
        url = request.getfixturevalue("http_server")(tmp_path / "site").url_for("c")
        replace = lambda src, _url: _deploy(src, tmp_path / "site" / "c")  # noqa: E731
    else:
        s3 = request.getfixturevalue("s3")
        url = s3.url("team/c")
    if versioned:
        s3.fs.call_s3("put_bucket_versioning", Bucket=s3.name, VersioningConfiguration={"Status": "Enabled"})
    caches = []
    for g in range(GENERATIONS):
        root = tmp_path / f"gen{g}"
        write_cache(root, _images(g), np.arange(N) % 5, [f"k{i}" for i in range(5)], shard_size=16,
                    dataset=f"gen{g}", replace=True)
        caches.append(root)
    if store == "http":
        _deploy(caches[0], tmp_path / "site" / "c")
    else:
        push(caches[0], url, progress=False)
    ctx = multiprocessing.get_context("spawn")  # the children inherit the loopback S3 environment
    ready, result, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_reader, args=(url, 12.0, ready, go, result)) for _ in range(READERS)]
    for p in procs:
        p.start()
    assert all(ready.get(timeout=120) for _ in procs)
    go.set()
    pushes = 0
    t_end = time.time() + 12
    while time.time() < t_end:  # a pause between pushes, so that the reopened readers read a while
        replace(caches[1 + pushes % (GENERATIONS - 1)], url)
        pushes += 1
        time.sleep(1.5)
    totals = [result.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    kind = {"s3": "S3", "s3 versioned": "S3 with versioning", "http": "HTTP with ETags"}[store]
    how = "its files are replaced (a deploy)" if store == "http" else "push --force replaces it"
    row = f"readers of a URL ({kind}) while {how}"
    lost = [f"{whole} whole, {mixed} mixed, {named} named ({error[:80]})"
            for whole, mixed, named, error in totals if mixed or not whole + named]
    ledger.add(row, len(totals), len(totals) - len(lost), len(lost), "; ".join(lost[:2]),
               detail=f"{sum(t[0] for t in totals)} whole batches, {sum(t[2] for t in totals)} named errors "
                      f"(then reopened), {sum(t[1] for t in totals)} mixed over {pushes} pushes")
    # Liveness, not speed (a loaded box pushes and reads slower): each reader read whole batches, and the
    # cache was replaced under them more than once.
    assert lost == [] and pushes >= 2 and all(t[0] >= 3 for t in totals), (pushes, totals)
    if versioned:  # never stopped: the opened generation's versions serve every read
        assert not any(t[2] for t in totals), totals
    else:
        assert all(t[2] for t in totals), totals  # every reader read across a replacement and was told
