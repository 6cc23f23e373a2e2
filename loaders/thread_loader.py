"""``ThreadLoader``: batches gathered by threads of the training process instead of DataLoader worker
processes (``cachebuild train --loader threads``).

A batch is one ``gather`` whose copies release the GIL, so threads gather batches in parallel into buffers
the loop reads directly: no worker processes, no shared-memory hand-off, no pin-memory thread's second copy.
CPU buffers are reused once nothing references them (no fresh page faults per batch); pinned buffers come
from torch's caching host allocator, which recycles them after pending copies. ``FastLoader`` (in
``loaders.device``) is its name of the previous release, kept for one release.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import sys
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from cachebuild.storage.kinds.jpeg import decode_in_this_thread
from loaders.dataset import CachedImageDataset
from loaders.sampler import CacheSampler

__all__ = ["ThreadLoader"]


# Linux's uapi values (since 4.14); Python's mmap module names them only where its build headers had them.
_MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18 if sys.platform.startswith("linux") else None)
_MADV_KEEPONFORK = getattr(mmap, "MADV_KEEPONFORK", 19 if sys.platform.startswith("linux") else None)


def _unforked_buffer(size: int) -> np.ndarray:
    """``size`` uint8 bytes that a fork does not share: after a fork (a DataLoader starting its workers) plain
    memory is copy-on-write and every page the loader writes is copied first, making its next epoch several
    times slower. MADV_WIPEONFORK gives the child zeros instead (unless a batch holds the buffer:
    :func:`_before_fork`) and leaves the parent its pages."""
    if _MADV_WIPEONFORK is not None and size:
        try:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(_MADV_WIPEONFORK)
            _maps.add(m)  # so that a fork can tell whether a batch still holds it (_before_fork)
            return np.frombuffer(m, dtype=np.uint8)  # the array keeps the map alive
        except (OSError, ValueError, AttributeError):  # an older kernel: plain memory, correct, slower after a fork
            pass
    return np.empty(size, dtype=np.uint8)


class _BufferPool:
    """Reusable batch buffers, flat, handed out as shaped views: numpy points every view at the flat array, so
    its reference count says whether a batch still uses it. Wipe-on-fork, except across a fork for those a
    batch still holds (a child reading a kept batch must see its pixels): only those become copy-on-write."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype | None = None) -> None:
        self.shape = shape
        # the flat buffers are bytes; batches are views of this dtype (float32 when the crop normalizes)
        self.dtype = np.dtype(np.uint8) if dtype is None else dtype
        self.bufs: list[np.ndarray] = []
        probe = [np.empty(0)]
        self._base = self._refs(probe, 0)
        _pools.add(self)

    @staticmethod
    def _refs(bufs: list[np.ndarray], i: int) -> int:
        return sys.getrefcount(bufs[i])

    def acquire(self) -> np.ndarray:
        for i in range(len(self.bufs)):
            if self._refs(self.bufs, i) <= self._base:
                return self.bufs[i].view(self.dtype).reshape(self.shape)
        buf = _unforked_buffer(int(np.prod(self.shape)) * self.dtype.itemsize)
        self.bufs.append(buf)
        return buf.view(self.dtype).reshape(self.shape)

    def free(self) -> list[np.ndarray]:
        """The buffers no batch uses now."""
        return [self.bufs[i] for i in range(len(self.bufs)) if self._refs(self.bufs, i) <= self._base]


# Every buffer's map while anything holds it (its pool, or a batch that outlived the pool and its loader),
# the live pools, and the maps whose wipe-on-fork is lifted for the fork in progress.
_maps: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
_pools: weakref.WeakSet[_BufferPool] = weakref.WeakSet()
_kept: list[mmap.mmap] = []


def _map_of(buf: np.ndarray) -> mmap.mmap | None:
    m = getattr(buf.base, "obj", None)  # np.frombuffer's base is a memoryview of the map
    return m if isinstance(m, mmap.mmap) else None


def _advise(maps: list[mmap.mmap], advice: int) -> None:
    for m in maps:
        with contextlib.suppress(OSError, ValueError):  # a closed map, an older kernel: nothing to undo
            m.madvise(advice)


def _before_fork() -> None:
    free = {id(_map_of(b)) for pool in list(_pools) for b in pool.free()}
    _kept[:] = [m for m in list(_maps) if id(m) not in free]  # held by a batch: the child gets its pixels
    _advise(_kept, _MADV_KEEPONFORK)  # type: ignore[arg-type]


def _after_fork_in_parent() -> None:
    _advise(_kept, _MADV_WIPEONFORK)  # type: ignore[arg-type]  # later forks: wiped again unless held
    _kept.clear()


def _after_fork_in_child() -> None:
    _kept.clear()


if _MADV_WIPEONFORK is not None and _MADV_KEEPONFORK is not None and hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


class ThreadLoader:
    """Batches of a :class:`CachedImageDataset` gathered by background threads, as a DataLoader with
    ``collate_batch`` yields them (``device_loader`` takes either). ``sampler`` (a ``CacheSampler`` with its
    resume position) gives the indices; without one, a ``CacheSampler(shuffle=, seed=)`` of its own, one epoch
    further each ``iter()``. A buffer is reused only once no tensor references it, so keeping a batch is safe.
    ``dataset.transform`` is not applied (the raw fast path); ``dataset.crop`` is, by the gathering threads."""

    def __init__(self, dataset: CachedImageDataset, batch_size: int = 256, *, sampler: Iterable[int] | None = None,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, num_threads: int = 2,
                 prefetch: int = 2, pin_memory: bool = False) -> None:
        if batch_size < 1 or num_threads < 1 or prefetch < 0:
            raise ValueError(f"need batch_size >= 1, num_threads >= 1, prefetch >= 0; got "
                             f"{batch_size}, {num_threads}, {prefetch}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; pass pin_memory=torch.cuda.is_available()")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self._own_sampler = sampler is None  # then a CacheSampler of shuffle and seed, one epoch per iter()
        self.sampler = sampler if sampler is not None else CacheSampler(dataset, shuffle=shuffle, seed=seed,
                                                                        num_replicas=1, rank=0)
        self.drop_last = drop_last
        self.num_threads = int(num_threads)
        self.prefetch = int(prefetch)
        self.pin_memory = pin_memory
        self._epochs = 0
        self._pool = _BufferPool((self.batch_size, *dataset.output_shape), dataset.output_dtype)

    def _indices(self) -> np.ndarray:
        if self._own_sampler:
            self.sampler.set_epoch(self._epochs)  # type: ignore[attr-defined]
            self._epochs += 1
        return np.fromiter(iter(self.sampler), dtype=np.int64)

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _out(self, b: int) -> torch.Tensor:
        shape = self.dataset.output_shape  # a crop's size may change between epochs (set_resolution)
        dtype = self.dataset.output_dtype  # float32 when the crop normalizes too
        if self.pin_memory:
            return torch.empty((b, *shape), dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
        if self._pool.shape[1:] != shape or self._pool.dtype != dtype:
            self._pool = _BufferPool((self.batch_size, *shape), dtype)  # batches still held keep the old buffers
        # the short last batch too: a fresh one would be page faults and zeroing
        return torch.from_numpy(self._pool.acquire()[:b])

    def _load(self, idx: np.ndarray, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # dataset.crop: cropped into the buffer by this thread
        return self.dataset.load_batch(idx, images).as_tuple()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        indices = self._indices()
        b = self.batch_size
        stop = len(indices) - len(indices) % b if self.drop_last else len(indices)
        starts = iter(range(0, stop, b))
        depth = self.num_threads + self.prefetch
        # each thread decodes a compact cache's samples itself: the threads already share the cores
        pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="ThreadLoader",
                                  initializer=decode_in_this_thread)
        pending: deque[Future[tuple[torch.Tensor, ...]]] = deque()
        try:
            for lo in starts:
                idx = indices[lo : min(lo + b, stop)]
                pending.append(pool.submit(self._load, idx, self._out(len(idx))))
                if len(pending) >= depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
