"""What a user does with a cache at a URL, each checked against the local copy: the operations that the
fault tests (tests/test_remote_faults.py, tests/reliability/test_remote_fault_matrix.py) run through the
fault proxy (tests/fault_proxy.py).

Each operation either completes with bytes equal to the local cache (a shuffled epoch through a DataLoader
with 2 workers: every sample where the sampler put it, every pixel its own; a pull: every file equal; a
push: every object equal) or raises; and it must end within ``limit_s`` seconds (never a hang).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from torch.utils.data import DataLoader

from cachebuild.cli import main
from cachebuild.share.pull import pull
from cachebuild.share.push import push
from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import decode_index

__all__ = ["FAULT_ENV", "Served", "cache_files", "run_op"]

# A stalled answer is given up after 1 s; 20 tries or 60 s per call (the defaults are 10 and 120 s).
FAULT_ENV = {"CACHEBUILD_HTTP_TIMEOUT": "1", "CACHEBUILD_RETRIES": "20", "CACHEBUILD_RETRY_BUDGET": "60"}


@dataclass
class Served:
    """A local cache and where the fault proxy serves it."""

    root: Path  # the local cache
    url: str  # the same cache through the proxy
    images: np.ndarray
    parent_url: str  # the folder holding it (what `ls` lists)
    push_url: str = ""  # where `push` sends the local cache (through the proxy), on a writable store
    read_back: Callable[[str], bytes] | None = None  # a pushed file's bytes, read around the proxy


def cache_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def epoch(s: Served, tmp: Path, block_cache: bool) -> None:
    ds = CachedImageDataset(s.url, DatasetOptions(local_cache=tmp / "blocks" if block_cache else None))
    sampler = CacheSampler(ds, shuffle=True, seed=7)
    dl = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=collate_batch, timeout=300,
                    persistent_workers=block_cache)
    for e in range(2 if block_cache else 1):  # with a block cache: a cold epoch, then a warm one
        sampler.set_epoch(e)
        order = np.fromiter(iter(sampler), dtype=np.int64)
        got = np.concatenate([x.numpy() for x, _ in dl])
        assert np.array_equal(decode_index(got), order), "samples out of the sampler's order"
        assert np.array_equal(got, s.images[order]), "a wrong pixel"


def pull_all(s: Served, tmp: Path) -> None:
    dest = tmp / "pulled"
    pull(s.url, dest, progress=False)
    want, got = cache_files(s.root), cache_files(dest)
    assert set(want) <= set(got), f"files missing after pull: {sorted(set(want) - set(got))}"
    bad = [n for n in want if got[n] != want[n]]
    assert not bad, f"pulled files differ from the local cache: {bad}"


def push_all(s: Served, tmp: Path) -> None:
    assert s.read_back is not None and s.push_url, "push needs a writable store"
    push(s.root, s.push_url, force=True, progress=False)
    bad = [n for n, data in cache_files(s.root).items() if s.read_back(n) != data]
    assert not bad, f"pushed objects differ from the local cache: {bad}"


def _cli(*args: str) -> str:
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def ls(s: Served, tmp: Path) -> None:
    out = _cli("ls", s.parent_url)
    rows = [line.split() for line in out.splitlines()[1:]]
    assert ["c", str(len(s.images))] in [[r[0], r[5]] for r in rows if len(r) > 5], out


def info(s: Served, tmp: Path) -> None:
    out = _cli("info", s.url)
    assert f"{len(s.images)} samples" in out, out


def verify(s: Served, tmp: Path) -> None:
    out = _cli("verify", s.url)
    assert "ok" in out, out


OPS: dict[str, Callable[[Served, Path], None]] = {
    "epoch": lambda s, t: epoch(s, t, False),
    "epoch+block cache": lambda s, t: epoch(s, t, True),
    "pull": pull_all,
    "push": push_all,
    "ls": ls,
    "info": info,
    "verify": verify,
}


def run_op(op: str, s: Served, tmp: Path, limit_s: float = 240) -> float:
    """Run ``op``; returns its seconds, and fails if it took more than ``limit_s`` (a hang)."""
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    OPS[op](s, tmp)
    took = time.perf_counter() - t0
    assert took < limit_s, f"{op} took {took:.0f} s (over {limit_s:.0f} s)"
    return took


def set_fault_env(monkeypatch: Any) -> None:
    for k, v in FAULT_ENV.items():
        monkeypatch.setenv(k, v)
    assert os.environ["CACHEBUILD_HTTP_TIMEOUT"] == "1"
