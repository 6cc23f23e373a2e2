"""CacheSampler: coverage across ranks, determinism, the windowed order's locality, resuming mid-epoch."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from loaders.dataset import CachedImageDataset, collate_batch
from loaders.sampler import CacheSampler
from tests.loaders_fixtures import decode_index, make_cache

MODES = [dict(shuffle=True), dict(shuffle=False), dict(shuffle=True, shard_window=3)]
IDS = ["shuffle", "sequential", "windowed"]


class Chunks:
    """``n`` samples stored in files of ``size`` (the last one shorter), as a dataset's ``file_bounds`` says."""

    def __init__(self, n: int, size: int = 4) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def file_bounds(self) -> np.ndarray:
        return np.r_[np.arange(0, self.n, self.size), self.n].astype(np.int64)


def _src(n: int, mode: dict) -> object:
    return Chunks(n) if "shard_window" in mode else range(n)


def _epoch(n: int, world: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for r in range(world):
        s = CacheSampler(_src(n, kw), num_replicas=world, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize(("n", "world"), [(10, 1), (10, 2), (11, 2), (10, 3), (13, 3), (2, 3)])
def test_every_sample_once_padding(mode: dict, n: int, world: int) -> None:
    per_rank = _epoch(n, world, **mode)
    num = -(-n // world)
    assert all(len(r) == num for r in per_rank)  # equal counts
    counts = Counter(itertools.chain(*per_rank))
    assert set(counts) == set(range(n))  # every sample seen
    extra = num * world - n  # padding repeats the first `extra` indices of the epoch's order
    order = CacheSampler(_src(n, mode), **mode).global_order(0)
    assert sum(counts.values()) == n + extra
    assert {i for i, c in counts.items() if c > 1} == set(np.tile(order, 2)[:extra].tolist())


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize(("n", "world"), [(10, 1), (11, 2), (10, 3), (13, 3)])
def test_every_sample_at_most_once_drop_last(mode: dict, n: int, world: int) -> None:
    per_rank = _epoch(n, world, drop_last=True, **mode)
    assert all(len(r) == n // world for r in per_rank)
    seen = list(itertools.chain(*per_rank))
    assert len(seen) == len(set(seen)) == n - n % world  # no repeats; the n mod R tail is dropped


def test_matches_distributed_sampler() -> None:
    for world, rank, drop in itertools.product([1, 2, 3], [0, 1, 2], [False, True]):
        if rank >= world:
            continue
        ours = CacheSampler(range(13), num_replicas=world, rank=rank, seed=5, drop_last=drop)
        ref = DistributedSampler(range(13), num_replicas=world, rank=rank, seed=5, drop_last=drop)
        for e in (0, 1):
            ours.set_epoch(e)
            ref.set_epoch(e)
            assert list(ours) == list(ref) and len(ours) == len(ref)


@pytest.mark.parametrize("mode", [MODES[0], MODES[2]], ids=["shuffle", "windowed"])
def test_deterministic_and_differs_between_epochs(mode: dict) -> None:
    a = _epoch(100, 2, epoch=0, seed=1, **mode)
    assert a == _epoch(100, 2, epoch=0, seed=1, **mode)
    assert a != _epoch(100, 2, epoch=1, seed=1, **mode)
    assert a != _epoch(100, 2, epoch=0, seed=2, **mode)


def test_windowed_order_is_local() -> None:
    s = CacheSampler(Chunks(1000, 10), shard_window=4, seed=0)
    order = s.global_order(0)
    assert sorted(order.tolist()) == list(range(1000))
    for w in range(0, 1000, 40):  # each window of 4 files x 10 samples touches exactly 4 files
        assert len(set((order[w : w + 40] // 10).tolist())) == 4
    assert not np.array_equal(order, np.arange(1000))


def test_a_zarr_caches_chunks_are_its_files(tmp_path) -> None:
    root, _, _ = make_cache(tmp_path / "z", n=40, storage="zarr", shard_size=8)
    ds = CachedImageDataset(root)
    assert ds.file_bounds().tolist() == [0, 8, 16, 24, 32, 40]  # the zarr chunks
    order = CacheSampler(ds, shard_window=1, seed=2).global_order(0)
    assert all(len(set((order[w : w + 8] // 8).tolist())) == 1 for w in range(0, 40, 8))


def test_the_previous_releases_chunked_order_is_named_as_shard_window() -> None:
    for old in ({"chunked": True}, {"chunk_size": 8}, {"window": 4}):
        with pytest.raises(TypeError, match="shard_window=W"):
            CacheSampler(range(10), **old)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunky'"):
        CacheSampler(range(10), chunky=True)
    old_state = {"epoch": 1, "seed": 0, "position": 3, "dataset_len": 10, "chunked": True, "chunk_size": 4}
    with pytest.raises(ValueError, match="chunked=True"):
        CacheSampler(range(10)).load_state_dict(old_state)
    s = CacheSampler(range(10))  # a state of the exact shuffle saved by the previous release resumes
    s.load_state_dict(old_state | {"chunked": False, "window": 16})
    assert (s.epoch, s.position) == (1, 3)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("consumed", [0, 3, 17, 24])
def test_resume_yields_rest_of_epoch(mode: dict, consumed: int) -> None:
    s = CacheSampler(_src(50, mode), num_replicas=2, rank=1, seed=7, **mode)
    s.set_epoch(2)
    full = list(s)
    s.advance(consumed)
    state = s.state_dict()
    assert state["epoch"] == 2 and state["seed"] == 7 and state["position"] == consumed
    t = CacheSampler(_src(50, mode), num_replicas=2, rank=0, seed=0, **mode)  # rank 0's state resumes rank 1
    t2 = CacheSampler(_src(50, mode), num_replicas=2, rank=1, seed=0, **mode)
    t2.load_state_dict(state)
    t2.set_epoch(2)  # the loop's usual call after resuming keeps the position
    assert list(t2) == full[consumed:] and len(t2) == 25 - consumed
    t.load_state_dict(state)
    assert len(list(t)) == 25 - consumed
    t2.set_epoch(3)
    assert t2.position == 0 and len(list(t2)) == 25


def test_resume_through_dataloader(tmp_path) -> None:
    root, _images, _ = make_cache(tmp_path / "c", n=45)
    ds = CachedImageDataset(root)
    s = CacheSampler(ds, seed=4)
    s.set_epoch(1)
    dl = DataLoader(ds, batch_size=4, sampler=s, collate_fn=collate_batch, num_workers=2)
    seen = []
    for step, (x, y) in enumerate(dl):
        seen.append(decode_index(x.numpy()))
        s.advance(len(y))
        if step == 4:
            state = s.state_dict()
            break
    s2 = CacheSampler(ds, seed=0)
    s2.load_state_dict(state)
    s2.set_epoch(1)
    rest = [decode_index(x.numpy()) for x, _ in DataLoader(ds, batch_size=4, sampler=s2, collate_fn=collate_batch)]
    assert np.concatenate(seen + rest).tolist() == s.rank_indices(1).tolist()


def test_epoch_replays_after_completion_and_bad_state() -> None:
    s = CacheSampler(range(9), seed=0)
    s.set_epoch(0)
    first = list(s)
    s.advance(9)
    assert list(s) == first and s.position == 0  # consumed epoch, set_epoch given: replayed, as DistributedSampler
    with pytest.raises(ValueError, match="dataset_len"):
        CacheSampler(range(10)).load_state_dict(s.state_dict() | {"position": 3})
    with pytest.raises(ValueError, match="position"):
        s.set_position(10)
    with pytest.raises(ValueError, match="rank"):
        CacheSampler(range(9), num_replicas=2, rank=2)


def test_uses_torch_distributed_world(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 2)
    s = CacheSampler(range(10))
    assert (s.num_replicas, s.rank, len(s)) == (3, 2, 4)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_resume_after_last_step_of_epoch_moves_on(mode: dict) -> None:
    # A checkpoint saved after the epoch's last step (the usual end-of-epoch save) holds position ==
    # num_samples: the resumed epoch has nothing left, so the loop goes on to the next one instead of
    # training the finished epoch a second time.
    s = CacheSampler(_src(21, mode), num_replicas=2, rank=0, seed=3, **mode)
    s.set_epoch(4)
    for _ in s:
        s.advance(1)
    state = s.state_dict()
    assert state["position"] == s.num_samples == 11
    t = CacheSampler(_src(21, mode), num_replicas=2, rank=0, **mode)
    t.load_state_dict(state)
    seen = {}
    for epoch in range(t.epoch, 6):  # the module docstring's typical loop
        t.set_epoch(epoch)
        assert len(t) == (0 if epoch == 4 else 11)
        seen[epoch] = list(t)
        for _ in seen[epoch]:
            t.advance(1)
    assert seen[4] == [] and seen[5] == s.rank_indices(5).tolist()
    # In one process, iterating a consumed epoch again without set_epoch still replays it.
    assert list(s) == s.rank_indices(4).tolist()


class Epochs:
    """A data source that records the epochs the sampler hands it (as a dataset that crops in its workers)."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_without_set_epoch_each_pass_is_the_next_epoch(mode: dict) -> None:
    # PyTorch's imagenet example calls set_epoch only under DDP: a port must not replay one order every epoch.
    s = CacheSampler(_src(50, mode), seed=0, **mode)
    passes = [list(s) for _ in range(3)]
    assert [s.rank_indices(e).tolist() for e in range(3)] == passes and s.epoch == 2
    if mode.get("shuffle"):
        assert passes[0] != passes[1] != passes[2]
    assert all(sorted(p) == list(range(50)) for p in passes)
    data = Epochs(20)
    t = CacheSampler(data, seed=0)
    it = iter(t)  # an iterator made and dropped unused (a DataLoader makes two) is no pass
    del it
    for _ in range(3):
        list(t)
    assert data.epochs == [1, 2]  # the dataset's crop epoch follows


def test_set_epoch_stays_authoritative_and_a_state_resumes_either_way() -> None:
    s = CacheSampler(range(30), seed=5)
    s.set_epoch(3)
    assert list(s) == list(s) == s.rank_indices(3).tolist()  # given: replayed, as DistributedSampler does
    auto = CacheSampler(range(30), seed=5)
    list(auto)
    second = iter(auto)
    rest_of_1 = [next(second) for _ in range(7)]
    auto.advance(7)
    state = auto.state_dict()
    assert (state["epoch"], state["position"]) == (1, 7)
    again = CacheSampler(range(30), seed=0)
    again.load_state_dict(state)
    assert rest_of_1 + list(again) == auto.rank_indices(1).tolist()  # the rest of the saved epoch
    assert list(again) == auto.rank_indices(2).tolist() and again.epoch == 2  # then the next one
    done = CacheSampler(range(30), seed=5)
    list(done)
    done.advance(30)
    after = CacheSampler(range(30), seed=5)
    after.load_state_dict(done.state_dict())  # saved after the epoch's last step, set_epoch never called
    assert len(after) == 30 and list(after) == done.rank_indices(1).tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_without_set_epoch_reshuffles_every_epoch(tmp_path, workers: int) -> None:
    root, _images, _ = make_cache(tmp_path / "c", n=24)
    ds = CachedImageDataset(root)
    s = CacheSampler(ds, seed=1)
    dl = DataLoader(ds, batch_size=5, sampler=s, collate_fn=collate_batch, num_workers=workers,
                    persistent_workers=workers > 0)
    epochs = [np.concatenate([decode_index(x.numpy()) for x, _ in dl]).tolist() for _ in range(3)]
    assert epochs == [s.rank_indices(e).tolist() for e in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    one = CacheSampler(range(12), seed=2)  # batch_size=None: the loader iterates the sampler itself, twice per pass
    per_sample = DataLoader(list(range(12)), batch_size=None, sampler=one, num_workers=workers)
    assert [[int(v) for v in per_sample] for _ in range(2)] == [one.rank_indices(e).tolist() for e in range(2)]
