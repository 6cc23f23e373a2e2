"""CachedImageDataset: a map-style torch Dataset over a cachebuild cache, from a local folder or a URL.

The hot path of every epoch. A batch is one sorted pass over the requested samples, each row copied once
into its slot of a single uint8 (B, H, W, 3) buffer (in a DataLoader worker: a slot of the worker's ring of
reused shared-memory batches, ``loaders.batch_ring``, so handing it over copies nothing). No decode, no
per-image tensor, no stacking: ``__getitems__`` returns a :class:`CacheBatch` that :func:`collate_batch`
passes through. How pixels are read is the storage kind's business (``cachebuild.storage``); what a read
does not ask for (the ring outside workers, in-RAM mode, crops, encoded batches) is not imported on it.

Process model: the constructor validates the whole cache in the calling process (a missing, truncated or
mis-shaped shard is a named error there, never in a worker) and keeps nothing open but a shared lock on a
local cache folder (a ``--force`` rebuild then leaves this dataset reading the old cache whole). Each
process maps or fetches what it touches on first use; the pickled state holds only the location, the
manifest and the small per-sample arrays.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from cachebuild.errors import CacheChangedError
from cachebuild.format import Manifest
from cachebuild.format.manifest import check_fingerprint
from cachebuild.storage import ImageStore
from cachebuild.storage.cache import load_column, load_paths, map_array, open_cache
from cachebuild.storage.locations import ReaderLock
from loaders.collate import CacheBatch, collate_batch
from loaders.dataset_options import DatasetOptions
from loaders.sample_transform import apply_transform

if TYPE_CHECKING:
    from loaders.batch_ring import ProcessRing
    from loaders.worker_crop import CropPlan

__all__ = ["CacheBatch", "CachedImageDataset", "DatasetOptions", "collate_batch"]


def _whole_boxes(shape: tuple[int, ...], n: int) -> np.ndarray:
    """int32 (n, 4) boxes covering whole (H, W, ...) samples: every pixel valid."""
    return np.tile(np.array([0, 0, shape[0], shape[1]], dtype=np.int32), (n, 1))


def _new_batch(shape: tuple[int, ...], dtype: np.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised uint8 (or float32) tensor; in shared memory when it will cross a process boundary."""
    tdtype = torch.from_numpy(np.empty(0, dtype)).dtype
    if not shared:
        return torch.empty(shape, dtype=tdtype)
    from loaders.shared_memory import shared_uint8

    # Allocated straight in shared memory (as default_collate does for its stack) rather than
    # share_memory_() afterwards, which would copy the batch once more.
    return shared_uint8((*shape[:-1], shape[-1] * dtype.itemsize)).view(tdtype)  # float32: 4 bytes a value


def _inline(batch: CacheBatch) -> CacheBatch:
    """A batch's small tensors made to cross to the main process by value (``batch_ring.InlineTensor``)."""
    from loaders.batch_ring import InlineTensor

    return CacheBatch(batch.images, batch.labels.as_subclass(InlineTensor),
                      None if batch.boxes is None else batch.boxes.as_subclass(InlineTensor),
                      tuple(c.as_subclass(InlineTensor) for c in batch.columns))


def _label_column(values: np.ndarray, name: str, manifest: Manifest, where: str) -> np.ndarray:
    """Column ``name`` checked as labels: int (N,) class indices, or float (N, C) soft labels, C the classes."""
    c = len(manifest.classes)
    if values.dtype.kind in "iu" and values.ndim == 1:
        if values.size and (values.min() < 0 or values.max() >= c):
            raise ValueError(f"{where}: column {name!r} holds labels in [{values.min()}, {values.max()}], the "
                             f"cache has {c} classes; relabel within [0, {c - 1}]")
        return np.ascontiguousarray(values, dtype=np.int64)
    if values.dtype.kind == "f" and values.ndim == 2 and values.shape[1] == c:
        return values.astype(np.float32, copy=False)  # the loss's dtype (a float32 column stays mapped)
    raise ValueError(f"{where}: column {name!r} is {values.dtype}{list(values.shape)}; labels are integer (N,) "
                     f"class indices or float (N, {c}) soft labels")


class CachedImageDataset(Dataset):
    """A cachebuild cache as a map-style dataset: ``ds[i] -> (uint8 HWC tensor, int label[, box], *columns)``.

    ``root``: the cache folder or its URL (``s3://``, ``gs://``, ``https://``, ``file://``); ``options``: every
    other setting (:class:`~loaders.dataset_options.DatasetOptions`). Opening validates the manifest and every
    shard header (``CacheNotFoundError``, ``UnsupportedFormatError``, ``CacheCorruptError``), then closes the
    files. ``transform``, ``return_boxes``, ``ring_slots`` and ``decode`` are attributes a loader may set
    afterwards; the crop in the workers is :attr:`crop` (a ``CropPlan`` or None), set with :meth:`set_crop`.
    """

    def __init__(self, root: str | os.PathLike[str], options: DatasetOptions | None = None) -> None:
        o = options if options is not None else DatasetOptions()
        if not isinstance(o, DatasetOptions):
            raise TypeError(f"options must be a loaders.dataset.DatasetOptions, got {type(o).__name__}")
        # Validates the manifest and every shard/chunk header, here in the caller, never in a worker.
        reader = open_cache(root, local_cache=o.local_cache, local_cache_bytes=o.local_cache_bytes,
                            storage_options=None if o.storage_options is None else dict(o.storage_options))
        if o.expect_fingerprint is not None:
            check_fingerprint(reader.manifest, o.expect_fingerprint, reader.location.describe())
        self.root: Path | str = reader.root
        self.location = reader.location
        self.manifest: Manifest = reader.manifest
        self._images: ImageStore = reader.images
        self._images.decode_threads = o.decode_threads
        self.decode: str = o.decode
        self._reader_lock = reader._lock  # held while this dataset lives in this process (never pickled)
        self.transform = o.transform
        self.transform_input = o.transform_input
        self.return_boxes = bool(o.return_boxes)
        self.ring_slots = int(o.ring_slots)
        self._labels: np.ndarray = np.ascontiguousarray(reader.labels, dtype=np.int64)
        # Columns (format version 3) as the manifest opened names them: mapped locally, read whole at a URL.
        self.column_names, self.label_column = o.columns, o.labels
        self._columns: dict[str, np.ndarray] | None = {n: reader.column(n) for n in o.columns}
        if o.labels is not None:
            self._labels = _label_column(reader.column(o.labels), o.labels, self.manifest, reader.location.describe())
        self.sizes: np.ndarray = reader.sizes
        self._boxes: np.ndarray | None = reader.boxes
        del reader
        self._paths: list[str] | None = None
        self._shared: torch.Tensor | None = None
        self._ring: ProcessRing | None = None  # a DataLoader worker's reused batches, made there
        self.crop: CropPlan | None = None
        if o.crop is not None:
            self.set_crop(o.crop, o.seed, o.normalize, flip=o.flip)
        if o.in_memory:
            from loaders.shared_memory import auto_budget, load_shared

            if o.in_memory is True or self.nbytes <= auto_budget(o.memory_budget):
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
        return self._boxes if self._boxes is not None else _whole_boxes(self.shape, len(self))

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
        """Samples per natural read unit of the storage (a zarr chunk, ~8 MB of npy rows)."""
        return self._images.chunk_size

    def file_bounds(self) -> np.ndarray:  # each stored file's first sample, then the count (CacheSampler)
        return self._images.file_bounds()

    def read_files_whole(self) -> None:  # CacheSampler(shard_window=): fetch each remote file touched whole
        self._images.read_files_whole()

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
        # _shared (in shared memory) travels by handle through torch's multiprocessing reductions; the lock
        # stays with the opening process (its workers die before it does), a ring with the process that made it.
        state = {**self.__dict__, "_reader_lock": None, "_paths": None, "_ring": None}
        if self.location.is_local:  # memory-mapped side arrays: each process maps them again
            state["_labels"] = state["sizes"] = state["_boxes"] = state["_columns"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._labels is None:  # mapped, not copied: nothing proportional to N travels to a worker
            self._labels = np.ascontiguousarray(map_array(self.location, self.manifest, "labels"), dtype=np.int64)
            self.sizes = map_array(self.location, self.manifest, "sizes")
            self._boxes = map_array(self.location, self.manifest, "boxes") if "boxes" in self.manifest.arrays else None
            self._columns = {n: load_column(self.location, self.manifest, n) for n in self.column_names}
            if self.label_column is not None:  # checked at open: the same file (its name holds its checksum)
                self._labels = load_column(self.location, self.manifest, self.label_column)
                self._labels = self._labels.astype(np.int64 if self._labels.ndim == 1 else np.float32, copy=False)
        # A copy (a DataLoader worker's, a job's) holds its own shared lock on the folder it reads, so that
        # a --force rebuild keeps that folder for as long as any copy lives, not only the original.
        if getattr(self.location, "identity", None) is not None:
            with contextlib.suppress(CacheChangedError):  # already gone: the first read says so, by name
                self._reader_lock = ReaderLock(self.location.local_path())

    # ------------------------------------------------------------------ reading
    def _indices(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """``indices`` as int64 sample numbers in [0, N), negative ones counted from the end. Only integers:
        a float cast truncates (2.7 would read sample 2), a boolean mask would read samples 1 and 0, and a
        uint64 past the end would wrap round to other samples."""
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
        """Read samples ``indices`` (in that order) into ``out`` (uint8 (B, H, W, 3), allocated if None): reads in
        ascending sample order, each row copied once; safe from several threads (the copies release the GIL)."""
        idx = self._indices(indices)
        if out is None:
            out = np.empty((len(idx), *self.shape), dtype=np.uint8)
        elif out.shape != (len(idx), *self.shape) or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8{[len(idx), *self.shape]}, got {out.dtype}{list(out.shape)}")
        if len(idx) == 0:
            return out
        if self._shared is not None:
            # mode="clip": indices are checked above; the default mode="raise" buffers `out` (a 2nd copy).
            np.take(self._shared.numpy(), idx, axis=0, out=out, mode="clip")
            return out
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        self._images.gather(idx, out)
        return out

    def valid_boxes(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """int32 (B, 4) valid boxes ``(y0, x0, y1, x1)`` of samples ``indices``; full images when the cache has none."""
        idx = self._indices(indices)
        return self._boxes[idx] if self._boxes is not None else _whole_boxes(self.shape, len(idx))

    def sample_views(self, indices: Sequence[int] | np.ndarray) -> list[np.ndarray] | None:
        """Read-only (H, W, 3) views of samples ``indices`` where they lie in this process's memory
        (``in_memory``, or a local cache's memory maps), no copy; None where a read must copy (zarr chunks,
        JPEG payloads, a URL): then :meth:`gather` them."""
        idx = self._indices(indices)
        if self._shared is None:
            local_rows = getattr(self._images, "local_rows", None)  # npy stores have memory maps to view
            return None if local_rows is None else local_rows(idx)
        rows = self._shared.numpy().view()
        rows.flags.writeable = False
        return [rows[i] for i in idx.tolist()]

    # ------------------------------------------------------------------ crop in the workers
    def set_crop(self, crop: Any, seed: int = 0, normalize: tuple[Sequence[float], Sequence[float]] | None = None,
                 *, flip: bool | float | None = None) -> None:
        """Crop in the workers as ``DatasetOptions(crop=, seed=, normalize=)`` says (None: none); before loaders
        are made (``flip``: the previous release's spelling of the crop's ``flip_p``)."""
        if crop is None:
            self.crop = None
            if normalize is not None or flip:
                raise ValueError("normalize and flip need crop=RandomResizedCrop(...) or CenterCrop(...)")
            return
        from loaders.worker_crop import CropPlan

        self.crop = CropPlan(crop, seed, normalize, flip)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the crop boxes and flips are drawn for (seen by persistent workers at their next batch);
        :class:`~loaders.sampler.CacheSampler` calls it from its own ``set_epoch``."""
        if self.crop is not None:
            self.crop.set_epoch(epoch)

    def set_resolution(self, size: int | Sequence[int] | Callable[[int], int | Sequence[int]]) -> None:
        """Output size of the crop from the next batch on (progressive resizing), or a schedule (epoch -> size,
        e.g. ``worker_crop.progressive``) that every :meth:`set_epoch` applies; call between epochs."""
        if self.crop is None:
            raise ValueError("set_resolution needs a dataset made with crop=RandomResizedCrop(...) or CenterCrop(...)")
        if callable(size):
            self.crop.schedule = size
            self.crop.set_size(size(self.crop.epoch))
        else:
            self.crop.set_size(size)

    @property
    def resolution(self) -> tuple[int, int] | None:
        """(h, w) of the batches' images under ``crop``; None without one."""
        return None if self.crop is None else self.crop.size

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """(H, W, 3) of a sample as batches carry it: the crop size under ``crop``, else :attr:`shape`."""
        return self.shape if self.crop is None else self.crop.output_shape

    @property
    def output_dtype(self) -> np.dtype:
        """numpy dtype of the batches' images: uint8, float32 under ``normalize``."""
        return np.dtype(np.uint8) if self.crop is None else self.crop.output_dtype

    def load_batch(self, indices: Sequence[int] | np.ndarray, images: torch.Tensor) -> CacheBatch:
        """Samples ``indices`` as a batch, their pixels written into ``images`` (uint8 (B, h, w, 3), of
        :attr:`output_shape` when the batch is made): cropped by :attr:`crop`, else gathered whole; with their
        labels and, under ``return_boxes``, the boxes of what ``images`` holds (all of it once cropped)."""
        idx = self._indices(indices)
        out = images.numpy()
        if self.crop is None:
            self.gather(idx, out)
        else:
            self.crop.gather(self, idx, out)
        labels = torch.from_numpy(self._labels[idx])
        if not self.return_boxes:
            return CacheBatch(images, labels, None, self._column_values(idx))
        boxes = self.valid_boxes(idx) if self.crop is None else _whole_boxes(out.shape[1:], len(idx))
        return CacheBatch(images, labels, torch.from_numpy(boxes), self._column_values(idx))

    def _column_values(self, idx: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The asked-for columns' rows ``idx``, in ``DatasetOptions.columns`` order."""
        assert self._columns is not None
        return tuple(torch.from_numpy(np.ascontiguousarray(self._columns[n][idx])) for n in self.column_names)

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` of the cache as opened (one of ``DatasetOptions.columns``), all rows, read-only."""
        if self._columns is None or name not in self._columns:
            raise KeyError(f"column {name!r} was not asked for: open with DatasetOptions(columns=[{name!r}])")
        v = self._columns[name].view()
        v.flags.writeable = False
        return v

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
        batch = self.load_batch(np.array([i]), _new_batch((1, *self.output_shape), self.output_dtype, False))
        sample = batch[0]
        img: Any = sample[0]
        if self.transform is not None:
            img = apply_transform(self.transform, img, self.transform_input)
        return (img, *sample[1:])

    def __getitems__(self, indices: Sequence[int]) -> CacheBatch | list[tuple[Any, ...]]:
        """A whole batch in one pass: a :class:`CacheBatch` (see :func:`collate_batch`).

        With a ``transform`` it returns per-sample tuples instead, for ``default_collate`` to stack.
        """
        idx = self._indices(indices)
        worker = get_worker_info() is not None  # in a DataLoader worker process
        if (self.decode == "none" and self._images.encoded and self.transform is None and self._shared is None
                and self.crop is None):
            return self._encoded_batch(idx, worker)
        shape = (len(idx), *self.output_shape)
        images: torch.Tensor | None = None
        if worker and self.transform is None and self.ring_slots:
            if self._ring is None:
                from loaders.batch_ring import ProcessRing

                self._ring = ProcessRing()
            images = self._ring.take(self.ring_slots, shape, self.output_dtype)
        if images is None:
            images = _new_batch(shape, self.output_dtype, shared=worker)
        batch = self.load_batch(idx, images)
        if worker and self.ring_slots:  # small tensors by value: no shared-memory segment per batch
            batch = _inline(batch)
        if self.transform is not None:
            return [(apply_transform(self.transform, s[0], self.transform_input), *s[1:]) for s in batch]
        return batch

    def _encoded_batch(self, idx: np.ndarray, worker: bool) -> CacheBatch:
        """The batch's stored JPEGs, checked against their checksums, undecoded (for decoding on a GPU)."""
        from loaders.encoded import EncodedImages

        data, offsets = self._images.read_encoded(idx)
        labels = torch.from_numpy(self._labels[idx])
        boxes = torch.from_numpy(self.valid_boxes(idx)) if self.return_boxes else None
        images = EncodedImages(torch.from_numpy(data), torch.from_numpy(offsets), self.shape)
        batch = CacheBatch(images, labels, boxes, self._column_values(idx))  # type: ignore[arg-type]
        return _inline(batch) if worker else batch  # small tensors by value; the payload crosses in shared memory
