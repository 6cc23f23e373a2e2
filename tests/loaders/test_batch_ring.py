"""Batch ring (loaders.batch_ring): DataLoader batches through reused shared-memory slots are exact, slots
are reused, kept batches are never overwritten, and the main process's registry does not grow."""

from __future__ import annotations

import gc
import io
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loaders import batch_ring
from loaders.batch_ring import InlineTensor, ProcessRing, SlotTensor, WorkerRing, drop_dead_rings, ring_stats
from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import make_cache

STORAGES = [("npy", "none"), ("zarr", "none"), ("zarr", "zstd")]  # zstd: gathered through the zarr API


@pytest.fixture(autouse=True)
def _no_dead_rings():
    gc.collect()  # loaders of earlier tests: their workers exit, their rings are dropped below
    drop_dead_rings()


@pytest.fixture(scope="module", params=STORAGES, ids=lambda p: "-".join(p))
def cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    storage, compression = request.param
    root = tmp_path_factory.mktemp("ring") / "c"
    return make_cache(root, n=203, storage=storage, shard_size=16, compression=compression)


def _delta(before: dict[str, int]) -> dict[str, int]:
    after = ring_stats()
    return {k: after[k] - before[k] for k in after}


def _loader(ds: CachedImageDataset, sampler: CacheSampler, **kw) -> DataLoader:
    return DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=collate_batch, **kw)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_batches_equal_cache_over_epochs(cache, persistent: bool) -> None:
    root, images, labels = cache
    ds = CachedImageDataset(root)
    sampler = CacheSampler(ds, shuffle=True, seed=5)
    dl = _loader(ds, sampler, persistent_workers=persistent)
    before = ring_stats()
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = sampler.rank_indices()
        got = [(x.clone(), y.clone()) for x, y in dl]  # clones: the slots are free for reuse at once
        x, y = torch.cat([g[0] for g in got]).numpy(), torch.cat([g[1] for g in got]).numpy()
        assert x.tobytes() == images[order].tobytes() and np.array_equal(y, labels[order])
        assert all(g[1].dtype == torch.int64 and type(g[1]) is torch.Tensor for g in got)
        d = _delta(before)  # one ring per live worker, none left from past epochs; no fallbacks
        assert d["rings"] == 2 and d["slot_batches"] == 26 * (epoch + 1 if persistent else 1) and d["fallbacks"] == 0
    d = _delta(before)
    if persistent:  # the same two rings served all 3 epochs of 26 batches
        assert d == {"rings": 2, "slots": 10, "views": 78, "slot_batches": 78, "fallbacks": 0}


@pytest.mark.parametrize("in_memory", [False, True], ids=["mapped", "in-memory"])
def test_file_system_sharing_strategy(tmp_path: Path, in_memory: bool) -> None:
    # Users set it against "too many open files"; shared memory is then a named /dev/shm file.
    root, images, _ = make_cache(tmp_path / "c", n=120)
    saved = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ds = CachedImageDataset(root, DatasetOptions(in_memory=in_memory))
        sampler = CacheSampler(ds, shuffle=True, seed=3)
        before = ring_stats()
        got = [x.clone() for x, _ in _loader(ds, sampler, multiprocessing_context="fork")]
    finally:
        torch.multiprocessing.set_sharing_strategy(saved)
    assert torch.cat(got).numpy().tobytes() == images[sampler.rank_indices()].tobytes()
    d = _delta(before)
    assert d["rings"] == 2 and d["slot_batches"] == 15 and d["fallbacks"] == 0


def test_slots_reused_and_rings_bounded(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=400, shard_size=64)
    ds = CachedImageDataset(root, DatasetOptions(ring_slots=4))
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=collate_batch,
                    persistent_workers=True)
    before = ring_stats()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        xs = []
        for x, _y in dl:
            assert not x.is_shared()  # a view of a ring slot, not a freshly shared tensor
            xs.append(x.clone())
        assert torch.cat(xs).numpy().tobytes() == images[sampler.rank_indices()].tobytes()
    d = _delta(before)
    # 200 batches through 8 slots and 2 rings: every slot was reused ~25 times, nothing fell back.
    assert d == {"rings": 2, "slots": 8, "views": 200, "slot_batches": 200, "fallbacks": 0}


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_kept_batches_never_overwritten(tmp_path: Path, persistent: bool) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=160)
    ds = CachedImageDataset(root, DatasetOptions(ring_slots=3))
    sampler = CacheSampler(ds, shuffle=True, seed=1)
    dl = _loader(ds, sampler, persistent_workers=persistent)
    before = ring_stats()
    kept, orders = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        orders.append(sampler.rank_indices())
        kept.append([x for x, _ in dl])  # every batch stays alive: the ring runs out, batches fall back
    for order, xs in zip(orders, kept, strict=True):
        assert torch.cat(xs).numpy().tobytes() == images[order].tobytes()
    if persistent:
        d = _delta(before)
        assert d["slot_batches"] == 6 and d["fallbacks"] == 40 - 6 and d["rings"] == 2
    del kept, xs
    gc.collect()
    if persistent:  # dropping the kept batches releases the slots: the next epoch uses the ring again
        b0 = ring_stats()
        sampler.set_epoch(2)
        assert torch.cat([x.clone() for x, _ in dl]).numpy().tobytes() == images[sampler.rank_indices()].tobytes()
        assert _delta(b0)["slot_batches"] == 20


def test_no_registry_growth_across_epochs(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=64)
    ds = CachedImageDataset(root)
    sampler = CacheSampler(ds, shuffle=True, seed=2)
    dl = _loader(ds, sampler, persistent_workers=False)
    base = ring_stats()["rings"]
    for epoch in range(5):
        sampler.set_epoch(epoch)
        assert torch.cat([x for x, _ in dl]).numpy().tobytes() == images[sampler.rank_indices()].tobytes()
        assert ring_stats()["rings"] - base == 2  # this epoch's workers; the exited ones were dropped
    del dl
    assert drop_dead_rings() == 2 and ring_stats()["rings"] == base


def test_spawn_workers(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=64)
    ds = CachedImageDataset(root)
    sampler = CacheSampler(ds, shuffle=True, seed=4)
    dl = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=1, collate_fn=collate_batch,
                    multiprocessing_context="spawn", persistent_workers=True)  # 1 worker: spawn imports torch
    before = ring_stats()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert torch.cat([x.clone() for x, _ in dl]).numpy().tobytes() == images[sampler.rank_indices()].tobytes()
    assert _delta(before) == {"rings": 1, "slots": 5, "views": 16, "slot_batches": 16, "fallbacks": 0}


def test_in_memory_and_boxes_through_ring(tmp_path: Path) -> None:
    root, images, _ = make_cache(tmp_path / "c", n=40, boxes=True)
    ds = CachedImageDataset(root, DatasetOptions(in_memory=True, return_boxes=True))
    before = ring_stats()
    out = list(DataLoader(ds, batch_size=7, num_workers=2, collate_fn=collate_batch))
    assert np.array_equal(torch.cat([x for x, _, _ in out]).numpy(), images)
    assert np.array_equal(torch.cat([b for _, _, b in out]).numpy(), ds.boxes)
    assert _delta(before)["slot_batches"] == 6


def test_default_collate_and_custom_collate(tmp_path: Path) -> None:
    root, images, labels = make_cache(tmp_path / "c", n=48)
    ds = CachedImageDataset(root, DatasetOptions(ring_slots=2))
    before = ring_stats()
    # default_collate takes the whole batch as it is (loaders.collate): the slot is handed over.
    x = torch.cat([x.clone() for x, _ in DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)])
    assert np.array_equal(x.numpy(), images)
    d = _delta(before)  # every batch went over whole (in a slot, or a fresh one when both slots were busy)
    assert d["slot_batches"] + d["fallbacks"] == 6 and d["slot_batches"] >= 1
    before = ring_stats()
    # A collate_fn that returns a view of the slot *and* the slot itself: torch shares the view the
    # ordinary way (copying the slot out first), so nothing the main process receives can go stale.
    dl = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=lambda b: (b.images[1:3], b.images, b.labels))
    got = list(dl)
    for k, (part, whole, y) in enumerate(got):
        assert np.array_equal(whole.numpy(), images[8 * k : 8 * k + 8]) and np.array_equal(part, whole[1:3])
        assert np.array_equal(y.numpy(), labels[8 * k : 8 * k + 8])
    assert _delta(before)["slot_batches"] == 0  # this path handed no slot over


# ---------------------------------------------------------------- the hand-off itself, in one process


def _feed(obj) -> bytes:
    """ForkingPickler.dumps as the DataLoader result queue's feeder thread does it."""
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(bytes(ForkingPickler.dumps(obj))), name="QueueFeederThread")
    t.start()
    t.join()
    return out[0]


def test_handoff_release_and_ack() -> None:
    ring = WorkerRing(2, 4 * 5 * 3)
    a = ring.take((4, 5, 3))
    assert isinstance(a, SlotTensor)
    a.copy_(torch.arange(60, dtype=torch.uint8).reshape(4, 5, 3))
    first = _feed(a)
    del a
    gc.collect()
    assert ring.flags.tolist() == [1, 0] and ring.local == [False, False]  # sent: only the main side holds it
    x = pickle.loads(first)
    assert type(x) is torch.Tensor and x.flatten().tolist() == list(range(60)) and ring.buf[batch_ring._ACK] == 1
    b = ring.take((2, 5, 3))
    b.fill_(7)
    second = _feed(b)
    assert len(second) < len(first)  # acknowledged: the storage travels no more
    y = pickle.loads(second)
    assert ring.take((1, 5, 3)) is None  # both slots busy; the wait ends in a fallback
    v = x[1:].permute(0, 2, 1)  # a view keeps the slot
    del x
    gc.collect()
    assert ring.flags.tolist() == [1, 1]
    del v
    gc.collect()
    assert ring.flags.tolist() == [0, 1]  # the last view gone: released
    assert ring.take((1, 5, 3)) is not None and y.unique().tolist() == [7]
    del y
    batch_ring._registry.pop(ring.key)  # this process's own ring: not dropped as dead


def test_other_pickling_copies_the_slot() -> None:
    ring = WorkerRing(1, 6)
    a = ring.take((2, 3))
    a.copy_(torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8))
    assert torch.equal(pickle.loads(pickle.dumps(a)), a)  # plain pickle: by value
    buf = io.BytesIO()
    torch.save(a, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), a)
    c = pickle.loads(ForkingPickler.dumps(a))  # multiprocessing outside the feeder: torch's own sharing
    assert torch.equal(c, a) and c.data_ptr() != ring.address(0)
    gc.collect()
    assert ring.flags.tolist() == [0] and ring.local == [False]  # torch moved `a` out of the slot
    lab = torch.arange(5).as_subclass(InlineTensor)
    assert torch.equal(pickle.loads(ForkingPickler.dumps(lab)), lab) and len(ForkingPickler.dumps(lab)) < 400


def test_ring_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _, _ = make_cache(tmp_path / "c", n=20)
    ds = CachedImageDataset(root)

    def refuse(*a, **k):
        raise RuntimeError("unable to allocate shared memory")

    monkeypatch.setattr(batch_ring.WorkerRing, "__init__", refuse)
    ring = ProcessRing()
    assert ring.take(5, (4, 8, 6, 3)) is None and ring.failed
    assert ring.take(5, (4, 8, 6, 3)) is None  # not asked again in this process
    # A forked worker (which inherits the patch) is refused too and still delivers every batch, fresh ones.
    rings = ring_stats()["rings"]
    dl = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=collate_batch, multiprocessing_context="fork")
    assert torch.equal(torch.cat([x for x, _ in dl]), torch.from_numpy(ds.gather(np.arange(20))))
    assert ring_stats()["rings"] == rings  # no batch came through a ring
    with pytest.raises(ValueError, match="ring_slots"):
        CachedImageDataset(root, DatasetOptions(ring_slots=-1))


def test_threads_taking_slots_at_once_never_share_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads of one worker gathering batches at once: each batch gets a slot of its own. A pause between
    finding a free slot and marking it (as a thread switch there would make) gave 4 threads one slot."""
    ring = WorkerRing(4, 8)
    found = WorkerRing._free_slot

    def slow_to_mark(self: WorkerRing) -> int:
        s = found(self)
        time.sleep(0.02)
        return s

    monkeypatch.setattr(WorkerRing, "_free_slot", slow_to_mark)
    got: list[SlotTensor | None] = []
    threads = [threading.Thread(target=lambda: got.append(ring.take((8,)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(x.__dict__["_slot"] for x in got if x is not None) == [0, 1, 2, 3]
