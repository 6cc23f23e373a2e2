"""CachedImageDataset: a map-style torch Dataset over a cachebuild cache (npy shards or zarr).

The hot path of every epoch. A batch is one sorted pass over the requested samples, each row copied
once, straight into its slot of a single uint8 (B, H, W, 3) buffer (in shared memory when running in a
``DataLoader`` worker, so handing it to the main process copies nothing). No decode, no per-image
tensor, no stacking: ``__getitems__`` returns a :class:`CacheBatch` and :func:`collate_batch` passes it
through as ``(images, labels[, boxes])``. In a worker that buffer is a slot of a per-worker ring of
reused shared-memory batches (``loaders.batch_ring``): mapped once by both processes, so a batch costs
no fresh page faults on either side.

Why a per-row copy loop and not one vectorised gather: the rows of a batch live in different shard
files (different memory maps), and numpy has no scatter-from-many-arrays primitive. A fancy read per
shard followed by a scatter into place (``CacheReader.read``) moves every byte twice and measured
~0.6x the speed of a loop that copies each row once (the loop's Python cost is ~1 us per 150 kB row).
When all rows come from one array (in-RAM mode, single-shard caches) a single ``np.take`` is used.

Process model: the constructor validates the whole cache in the calling process (so a missing,
truncated or mis-shaped shard is a named error there, never inside a worker), then closes every file.
Each process maps the shards it touches lazily on first use; the pickled state holds only the path,
the manifest and the small per-sample arrays.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from cachebuild.errors import CacheCorruptError
from cachebuild.format import Manifest, open_cache
from cachebuild.format.storage import ZARR_NAME, load_paths
from loaders.batch_ring import MAX_SLOTS, InlineTensor, WorkerRing
from loaders.collate import CacheBatch, collate_batch
from loaders.shared_memory import load_shared, shared_uint8

__all__ = ["DEFAULT_CHUNK_BYTES", "CacheBatch", "CachedImageDataset", "collate_batch"]

# Chunk of consecutive samples that the chunk-aware sampler keeps together for npy caches (zarr caches
# use their own chunk length): ~8 MB, the block size FFCV's quasi-random order uses.
DEFAULT_CHUNK_BYTES = 8 << 20

# Batch slots per DataLoader worker: the DataLoader keeps prefetch_factor (default 2) batches in flight
# per worker, the loop holds the batch it works on and the one before (a `for x, y in dl` rebinds x only
# after next() returns), and device_loader one more.
DEFAULT_RING_SLOTS = 5


def _in_worker() -> bool:
    return get_worker_info() is not None


def _new_uint8(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor; in shared memory when it will cross a process boundary."""
    if not shared:
        return torch.empty(shape, dtype=torch.uint8)
    # Allocated straight in shared memory (as default_collate does for its stack) rather than
    # share_memory_() afterwards, which would copy the batch once more.
    return shared_uint8(shape)


def _as_writable_numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


class CachedImageDataset(Dataset):
    """A cachebuild cache as a map-style dataset: ``ds[i] -> (uint8 HWC tensor, int label[, box])``.

    Args:
        root: the cache folder (holding ``manifest.json``); npy or zarr storage is read from the manifest.
        transform: optional per-sample CPU callable applied to the uint8 HWC tensor. With it, batches
            are collated sample by sample (slower); the fast path is ``transform=None`` plus device-side
            transforms on the batch.
        return_boxes: also return the valid box ``(y0, x0, y1, x1)`` int32 (end-exclusive) of each sample.
            Caches built with ``--fit pad`` store it; for other caches every pixel is valid, so the box is
            the full image ``(0, 0, H, W)``.
        in_memory: ``False`` reads through memory maps (page cache); ``True`` loads the whole cache once
            into shared memory that every DataLoader worker sees (fork or spawn, no per-worker copy);
            ``"auto"`` does so when the images fit ``memory_budget``.
        memory_budget: bytes allowed for ``in_memory="auto"``; default half of the available RAM.
        ring_slots: reused batch slots per ``DataLoader`` worker (``loaders.batch_ring``); costs
            ``ring_slots`` x batch bytes of shared memory per worker (5 x 38.5 MB for 256 x 224 x 224 x 3),
            mapped by the worker and the main process. Use ``prefetch_factor + 3`` when raising the
            DataLoader's ``prefetch_factor``; 0 allocates a fresh shared batch every time (the old path).
            A batch that finds no free slot (e.g. the loop keeps every batch) gets a fresh one.

    Opening validates the manifest and every shard header (named errors from ``cachebuild.errors``:
    ``CacheNotFoundError``, ``UnsupportedFormatError``, ``CacheCorruptError``) and then closes the files.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        transform: Callable[[torch.Tensor], Any] | None = None,
        return_boxes: bool = False,
        in_memory: bool | str = False,
        memory_budget: int | None = None,
        ring_slots: int = DEFAULT_RING_SLOTS,
    ) -> None:
        if in_memory not in (True, False, "auto"):
            raise ValueError(f"in_memory must be True, False or 'auto', got {in_memory!r}")
        if not 0 <= ring_slots <= MAX_SLOTS:
            raise ValueError(f"ring_slots must be in 0..{MAX_SLOTS}, got {ring_slots}")
        self.root = Path(root)
        reader = open_cache(self.root)  # validates manifest + every shard header, here in the caller
        self.manifest: Manifest = reader.manifest
        self.transform = transform
        self.return_boxes = bool(return_boxes)
        self.ring_slots = int(ring_slots)
        self._labels: np.ndarray = np.ascontiguousarray(reader.labels, dtype=np.int64)
        self.sizes: np.ndarray = reader.sizes
        self._boxes: np.ndarray | None = reader.boxes
        self._starts: np.ndarray = reader.shard_starts
        self._raw_zarr = False
        if self.manifest.storage == "zarr":
            self._zarr_chunk = int(reader.images.chunks[0])
            self._raw_zarr = _check_raw_zarr(self.root, self.manifest, self._zarr_chunk)
            if self._raw_zarr:  # uncompressed chunks are read like npy shards: chunk k = "shard" k
                self._starts = np.r_[np.arange(0, len(self._labels), self._zarr_chunk), len(self._labels)]
        del reader  # drop the validation maps: nothing open is inherited by forked workers
        self._paths: list[str] | None = None
        self._maps: list[np.ndarray | None] | None = None  # per-process lazy maps (npy)
        self._zarr: Any = None
        self._pid = os.getpid()
        self._shared: torch.Tensor | None = None
        self._ring: WorkerRing | None = None  # per worker process, made on its first batch
        self._ring_failed = False  # shared memory refused (small /dev/shm): fresh batches in this process
        if in_memory == "auto":
            budget = _default_budget() if memory_budget is None else int(memory_budget)
            in_memory = self.nbytes <= budget
        if in_memory:
            self._shared = load_shared(self)

    # ------------------------------------------------------------------ metadata
    def __len__(self) -> int:
        return self.manifest.count

    @property
    def shape(self) -> tuple[int, int, int]:
        """(H, W, 3) of every sample."""
        return self.manifest.shape

    @property
    def classes(self) -> tuple[str, ...]:
        return self.manifest.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.manifest.classes)}

    @property
    def labels(self) -> np.ndarray:
        """int64 (N,) labels (read-only view)."""
        v = self._labels.view()
        v.flags.writeable = False
        return v

    @property
    def targets(self) -> list[int]:
        """Labels as a list, like torchvision's ``ImageFolder.targets``."""
        return self._labels.tolist()

    @property
    def boxes(self) -> np.ndarray:
        """int32 (N, 4) valid boxes ``(y0, x0, y1, x1)``, end-exclusive; full images when the cache has none."""
        if self._boxes is not None:
            return self._boxes
        h, w, _ = self.shape
        return np.tile(np.array([0, 0, h, w], dtype=np.int32), (len(self), 1))

    @property
    def paths(self) -> list[str]:
        """Provenance: the source path of every sample (loaded on first use, never pickled)."""
        if self._paths is None:
            self._paths = load_paths(self.root, self.manifest)
        return self._paths

    @property
    def nbytes(self) -> int:
        return len(self) * self.manifest.sample_nbytes

    @property
    def in_memory(self) -> bool:
        return self._shared is not None

    @property
    def chunk_size(self) -> int:
        """Samples per read chunk for :class:`~loaders.sampler.CacheSampler`'s chunk-aware order."""
        if self.manifest.storage == "zarr":
            return self._zarr_chunk
        return max(1, DEFAULT_CHUNK_BYTES // self.manifest.sample_nbytes)

    def __repr__(self) -> str:
        m = self.manifest
        return (f"CachedImageDataset({str(self.root)!r}, n={m.count}, shape={m.shape}, storage={m.storage!r}, "
                f"classes={len(m.classes)}, in_memory={self.in_memory})")

    # ------------------------------------------------------------------ processes
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None  # reopened lazily in the receiving process
        state["_zarr"] = None
        state["_paths"] = None
        state["_ring"] = None
        state["_ring_failed"] = False
        # _shared (a torch tensor in shared memory) travels by handle through torch's multiprocessing
        # reductions (DataLoader workers, fork or spawn); a plain pickle.dumps copies it, as for any tensor.
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = -1

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked or unpickled: maps of another process are not ours
            self._maps = None
            self._zarr = None
            self._ring = None
            self._ring_failed = False
            self._pid = os.getpid()

    def _shard(self, k: int) -> np.ndarray:
        maps = self._maps
        if maps is None:
            maps = self._maps = [None] * (len(self._starts) - 1)
        arr = maps[k]
        if arr is None:
            if self._raw_zarr:
                arr = maps[k] = _raw_zarr_chunk(self.root, k, self._zarr_chunk, self.shape)
            else:
                mm = np.load(self.root / self.manifest.shards[k].file, mmap_mode="r", allow_pickle=False)
                arr = maps[k] = mm.view(np.ndarray)  # plain ndarray view: np.memmap slicing is slower
        return arr

    def _zarr_array(self) -> Any:
        if self._zarr is None:
            import zarr

            self._zarr = zarr.open_array(str(self.root / ZARR_NAME), mode="r")
        return self._zarr

    # ------------------------------------------------------------------ reading
    def _check_indices(self, idx: np.ndarray) -> None:
        if idx.ndim != 1:
            raise IndexError(f"expected a 1-D list of sample indices, got shape {list(idx.shape)}")
        if len(idx) and (idx.min() < -len(self) or idx.max() >= len(self)):
            bad = idx[(idx < -len(self)) | (idx >= len(self))][0]
            raise IndexError(f"sample index {int(bad)} is out of range for a cache of {len(self)} samples")

    def gather(self, indices: Sequence[int] | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Read samples ``indices`` (in that order) into ``out`` (uint8 (B, H, W, 3), allocated if None).

        Reads go in ascending sample order (sequential within each shard); each row is copied once.
        Safe to call from several threads at once (numpy releases the GIL while copying).
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._check_indices(idx)
        idx = np.where(idx < 0, idx + len(self), idx)
        if out is None:
            out = np.empty((len(idx), *self.shape), dtype=np.uint8)
        elif out.shape != (len(idx), *self.shape) or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8{[len(idx), *self.shape]}, got {out.dtype}{list(out.shape)}")
        if len(idx) == 0:
            return out
        self._check_process()
        if self._shared is not None:
            # mode="clip": indices are checked above; the default mode="raise" buffers `out` (a 2nd copy).
            np.take(self._shared.numpy(), idx, axis=0, out=out, mode="clip")
            return out
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        if self.manifest.storage == "zarr" and not self._raw_zarr:
            # zarr reads each touched chunk once for the whole sorted selection.
            block = self._zarr_array().get_orthogonal_selection((sorted_idx,))
            inv = np.empty_like(order)
            inv[order] = np.arange(len(order))
            np.take(block, inv, axis=0, out=out, mode="clip")
            return out
        starts = self._starts
        shard_of = np.searchsorted(starts, sorted_idx, side="right") - 1
        if shard_of[0] == shard_of[-1]:  # one shard: a single C-level gather in the requested order
            k = int(shard_of[0])
            np.take(self._shard(k), idx - starts[k], axis=0, out=out, mode="clip")
            return out
        local = (sorted_idx - starts[shard_of]).tolist()
        shards = shard_of.tolist()
        current, arr = -1, None
        for pos, k, i in zip(order.tolist(), shards, local, strict=True):
            if k != current:
                current, arr = k, self._shard(k)
            out[pos] = arr[i]  # type: ignore[index]
        return out

    def _boxes_at(self, idx: np.ndarray) -> np.ndarray:
        if self._boxes is not None:
            return self._boxes[idx]
        h, w, _ = self.shape
        return np.tile(np.array([0, 0, h, w], dtype=np.int32), (len(idx), 1))

    def _slot(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A free slot of this worker's batch ring (made, or remade larger, on demand), or None."""
        self._check_process()
        nbytes = int(np.prod(shape))
        ring = self._ring
        if self._ring_failed:
            return None
        if ring is None or ring.slot_bytes < nbytes or ring.slots != self.ring_slots:
            self._ring = None  # the old ring lives on while its batches do
            try:
                ring = self._ring = WorkerRing(self.ring_slots, nbytes, retire=None if ring is None else ring.key)
            except RuntimeError:  # e.g. /dev/shm too small for the ring: one fresh batch at a time may fit
                self._ring_failed = True
                return None
        return ring.take(shape)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        i = int(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} is out of range for a cache of {len(self)} samples")
        i %= len(self)
        img: Any = torch.from_numpy(self.gather([i])[0])
        if self.transform is not None:
            img = self.transform(img)
        label = int(self._labels[i])
        if self.return_boxes:
            return img, label, torch.from_numpy(self._boxes_at(np.array([i]))[0])
        return img, label

    def __getitems__(self, indices: Sequence[int]) -> CacheBatch | list[tuple[Any, ...]]:
        """A whole batch in one pass: a :class:`CacheBatch` (see :func:`collate_batch`).

        With a ``transform`` it returns per-sample tuples instead, for ``default_collate`` to stack.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        self._check_indices(idx)
        idx = np.where(idx < 0, idx + len(self), idx)
        shape = (len(idx), *self.shape)
        worker = _in_worker()
        images = self._slot(shape) if worker and self.transform is None and self.ring_slots else None
        if images is None:
            images = _new_uint8(shape, shared=worker)
        self.gather(idx, out=_as_writable_numpy(images))
        labels = torch.from_numpy(self._labels[idx])
        boxes = torch.from_numpy(self._boxes_at(idx)) if self.return_boxes else None
        if worker and self.ring_slots:  # small tensors by value: no shared-memory segment per batch
            labels = labels.as_subclass(InlineTensor)
            boxes = None if boxes is None else boxes.as_subclass(InlineTensor)
        if self.transform is not None:
            batch = CacheBatch(images, labels, boxes)
            return [(self.transform(s[0]), *s[1:]) for s in batch]
        return CacheBatch(images, labels, boxes)


def _zarr_chunk_path(root: Path, k: int, ndim: int, sep: str) -> Path:
    return root / ZARR_NAME / sep.join(["c", str(k), *["0"] * (ndim - 1)])


def _check_raw_zarr(root: Path, manifest: Manifest, chunk: int) -> bool:
    """True when the zarr images are uncompressed local chunk files that can be memory-mapped directly.

    zarr decodes whole chunks, so a random sample costs a whole chunk read through the zarr API (64x
    the bytes for 64-sample chunks). With only the ``bytes`` codec a chunk file *is* the C-order rows,
    so it is mapped like an npy shard. Truncated chunk files are reported here, in the constructor.
    """
    import json

    try:
        meta = json.loads((root / ZARR_NAME / "zarr.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    codecs = meta.get("codecs", [])
    if meta.get("fill_value", 0) != 0:
        return False
    enc = meta.get("chunk_key_encoding", {})
    if (len(codecs) != 1 or codecs[0].get("name") != "bytes" or meta.get("storage_transformers")
            or enc.get("name") != "default" or enc.get("configuration", {}).get("separator", "/") != "/"
            or meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape") != [chunk, *manifest.shape]):
        return False
    row = manifest.sample_nbytes
    for k in range(-(-manifest.count // chunk)):
        path = _zarr_chunk_path(root, k, 4, "/")
        if path.is_file() and path.stat().st_size != chunk * row:
            raise CacheCorruptError(f"zarr chunk {path} holds {path.stat().st_size} bytes, expected {chunk * row}")
    return True


def _raw_zarr_chunk(root: Path, k: int, chunk: int, shape: tuple[int, int, int]) -> np.ndarray:
    path = _zarr_chunk_path(root, k, 4, "/")
    if not path.is_file():  # zarr leaves all-fill chunks unwritten; fill_value is 0
        return np.broadcast_to(np.uint8(0), (chunk, *shape))
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(chunk, *shape)).view(np.ndarray)


def _default_budget() -> int:
    """Half of MemAvailable (Linux); 0 (never automatic) where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 0
