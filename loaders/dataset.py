"""CachedImageDataset: a map-style torch Dataset over a cachebuild cache, from a local folder or a URL.

The hot path of every epoch. A batch is one sorted pass over the requested samples, each row copied
once, straight into its slot of a single uint8 (B, H, W, 3) buffer (in shared memory when running in a
``DataLoader`` worker, so handing it to the main process copies nothing). No decode, no per-image
tensor, no stacking: ``__getitems__`` returns a :class:`CacheBatch` and :func:`collate_batch` passes it
through as ``(images, labels[, boxes])``. In a worker that buffer is a slot of a per-worker ring of
reused shared-memory batches (``loaders.batch_ring``): mapped once by both processes, so a batch costs
no fresh page faults on either side.

How the pixels are read is the cache's storage backend's business (``cachebuild.storage``: memory maps
of npy shards or raw zarr chunks locally, byte ranges through fsspec for URLs, zarr-python for
compressed chunks); this module only asks its image store to gather a batch into a buffer.

Process model: the constructor validates the whole cache in the calling process (so a missing,
truncated or mis-shaped shard is a named error there, never inside a worker) and keeps nothing open
but a shared lock on a local cache folder (a ``--force`` rebuild then leaves this dataset reading the
old cache whole). Each process maps or fetches what it touches lazily on first use; the pickled state
holds only the location, the manifest and the small per-sample arrays.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from cachebuild.errors import CacheChangedError
from cachebuild.format import Manifest
from cachebuild.format.identity import check_fingerprint
from cachebuild.storage import BlockCache, ImageStore
from cachebuild.storage.cache.reader import open_cache
from cachebuild.storage.kinds.side_arrays import load_paths, map_array
from cachebuild.storage.locations.replacement import ReaderLock
from loaders.batch_ring import MAX_SLOTS, InlineTensor, WorkerRing, rings_fit
from loaders.collate import CacheBatch, collate_batch
from loaders.dataset_crop import WorkerCropMixin
from loaders.encoded import EncodedImages
from loaders.shared_memory import auto_budget, load_shared, shared_uint8
from loaders.worker_crop import CropSpec

__all__ = ["CacheBatch", "CachedImageDataset", "collate_batch"]

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


class CachedImageDataset(WorkerCropMixin, Dataset):
    """A cachebuild cache as a map-style dataset: ``ds[i] -> (uint8 HWC tensor, int label[, box])``.

    Args:
        root: the cache folder (holding ``manifest.json``), or its URL (``s3://``, ``gs://``, ``https://``,
            ``file://``); the storage kind is read from the manifest.
        transform: optional per-sample CPU callable applied to the uint8 HWC tensor. With it, batches
            are collated sample by sample (slower); the fast path is ``transform=None`` plus device-side
            transforms on the batch.
        return_boxes: also return the valid box ``(y0, x0, y1, x1)`` int32 (end-exclusive) of each sample.
            Caches built with ``--fit pad`` store it; for other caches every pixel is valid, so the box is
            the full image ``(0, 0, H, W)``.
        in_memory: ``False`` reads through memory maps (page cache); ``True`` loads the whole cache once
            into shared memory that every DataLoader worker sees (fork or spawn, no per-worker copy);
            ``"auto"`` does so when the images fit ``memory_budget`` and half of the space free in
            /dev/shm (the other half is left to batches in flight: containers often keep it small),
            both split between the ``LOCAL_WORLD_SIZE`` processes torchrun starts on a node, each of
            which loads its own copy.
        memory_budget: bytes one process may load for ``in_memory="auto"``; default half of the
            available RAM, split as above.
        ring_slots: reused batch slots per ``DataLoader`` worker (``loaders.batch_ring``); costs
            ``ring_slots`` x batch bytes of shared memory per worker (5 x 38.5 MB for 256 x 224 x 224 x 3),
            mapped by the worker and the main process. Use ``prefetch_factor + 3`` when raising the
            DataLoader's ``prefetch_factor``; 0 allocates a fresh shared batch every time (the old path).
            A batch that finds no free slot (e.g. the loop keeps every batch) gets a fresh one.
        local_cache: for a URL, a local folder where fetched blocks are kept (bounded by
            ``local_cache_bytes``, shared safely by workers and jobs), so later epochs read local disk.
        storage_options: fsspec options for a URL (credentials normally come from the store's config).
        expect_fingerprint: a prefix (8+ hex digits) of the cache's fingerprint, i.e. its build key, as
            ``cachebuild info`` / ``ls`` show it: opening a rebuilt or different cache then raises
            ``FingerprintMismatchError`` naming both, instead of training on other data.
        decode: for compact caches (``--codec jpeg``): ``"cpu"`` decodes each batch where it is read (a small
            pool of threads per process, ``decode_threads`` of them; default: the CPUs divided among the
            DataLoader's workers, at most 4); ``"none"`` makes batches carry the stored JPEGs undecoded
            (:class:`~loaders.encoded.EncodedImages`) for ``device_loader(..., decode="cuda")``, which sets
            it. Raw caches have nothing to decode and ignore both.
        crop: crop in the loader's workers (``loaders.worker_crop``): a
            :class:`~loaders.worker_crop.RandomResizedCrop` (train) or :class:`~loaders.worker_crop.CenterCrop`
            (eval). Each sample is cropped inside its valid box and resized straight into the batch, which is
            then uint8 (B, size, size, 3): the device side only normalizes. Boxes and flips are a pure function
            of (``seed``, epoch, sample index); set the epoch with :meth:`set_epoch` (or an
            :class:`~loaders.worker_crop.EpochSampler`) and the output size with :meth:`set_resolution`.
        flip: with a ``RandomResizedCrop``, mirror each sample left-right with probability 0.5
            (``True``) or the given probability.
        seed: the seed of the crop boxes and flips.

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
        local_cache: str | os.PathLike[str] | BlockCache | None = None,
        local_cache_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        expect_fingerprint: str | None = None,
        decode: str = "cpu",
        decode_threads: int | None = None,
        crop: CropSpec | None = None,
        flip: bool | float = False,
        seed: int = 0,
    ) -> None:
        if decode not in ("cpu", "none"):
            raise ValueError(f"decode must be 'cpu' or 'none', got {decode!r}")
        if decode_threads is not None and decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1 or None, got {decode_threads}")
        if in_memory not in (True, False, "auto"):
            raise ValueError(f"in_memory must be True, False or 'auto', got {in_memory!r}")
        if not 0 <= ring_slots <= MAX_SLOTS:
            raise ValueError(f"ring_slots must be in 0..{MAX_SLOTS}, got {ring_slots}")
        # Validates the manifest and every shard/chunk header, here in the caller, never in a worker.
        reader = open_cache(root, local_cache=local_cache, local_cache_bytes=local_cache_bytes,
                            storage_options=storage_options)
        if expect_fingerprint is not None:
            check_fingerprint(reader.manifest, expect_fingerprint, reader.location.describe())
        self.root: Path | str = reader.root
        self.location = reader.location
        self.manifest: Manifest = reader.manifest
        self._images: ImageStore = reader.images
        self._images.decode_threads = decode_threads
        self.decode = decode
        self._reader_lock = reader._lock  # held while this dataset lives in this process (never pickled)
        self.transform = transform
        self.return_boxes = bool(return_boxes)
        self.ring_slots = int(ring_slots)
        self._labels: np.ndarray = np.ascontiguousarray(reader.labels, dtype=np.int64)
        self.sizes: np.ndarray = reader.sizes
        self._boxes: np.ndarray | None = reader.boxes
        del reader
        self._paths: list[str] | None = None
        self._pid = os.getpid()
        self._shared: torch.Tensor | None = None
        self._ring: WorkerRing | None = None  # per worker process, made on its first batch
        self._ring_failed = False  # shared memory refused (small /dev/shm): fresh batches in this process
        self.set_crop(crop, flip, seed)
        if in_memory == "auto":
            in_memory = self.nbytes <= auto_budget(memory_budget)
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
            self._paths = load_paths(self.location, self.manifest)
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
        return self._images.chunk_size

    @property
    def encoded(self) -> bool:
        """True for compact caches: samples are stored encoded and decoded on read."""
        return self._images.encoded

    @property
    def bytes_fetched(self) -> int:
        """Bytes this process has fetched from a remote cache (0 for local caches)."""
        return self._images.bytes_fetched

    def __repr__(self) -> str:
        m = self.manifest
        return (f"CachedImageDataset({str(self.root)!r}, n={m.count}, shape={m.shape}, storage={m.storage!r}, "
                f"classes={len(m.classes)}, in_memory={self.in_memory})")

    # ------------------------------------------------------------------ processes
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader_lock"] = None  # the opening process holds it; its workers die before it does
        state["_paths"] = None
        state["_ring"] = None
        state["_ring_failed"] = False
        if self.location.is_local:  # memory-mapped side arrays: each process maps them again (storage.side_arrays)
            state["_labels"] = state["sizes"] = state["_boxes"] = None
        # _shared (a torch tensor in shared memory) travels by handle through torch's multiprocessing
        # reductions (DataLoader workers, fork or spawn); a plain pickle.dumps copies it, as for any tensor.
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = -1
        if self._labels is None:  # mapped, not copied: nothing proportional to N travels to a worker
            self._labels = np.ascontiguousarray(map_array(self.location, self.manifest, "labels"), dtype=np.int64)
            self.sizes = map_array(self.location, self.manifest, "sizes")
            self._boxes = map_array(self.location, self.manifest, "boxes") if "boxes" in self.manifest.arrays else None
        # A copy (a DataLoader worker's, a job's) holds its own shared lock on the folder it reads, so that
        # a --force rebuild keeps that folder for as long as any copy lives, not only the original.
        if getattr(self.location, "identity", None) is not None:
            with contextlib.suppress(CacheChangedError):  # already gone: the first read says so, by name
                self._reader_lock = ReaderLock(self.location.local_path())

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked or unpickled: another process's ring is not ours
            self._ring = None
            self._ring_failed = False
            self._pid = os.getpid()

    # ------------------------------------------------------------------ reading
    def _indices(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """``indices`` as int64 sample numbers in [0, N), negative ones counted from the end.

        Only integers: casting floats truncates (2.7 would read sample 2), a boolean mask would read samples
        1 and 0, and a uint64 past the end would wrap round to the last samples, i.e. other samples.
        """
        idx = np.asarray(indices).reshape(-1)
        if idx.dtype.kind not in "iu" and idx.size:  # an empty list is float64: nothing to read either way
            raise TypeError(f"sample indices must be integers, got {idx.dtype} ({indices!r:.60})")
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):  # before any cast: uint64 compares as itself
            bad = idx[(idx < -n) | (idx >= n)][0]
            raise IndexError(f"sample index {int(bad)} is out of range for a cache of {n} samples")
        idx = idx.astype(np.int64, copy=False)
        return np.where(idx < 0, idx + n, idx)

    def gather(self, indices: Sequence[int] | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Read samples ``indices`` (in that order) into ``out`` (uint8 (B, H, W, 3), allocated if None).

        Reads go in ascending sample order (sequential within each shard); each row is copied once.
        Safe to call from several threads at once (numpy releases the GIL while copying).
        """
        idx = self._indices(indices)
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
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        self._images.gather(idx, out)
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
            if not rings_fit(self.ring_slots, nbytes):
                self._ring_failed = True
                return None
            try:
                ring = self._ring = WorkerRing(self.ring_slots, nbytes, retire=None if ring is None else ring.key)
            except RuntimeError:  # e.g. /dev/shm too small for the ring: one fresh batch at a time may fit
                self._ring_failed = True
                return None
        return ring.take(shape)

    def __getitem__(self, index: int | Sequence[int] | np.ndarray | torch.Tensor) -> tuple[Any, ...]:
        """One sample ``(image, label[, box])``; a 1-D list/array/tensor of indices gives the batch
        ``(images, labels[, boxes])`` as :func:`collate_batch` does (``DataLoader(batch_size=None,
        sampler=BatchSampler(...))``, torch's pattern for datasets that load whole batches)."""
        if isinstance(index, (list, tuple)) or getattr(index, "ndim", 0) > 0:
            return tuple(collate_batch(self.__getitems__(index)))  # type: ignore[arg-type]
        i = operator.index(index)  # type: ignore[arg-type]  # not int(): it truncates a float to another sample
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} is out of range for a cache of {len(self)} samples")
        i %= len(self)
        if self.crop is None:
            img: Any = torch.from_numpy(self.gather([i])[0])
        else:
            img = torch.from_numpy(self.gather_cropped([i], np.empty((1, *self.output_shape), np.uint8))[0])
        if self.transform is not None:
            img = self.transform(img)
        label = int(self._labels[i])
        if self.return_boxes:
            return img, label, torch.from_numpy(self._boxes_out(np.array([i]), (1, *img.shape))[0])
        return img, label

    def __getitems__(self, indices: Sequence[int]) -> CacheBatch | list[tuple[Any, ...]]:
        """A whole batch in one pass: a :class:`CacheBatch` (see :func:`collate_batch`).

        With a ``transform`` it returns per-sample tuples instead, for ``default_collate`` to stack.
        """
        idx = self._indices(indices)
        shape = (len(idx), *self.output_shape)
        worker = _in_worker()
        if (self.decode == "none" and self._images.encoded and self.transform is None and self._shared is None
                and self.crop is None):
            return self._encoded_batch(idx, worker)
        images = self._slot(shape) if worker and self.transform is None and self.ring_slots else None
        if images is None:
            images = _new_uint8(shape, shared=worker)
        self.load_batch(idx, _as_writable_numpy(images))
        labels = torch.from_numpy(self._labels[idx])
        boxes = torch.from_numpy(self._boxes_out(idx, shape)) if self.return_boxes else None
        if worker and self.ring_slots:  # small tensors by value: no shared-memory segment per batch
            labels = labels.as_subclass(InlineTensor)
            boxes = None if boxes is None else boxes.as_subclass(InlineTensor)
        if self.transform is not None:
            batch = CacheBatch(images, labels, boxes)
            return [(self.transform(s[0]), *s[1:]) for s in batch]
        return CacheBatch(images, labels, boxes)

    def _encoded_batch(self, idx: np.ndarray, worker: bool) -> CacheBatch:
        """The batch's stored JPEGs, checked against their checksums, undecoded (for decoding on a GPU)."""
        data, offsets = self._images.read_encoded(idx)
        labels = torch.from_numpy(self._labels[idx])
        boxes = torch.from_numpy(self._boxes_at(idx)) if self.return_boxes else None
        if worker:  # small tensors by value; the payload crosses in shared memory like any tensor
            labels = labels.as_subclass(InlineTensor)
            boxes = None if boxes is None else boxes.as_subclass(InlineTensor)
        images = EncodedImages(torch.from_numpy(data), torch.from_numpy(offsets), self.shape)
        return CacheBatch(images, labels, boxes)  # type: ignore[arg-type]
