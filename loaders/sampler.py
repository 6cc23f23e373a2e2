"""CacheSampler: shuffled or sequential, DDP-sharded, shard-windowed on request, resumable mid-epoch.

Epoch order (``shuffle=True``): by default ``torch.randperm(n, generator=seed + epoch)``, the very order
``DistributedSampler`` draws and splits (rank ``r`` takes every ``R``-th index from ``r``), so either may
replace the other. ``shard_window=W``: the cache's stored files (``data_source.file_bounds()``: npy or jpeg
shards, zarr chunks) in a shuffled order, then the samples of each group of ``W`` consecutive files shuffled
together (Streaming's block shuffle, webdataset's shard shuffle): at most ``W`` files are started and not
finished at any point, so reads stay sequential-ish (zarr, a cache larger than RAM) and a cache at a URL
fetches each file a batch touches whole (``read_files_whole()``). Each rank takes a contiguous stretch, so
ranks read disjoint files. Not a uniform permutation: a batch holds samples of at most ``2 W`` files.

Equal counts per rank: ``num_samples = ceil(n / R)`` (``drop_last=False``: the order is padded by repeating
its first ``R * num_samples - n`` indices, each other index seen exactly once) or ``floor(n / R)``
(``drop_last=True``: none seen twice, the last ``n mod R`` of the order not seen this epoch).

Resuming: ``position`` counts the samples of *this rank* consumed this epoch; a DataLoader draws indices
ahead of the loop, so the loop reports them (``advance(len(y))`` per step, or ``set_position``).
``state_dict()`` saves it; after ``load_state_dict`` the next ``iter()`` yields exactly the rest of that
epoch, and rank 0's state resumes every rank.

Epochs: until ``set_epoch`` is first called, each new pass (the first index asked of a new ``iter()``) is the
next epoch, so a loop that never calls it (PyTorch's imagenet example outside DDP) still reshuffles every epoch;
an iterator made and dropped unused is no pass (a DataLoader makes two per pass when it iterates the sampler
itself). Once ``set_epoch`` is called it alone says the epoch, as DistributedSampler's: ``set_epoch(e)`` with a
new ``e`` restarts at 0, with the current one keeps the position, and a consumed epoch replays on a new
``iter()``; a state *loaded* at the end of its epoch yields nothing, so the loop moves on::

    sampler.load_state_dict(ckpt["sampler"])            # optional resume
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in device_loader(dl, "cuda"):
            step(x, y)
            sampler.advance(len(y))
            if time_to_save: save({"sampler": sampler.state_dict(), ...})
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["CacheSampler"]

# The keywords of the two-level orders that shard_window replaces, and what each says in it.
_RENAMED = {"chunked": "shard_window=W (the stored files shuffled, then samples within groups of W files)",
            "chunk_size": "shard_window=W: the groups are the cache's stored files (a zarr's chunks)",
            "window": "shard_window=W"}


def removed_options(removed: dict[str, Any], where: str) -> None:
    """TypeError naming the new spelling of each old sampler keyword in ``removed`` (any other: unknown)."""
    for key in removed:
        if key in _RENAMED:
            raise TypeError(f"{where}({key}=) is {_RENAMED[key]} in this release")
        raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")


class CacheSampler(Sampler[int]):
    """Indices of one rank's share of an epoch; the module docstring states the guarantees.

    Args:
        data_source: the dataset (anything with ``len``).
        shuffle: random order per (seed, epoch); ``False`` gives ``0, 1, 2, ...`` split across ranks.
        seed: base seed; the same (seed, epoch) gives the same order on every run and machine.
        drop_last: drop the tail instead of padding with repeats, so no index repeats.
        num_replicas, rank: default to ``torch.distributed``'s world size and rank when initialised, else 1, 0.
        shard_window: shuffle the stored files, then samples within groups of this many files, each remote
            file fetched whole (see the module docstring); needs ``data_source.file_bounds()``.

    ``set_epoch`` also sets the data source's own epoch where it has one (a dataset that crops in its workers).
    """

    def __init__(self, data_source: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_replicas: int | None = None, rank: int | None = None, shard_window: int | None = None,
                 **removed: Any) -> None:
        removed_options(removed, "CacheSampler")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank}")
        self._bounds: np.ndarray | None = None
        if shard_window is not None:
            if shard_window < 1:
                raise ValueError(f"shard_window must be >= 1, got {shard_window}")
            self._bounds = _file_bounds(data_source)
            tell = getattr(data_source, "read_files_whole", None)
            if shuffle and callable(tell):  # before a DataLoader's workers get their copy of the dataset
                tell()
        self.data_source = data_source
        self.dataset_len = len(data_source)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shard_window = None if shard_window is None else int(shard_window)
        n, r = self.dataset_len, self.num_replicas
        self.num_samples = n // r if self.drop_last else math.ceil(n / r)
        self.total_size = self.num_samples * r
        self.epoch = 0
        self.position = 0
        # True after load_state_dict() of a finished epoch: its rest is empty, not a replay.
        self._loaded_at_end = False
        self._epoch_given = False  # set_epoch() was called: it alone says the epoch from then on
        self._began = False  # a pass of this epoch has begun (without set_epoch, the next pass is the next epoch)

    # ------------------------------------------------------------------ order
    def global_order(self, epoch: int | None = None) -> np.ndarray:
        """The whole epoch's order over all ranks, before padding or dropping (int64, a permutation)."""
        epoch = self.epoch if epoch is None else int(epoch)
        n = self.dataset_len
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        if self._bounds is not None and self.shard_window is not None:
            return _grouped_order(self._bounds, self.shard_window, np.random.default_rng([self.seed, epoch, 1]))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)  # DistributedSampler's seeding, so orders match
        return torch.randperm(n, generator=g).numpy()

    def rank_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's ``num_samples`` indices for ``epoch`` (default: the current one), from the start."""
        order = self.global_order(epoch)
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > len(order) and len(order):
            pad = self.total_size - len(order)
            order = np.concatenate([order, np.tile(order, math.ceil(pad / len(order)))[:pad]])
        if self.shard_window is not None and self.shuffle:  # ranks read disjoint files
            lo = self.rank * self.num_samples
            return order[lo : lo + self.num_samples]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        # A generator: the epoch's bookkeeping runs at the first index asked for, so an iterator made and dropped
        # (a DataLoader iterating the sampler itself makes two per pass) does not start a pass.
        if not self._epoch_given and (self._began or self._loaded_at_end):
            self._enter(self.epoch + 1)  # no set_epoch: a new pass is the next epoch
        elif self.position >= self.num_samples:
            if self._loaded_at_end:  # resumed after the epoch's last step: nothing of it is left
                self._loaded_at_end = False
                return
            self.position = 0  # the epoch was consumed and set_epoch did not move on: replay it
        self._began = True
        yield from self.rank_indices()[self.position :].tolist()

    def __len__(self) -> int:
        """Indices the next ``iter()`` yields: what is left of the epoch after ``position``."""
        if not self._epoch_given and (self._began or self._loaded_at_end):
            return self.num_samples  # the next pass is a whole new epoch
        left = self.num_samples - self.position
        if left <= 0 and self._loaded_at_end:
            return 0
        return left if left > 0 else self.num_samples

    # ------------------------------------------------------------------ epochs and resuming
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a different epoch starts at position 0, the current one keeps it."""
        self._epoch_given = True
        epoch = int(epoch)
        if epoch != self.epoch:
            self._enter(epoch)
        else:
            self._epoch_to_data_source()

    def _enter(self, epoch: int) -> None:
        self.epoch, self.position, self._loaded_at_end, self._began = epoch, 0, False, False
        self._epoch_to_data_source()

    def _epoch_to_data_source(self) -> None:
        set_epoch = getattr(self.data_source, "set_epoch", None)
        if callable(set_epoch):  # a dataset that crops in its workers draws its boxes per epoch
            set_epoch(self.epoch)

    def advance(self, n: int) -> None:
        """Record that the loop consumed ``n`` more samples of this rank (call once per step)."""
        if n < 0:
            raise ValueError(f"advance(n) needs n >= 0, got {n}")
        self.position = min(self.num_samples, self.position + int(n))

    def set_position(self, position: int) -> None:
        """Set the samples of this rank consumed this epoch (e.g. ``steps_done * batch_size``)."""
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"position must be in [0, {self.num_samples}], got {position}")
        self.position = int(position)
        self._loaded_at_end = False

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("epoch", "seed", "position", "num_samples", "num_replicas",
                                              "dataset_len", "shuffle", "drop_last", "shard_window")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch, seed and position. The order-defining settings must match, or ValueError."""
        if state.get("chunked"):
            raise ValueError("cannot resume: the saved sampler has chunked=True, an order this release does not "
                             "draw (shard_window=W replaces it); resume with the release that saved it")
        for key in ("dataset_len", "num_replicas", "shuffle", "drop_last", "shard_window"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the saved sampler has {key}={state[key]!r}, this one has "
                    f"{key}={getattr(self, key)!r}; the saved position would point into a different order"
                )
        try:
            epoch, seed, position = int(state["epoch"]), int(state["seed"]), int(state["position"])
        except KeyError as e:
            raise ValueError(f"sampler state is missing {e.args[0]!r} (needs epoch, seed, position)") from None
        self.seed = seed
        self.epoch = epoch
        self.set_position(position)
        self._loaded_at_end = self.position >= self.num_samples
        self._began = False
        self._epoch_to_data_source()

    def __repr__(self) -> str:
        return (f"CacheSampler(n={self.dataset_len}, shuffle={self.shuffle}, seed={self.seed}, "
                f"rank={self.rank}/{self.num_replicas}, drop_last={self.drop_last}, "
                f"shard_window={self.shard_window}, "
                f"epoch={self.epoch}, position={self.position}/{self.num_samples})")


def _file_bounds(data_source: Sized) -> np.ndarray:
    """``data_source.file_bounds()`` checked: ascending from 0 to ``len(data_source)``."""
    get = getattr(data_source, "file_bounds", None)
    if not callable(get):
        raise ValueError(f"shard_window needs a dataset that says where its files start (file_bounds(): "
                         f"CachedImageDataset); {type(data_source).__name__} does not")
    bounds = np.asarray(get(), dtype=np.int64)
    n = len(data_source)
    if bounds.ndim != 1 or len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != n or np.any(np.diff(bounds) < 0):
        raise ValueError(f"file_bounds() must ascend from 0 to {n}, got {bounds[:4]}...{bounds[-2:]}")
    return bounds


def _grouped_order(bounds: np.ndarray, group: int, rng: np.random.Generator) -> np.ndarray:
    """Units ``[bounds[k], bounds[k+1])`` in a shuffled order, the samples of each ``group`` consecutive units
    (in that order) shuffled together: a permutation of ``range(bounds[-1])``."""
    units = rng.permutation(len(bounds) - 1)
    order = np.empty(int(bounds[-1]), dtype=np.int64)
    pos = 0
    for w in range(0, len(units), group):
        ids = np.concatenate([np.arange(bounds[k], bounds[k + 1]) for k in units[w : w + group]])
        order[pos : pos + len(ids)] = rng.permutation(ids)
        pos += len(ids)
    return order
