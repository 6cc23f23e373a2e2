"""Reader-side steps of the scale harness, each run in its own process by ``bench.scale.steps``.

* ``open``: ``CachedImageDataset(cache)``: its time and the process's RSS before any pixel is touched;
* ``first_batch``: a shuffled ``DataLoader(num_workers=2)`` (``spawn`` or ``fork``) over the cache and over a
  plain in-memory dataset of the same length and sample shape (:class:`PlainDataset`), each from the
  loader's creation to its first batch, and the RSS/PSS of each worker once it has served that batch;
* ``epoch``: one shuffled epoch through the same loader (``fork``), in img/s;
* ``sampler``: ``CacheSampler`` for world size 8: ``set_epoch`` and a full iteration of each rank.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["STEPS", "PlainDataset"]

BATCH = 256


class PlainDataset(Dataset):
    """``n`` samples of one in-memory uint8 image and label: a DataLoader's own cost with no storage behind it
    (its state is a few KB, whatever ``n``)."""

    def __init__(self, n: int, shape: tuple[int, int, int]) -> None:
        self.n = n
        self.image = torch.zeros(shape, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.image, int(i) % 1000


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _status_kb(pid: int | str, *fields: str) -> dict[str, int]:
    """Fields of /proc/<pid>/status in bytes: RssAnon is a process's own heap (what a copy of a side table
    grows); RssFile its mapped files (shared libraries, the cache's pages it has touched: shared, not copied)."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in fields:
                out[key.lower()] = int(line.split()[1]) * 1024
    return out


def _workers_memory() -> list[dict[str, int]]:
    """RSS, PSS, RssAnon and RssFile of each DataLoader worker (this process's children, less
    multiprocessing's resource tracker)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any("resource_tracker" in a for a in p.cmdline()):
                continue
            m = p.memory_full_info()
            out.append({"rss": m.rss, "pss": getattr(m, "pss", m.rss), **_status_kb(p.pid, "RssAnon", "RssFile")})
        except (psutil.Error, OSError):
            continue
    return out


def _open(cache: str) -> Any:
    from loaders import CachedImageDataset

    return CachedImageDataset(cache)


def step_open(args: dict[str, Any]) -> dict[str, Any]:
    from loaders import CachedImageDataset

    gc.collect()
    before, anon = _rss(), _status_kb("self", "RssAnon")["rssanon"]  # torch and loaders imported: ~700 MB
    t0 = time.perf_counter()
    ds = CachedImageDataset(args["cache"])
    seconds = time.perf_counter() - t0
    gc.collect()
    return {"seconds": seconds, "count": len(ds), "rss_before_open": before, "rss_open": _rss(),
            "rss_added": _rss() - before, "anon_added": _status_kb("self", "RssAnon")["rssanon"] - anon}


def _loader(ds: Dataset, context: str, seed: int = 0) -> DataLoader:
    from loaders import collate_batch

    g = torch.Generator().manual_seed(seed)
    collate = collate_batch if not isinstance(ds, PlainDataset) else None
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, multiprocessing_context=context,
                      generator=g, collate_fn=collate)


def _first_batch(ds: Dataset, context: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    it = iter(_loader(ds, context))
    batch = next(it)
    seconds = time.perf_counter() - t0
    time.sleep(0.2)  # both workers have started and served their first prefetched batches
    workers = _workers_memory()
    assert len(batch[0]) == BATCH
    del it
    return {"seconds": seconds, "workers": workers, "worker_rss_max": max((w["rss"] for w in workers), default=0),
            "worker_anon_max": max((w.get("rssanon", 0) for w in workers), default=0)}


def step_first_batch(args: dict[str, Any]) -> dict[str, Any]:
    """Rounds of (cache, plain), alternating which goes first (a loaded box drifts): medians."""
    ds = _open(args["cache"])
    rss_reader = _rss()
    plain = PlainDataset(len(ds), ds.shape)
    runs: dict[str, list[dict[str, Any]]] = {"cache": [], "plain": []}
    for r in range(int(args.get("rounds", 3))):
        for what in (("cache", "plain") if r % 2 == 0 else ("plain", "cache")):
            runs[what].append(_first_batch(ds if what == "cache" else plain, args["context"]))
    med = {k: sorted(v, key=lambda x: x["seconds"])[len(v) // 2] for k, v in runs.items()}
    return {"seconds": med["cache"]["seconds"], "context": args["context"], "cache": med["cache"],
            "plain": med["plain"], "over_plain": med["cache"]["seconds"] - med["plain"]["seconds"],
            "rounds": {k: [x["seconds"] for x in v] for k, v in runs.items()}, "rss_reader": rss_reader}


def step_epoch(args: dict[str, Any]) -> dict[str, Any]:
    ds = _open(args["cache"])
    t0 = time.perf_counter()
    seen, t_first = 0, None
    for _images, labels in _loader(ds, "fork", seed=1):
        seen += len(labels)
        if t_first is None:
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    assert seen == len(ds), (seen, len(ds))
    steady = (seen - BATCH) / (t1 - t_first) if t_first is not None and t1 > t_first else 0.0
    return {"seconds": t1 - t0, "count": seen, "img_per_s": seen / (t1 - t0), "img_per_s_after_first": steady}


def step_sampler(args: dict[str, Any]) -> dict[str, Any]:
    from loaders import CacheSampler

    ds = _open(args["cache"])
    world = int(args.get("world", 8))
    t0 = time.perf_counter()
    total, per_rank = 0, []
    for rank in range(world):
        t = time.perf_counter()
        s = CacheSampler(ds, num_replicas=world, rank=rank, seed=0)
        s.set_epoch(3)
        n = sum(1 for _ in s)
        per_rank.append(time.perf_counter() - t)
        total += n
    seconds = time.perf_counter() - t0
    assert total >= len(ds)
    return {"seconds": seconds, "world": world, "rank_seconds_max": max(per_rank), "indices": total,
            "per_rank_mean": float(np.mean(per_rank))}


STEPS = {"open": step_open, "first_batch": step_first_batch, "epoch": step_epoch, "sampler": step_sampler}
