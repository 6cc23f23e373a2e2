"""Batch ring: a DataLoader worker hands its batches to the main process through reused shared memory.

Why: torch sends a tensor between processes by sharing its storage, so a worker that allocates a fresh
shared-memory batch per step page-faults a whole new batch, and the main process maps and faults in each
new segment again; reusing buffers through torch's own pickling does not help (it re-shares the storage).

Each worker owns one shared block (``UntypedStorage._new_shared``: with the default ``file_descriptor``
strategy it is unlinked at once and passed by fd, so a crash leaves nothing in /dev/shm): a small header,
one "in use" byte per slot, and ``slots`` batch slots, mapped once by both sides.

* worker: :meth:`WorkerRing.take` returns a :class:`SlotTensor` over a free slot. Pickled by the result
  queue's feeder thread it becomes a small handle ``(ring key, slot, shape)`` that carries the storage
  (by fd) until the main process has acknowledged the ring in its header, then only the key.
* main process: unpickling a handle returns a view of the slot, no copy; ``weakref.finalize`` on that
  view frees the slot once the batch and every view of it are garbage (``pin_memory=True`` copies at once).

A slot is free when its byte is 0 and no worker-side tensor of it is alive. When none frees within
``WAIT_S`` (the loop keeps batches), the batch gets fresh shared memory: slower, never stale, never
blocked. Any other pickling of a slot (``torch.save``, plain ``pickle``) takes torch's ordinary path.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from cachebuild.processes import pid_alive
from loaders.shared_memory import shm_free_bytes

__all__ = ["MAX_SLOTS", "WAIT_S", "InlineTensor", "ProcessRing", "SlotTensor", "WorkerRing", "drop_dead_rings",
           "ring_bytes", "ring_stats", "rings_fit"]

WAIT_S = 0.005  # longest wait for a free slot: short against what a fresh batch's page faults cost

_PAGE = 4096
_ACK = 0  # header byte: 1 once the main process has registered the ring (handles may drop the storage)
_COUNTS = 8  # int64 x 3 at bytes 8..32: batches sent in slots, fallbacks, slots (worker-written, for stats)
_FLAGS = 64  # one byte per slot: 1 while the main process may hold a view of it
MAX_SLOTS = _PAGE - _FLAGS
_FEEDER = "QueueFeederThread"  # multiprocessing.Queue's pickling thread (the DataLoader result queue)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def ring_bytes(slots: int, slot_bytes: int) -> int:
    """Shared memory one :class:`WorkerRing` of ``slots`` x ``slot_bytes`` takes (header page included)."""
    return _PAGE + slots * _round_up(max(slot_bytes, 1), _PAGE)


def rings_fit(slots: int, slot_bytes: int) -> bool:
    """Whether a ring per DataLoader worker takes at most half of the space free in /dev/shm: where it is small
    (Docker's 64 MB), rings would leave too little for fresh batches, and a loader that fits without rings
    would fail with them."""
    free = shm_free_bytes()
    if free is None:
        return True
    info = get_worker_info()
    workers = 1 if info is None else info.num_workers
    return workers * ring_bytes(slots, slot_bytes) <= free // 2


def _storage_bytes(storage: torch.UntypedStorage) -> np.ndarray:
    """The whole storage as a writable uint8 numpy array (shares memory, keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy()  # type: ignore[call-overload]


class SlotTensor(torch.Tensor):
    """A worker-side tensor over one ring slot; it pickles as a handle (module doc). Torch functions on it
    return plain tensors (``__torch_function__`` disabled): only the tensor :meth:`WorkerRing.take` made
    travels as a slot."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        ring: WorkerRing | None = self.__dict__.get("_ring")
        slot = self.__dict__.get("_slot", -1)
        if (ring is None or self.__dict__.get("_sent") or threading.current_thread().name != _FEEDER
                or self.data_ptr() != ring.address(slot) or not self.is_contiguous()):
            # Not the DataLoader hand-off (or sent once already): torch's own reduction of a plain
            # tensor. Under multiprocessing it first moves the storage into fresh shared memory (a
            # copy), after which the slot is free again; plain pickle and torch.save copy the bytes.
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)
        self._sent = True
        return ring.handoff(slot, tuple(self.shape), self.__dict__.get("_dtype", "uint8"))


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


class InlineTensor(torch.Tensor):
    """A small tensor (labels, boxes) that pickles by value: torch would hand it over in shared memory (a new
    segment, an fd through a socket, a new mapping), far dearer than its few bytes."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _from_numpy, (self.as_subclass(torch.Tensor).numpy(),)


class WorkerRing:
    """``slots`` reusable batch slots of ``slot_bytes`` each, in one shared block (worker side): ``slots *
    slot_bytes`` of shared memory per worker (plus a page), mapped in the worker and the main process.
    ``retire``: the key of this worker's previous (smaller) ring, which the main process then forgets."""

    def __init__(self, slots: int, slot_bytes: int, retire: tuple[int, str] | None = None) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
        self.key = (os.getpid(), secrets.token_hex(8))  # random token: pids are reused
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.stride = _round_up(max(slot_bytes, 1), _PAGE)
        self.retire = retire
        self.storage = torch.UntypedStorage._new_shared(ring_bytes(slots, slot_bytes))
        self.buf = _storage_bytes(self.storage)
        self.buf[:_PAGE] = 0
        self.counts = self.buf[_COUNTS : _COUNTS + 24].view(np.int64)
        self.counts[2] = slots
        self.flags = self.buf[_FLAGS : _FLAGS + slots]
        self.local = [False] * slots  # a worker-side tensor of the slot is alive
        self._base = self.buf.ctypes.data
        self._vain = False  # the last take() found no slot: do not wait again until one frees
        self._claiming = threading.Lock()  # finding a free slot and marking it taken are one step

    def address(self, slot: int) -> int:
        return self._base + _PAGE + slot * self.stride

    def _free_slot(self) -> int:
        for s in range(self.slots):
            if not self.local[s] and self.flags[s] == 0:
                return s
        return -1

    def _claim(self) -> int:
        """A free slot, marked taken before any other thread can find it (threads of one worker gathering
        batches at once must never share a slot's pixels); -1 if none."""
        with self._claiming:
            s = self._free_slot()
            if s >= 0:
                self.local[s] = True
            return s

    def take(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> SlotTensor | None:
        """An uninitialised tensor of ``shape`` (uint8, or ``dtype``) in a free slot, or None (caller falls back)."""
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        if nbytes > self.slot_bytes:
            raise ValueError(f"a batch of {nbytes} bytes does not fit slots of {self.slot_bytes}")
        s = self._claim()
        if s < 0 and not self._vain:
            deadline = time.perf_counter() + WAIT_S
            while s < 0 and time.perf_counter() < deadline:
                time.sleep(WAIT_S / 10)
                s = self._claim()
        if s < 0:
            self._vain = True
            self.counts[1] += 1
            return None
        self._vain = False
        off = _PAGE + s * self.stride
        view = self.buf[off : off + nbytes].view(dt).reshape(shape)
        # The tensor's storage holds `view`; when the tensor, all its views, or torch's move of the
        # storage into fresh shared memory (when it is shared the ordinary way) let go, the slot is ours again.
        weakref.finalize(view, self.local.__setitem__, s, False)
        t = torch.from_numpy(view).as_subclass(SlotTensor)
        t.__dict__.update(_ring=self, _slot=s, _dtype=dt.str)  # read back through __dict__ by __reduce_ex__
        return t

    def handoff(self, slot: int, shape: tuple[int, ...], dtype: str = "uint8") -> tuple[Any, ...]:
        """Pickle form of a slot sent to the main process (called from the queue's feeder thread)."""
        self.flags[slot] = 1  # before the worker-side tensor can die: the slot is never free in between
        self.counts[0] += 1
        storage = self.storage if self.buf[_ACK] == 0 else None
        return _rebuild_slot, (self.key, slot, shape, _PAGE + slot * self.stride, storage, self.retire, dtype)


class ProcessRing:
    """A dataset's batch ring in the worker it runs in: made on its first batch, remade when a batch
    outgrows it or ``slots`` changes, never carried into another process (a fork or a pickled copy starts
    without one), and given up for fresh batches in a process where shared memory is refused."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.ring: WorkerRing | None = None
        self.failed = False  # shared memory refused (small /dev/shm): fresh batches in this process
        self.pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._reset()

    def take(self, slots: int, shape: tuple[int, ...], dtype: Any = np.uint8) -> SlotTensor | None:
        """A free slot of ``shape`` (and ``dtype``) in this process's ring of ``slots``, or None (the caller
        makes a fresh batch)."""
        if self.pid != os.getpid():  # forked: the parent's ring is not ours
            self._reset()
        if self.failed:
            return None
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ring = self.ring
        if ring is None or ring.slot_bytes < nbytes or ring.slots != slots:
            self.ring = None  # the old ring lives on while its batches do
            if not rings_fit(slots, nbytes):
                self.failed = True
                return None
            try:
                ring = self.ring = WorkerRing(slots, nbytes, retire=None if ring is None else ring.key)
            except RuntimeError:  # e.g. /dev/shm too small for the ring: one fresh batch at a time may fit
                self.failed = True
                return None
        return ring.take(shape, dtype)


# ---------------------------------------------------------------------------- main process side


class _MainRing:
    __slots__ = ("buf", "owner", "pid", "views")

    def __init__(self, storage: torch.UntypedStorage, pid: int) -> None:
        self.buf = _storage_bytes(storage)
        self.pid = pid  # the worker's
        self.owner = os.getpid()
        self.views = 0


_registry: dict[tuple[int, str], _MainRing] = {}
_lock = threading.Lock()  # unpickling may run in the pin-memory thread; finalizers never take it


def _drop_dead_locked() -> int:
    dead = [k for k, r in _registry.items() if not pid_alive(r.pid)]
    for k in dead:
        del _registry[k]  # outstanding views keep their own reference to the mapping
    return len(dead)


def drop_dead_rings() -> int:
    """Forget (unmap) the rings of exited workers now, as each new ring's registration does; returns how many."""
    with _lock:
        return _drop_dead_locked()


def _clear(buf: np.ndarray, slot: int, owner: int) -> None:
    # Runs in whichever thread drops the last view: no locks here. A forked child holds copies of the
    # views (and of this finalizer), not the batch: only the process that received it releases it.
    if os.getpid() == owner:
        buf[_FLAGS + slot] = 0


def _rebuild_slot(key: tuple[int, str], slot: int, shape: tuple[int, ...], offset: int,
                  storage: torch.UntypedStorage | None, retire: tuple[int, str] | None,
                  dtype: str = "uint8") -> torch.Tensor:
    """Unpickle a slot handle in the main process: a tensor view of the slot, released when garbage."""
    with _lock:
        ring = _registry.get(key)
        if ring is None:
            if storage is None:
                raise RuntimeError(f"batch ring {key} is unknown in process {os.getpid()}: a slot handle was "
                                   "unpickled in a process that did not receive the ring")
            _drop_dead_locked()
            if retire is not None:
                _registry.pop(retire, None)
            ring = _registry[key] = _MainRing(storage, key[0])
            ring.buf[_ACK] = 1  # registered: later handles may leave the storage out
        ring.views += 1
    dt = np.dtype(dtype)
    view = ring.buf[offset : offset + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
    weakref.finalize(view, _clear, ring.buf, slot, ring.owner)
    return torch.from_numpy(view)


def ring_stats() -> dict[str, int]:
    """Main-process view of the registered rings: count, slots, batches received in slots, worker fallbacks."""
    with _lock:
        rings = list(_registry.values())
    counts = [r.buf[_COUNTS : _COUNTS + 24].view(np.int64) for r in rings]
    return {
        "rings": len(rings),
        "slots": int(sum(c[2] for c in counts)),
        "views": sum(r.views for r in rings),
        "slot_batches": int(sum(c[0] for c in counts)),
        "fallbacks": int(sum(c[1] for c in counts)),
    }
