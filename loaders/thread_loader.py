"""``ThreadLoader``: batches of a cached dataset gathered by threads of the training process, an
alternative to DataLoader worker processes (``cachebuild train --loader threads``).

The cache is memory-mapped, so a batch is one ``gather`` whose copies release the GIL. Threads can
therefore gather batches in parallel into buffers the loop reads directly, with no worker processes,
no shared-memory hand-off and no second copy by a pin-memory thread. CPU buffers are reused once
nothing references them any more (checked by reference count), which saves the page faults of a fresh
38 MB allocation per batch; pinned buffers come from torch's caching host allocator, which recycles
them only after pending device copies finish.

Called ``FastLoader`` (in ``loaders.device``) in earlier releases; that name still works.
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

__all__ = ["ThreadLoader"]


# Linux's uapi values (since 4.14); Python's mmap module names them only where its build headers had them.
_MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18 if sys.platform.startswith("linux") else None)
_MADV_KEEPONFORK = getattr(mmap, "MADV_KEEPONFORK", 19 if sys.platform.startswith("linux") else None)


def _unforked_buffer(size: int) -> np.ndarray:
    """``size`` uint8 bytes that a fork does not share. numpy's memory becomes copy-on-write in the parent
    when a process forks (a DataLoader starting its workers after this loader's first epoch does), and
    every page the loader then writes is first copied: measured 6x slower for the next epoch. With
    MADV_WIPEONFORK a child sees zeros there instead (unless a batch still holds the buffer: see
    :func:`_before_fork`), and the parent's pages stay its own."""
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
    """Reusable uint8 batch buffers; one is free when only the pool references it.

    The pool keeps each buffer flat and hands out shaped views of it: numpy points every view (a view of
    a view included) at the flat array, so its reference count says whether any batch still uses it.

    Buffers are wipe-on-fork, except across the fork itself for those a batch still uses: a child that
    reads a kept batch (a ``multiprocessing.Process``, DataLoader workers over kept batches) must see its
    pixels, not zeros. Only those buffers become copy-on-write, and only while that child lives."""

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
    """Batches of a :class:`CachedImageDataset` gathered by background threads (no worker processes).

    Yields ``(images uint8 (B, H, W, 3), labels int64 (B,)[, boxes int32 (B, 4)])`` (images float32 under
    ``DatasetOptions(normalize=...)``: cropped, flipped and normalized by the gathering threads) like a DataLoader
    with :func:`~loaders.dataset.collate_batch`; wrap it in :func:`~loaders.device.device_loader` as a DataLoader.
    ``sampler`` (e.g. :class:`~loaders.sampler.CacheSampler`, including its resume position) gives the
    indices; without one, ``shuffle`` draws a permutation from ``seed`` and a counter of epochs.

    A CPU batch's buffer is reused for a later batch only once no tensor references it any more, so
    keeping a batch is safe. ``dataset.transform`` is not applied (this is the raw fast path); a
    ``dataset.crop`` is, by the gathering threads, into buffers of the crop's size.
    """

    def __init__(
        self,
        dataset: CachedImageDataset,
        batch_size: int = 256,
        *,
        sampler: Iterable[int] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        num_threads: int = 2,
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        if batch_size < 1 or num_threads < 1 or prefetch < 0:
            raise ValueError(f"need batch_size >= 1, num_threads >= 1, prefetch >= 0; got "
                             f"{batch_size}, {num_threads}, {prefetch}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; pass pin_memory=torch.cuda.is_available()")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.sampler = sampler
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_threads = int(num_threads)
        self.prefetch = int(prefetch)
        self.pin_memory = pin_memory
        self._epochs = 0
        self._pool = _BufferPool((self.batch_size, *dataset.output_shape), dataset.output_dtype)

    def _indices(self) -> np.ndarray:
        if self.sampler is not None:
            return np.fromiter(iter(self.sampler), dtype=np.int64)
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        g = torch.Generator()
        g.manual_seed(self.seed + self._epochs)
        self._epochs += 1
        return torch.randperm(n, generator=g).numpy()

    def __len__(self) -> int:
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _out(self, b: int) -> torch.Tensor:
        shape = self.dataset.output_shape  # a crop's size may change between epochs (set_resolution)
        dtype = self.dataset.output_dtype  # float32 when the crop normalizes too
        if self.pin_memory:
            return torch.empty((b, *shape), dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
        if self._pool.shape[1:] != shape or self._pool.dtype != dtype:
            self._pool = _BufferPool((self.batch_size, *shape), dtype)  # batches still held keep the old buffers
        # the short last batch too: a fresh one would be page faults and zeroing, ~10% of a raw epoch
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
