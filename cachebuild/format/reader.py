"""Open a finished cache: validated manifest, memory-mapped images, side arrays, verification."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import CacheCorruptError
from cachebuild.format.manifest import Manifest, read_manifest
from cachebuild.format.storage import (
    load_array,
    load_paths,
    open_npy_shards,
    open_zarr_images,
    sha256_bytes,
)

__all__ = ["CacheReader", "open_cache"]

_VERIFY_ROWS = 256  # hash in slices so verifying a 150 GB cache never holds more than ~40 MB


class CacheReader:
    """A read-only view of one cache folder.

    Opening validates the manifest and checks every shard's header against it (no pixel is read), so a
    missing, truncated or mis-shaped file is a named error here, not a crash later in a DataLoader worker.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = Path(path)
        self.manifest: Manifest = read_manifest(self.root)
        self.images: list[np.ndarray] | Any = self._open_images()
        self.labels: np.ndarray = load_array(self.root, self.manifest, "labels")
        self.sizes: np.ndarray = load_array(self.root, self.manifest, "sizes")
        self.boxes: np.ndarray | None = (
            load_array(self.root, self.manifest, "boxes") if "boxes" in self.manifest.arrays else None
        )

    def _open_images(self) -> list[np.ndarray] | Any:
        if self.manifest.storage == "npy":
            return open_npy_shards(self.root, self.manifest)
        return open_zarr_images(self.root, self.manifest)

    def __len__(self) -> int:
        return self.manifest.count

    @property
    def shard_starts(self) -> np.ndarray:
        """Start index of every shard, plus ``count`` at the end (for ``np.searchsorted``)."""
        return np.array([s.start for s in self.manifest.shards] + [self.manifest.count], dtype=np.int64)

    def array(self, name: str) -> np.ndarray:
        return load_array(self.root, self.manifest, name)

    def paths(self) -> list[str]:
        """Provenance: the source path (relative to the source root) of every sample."""
        return load_paths(self.root, self.manifest)

    def read(self, indices: np.ndarray | list[int]) -> np.ndarray:
        """Gather samples ``indices`` into one (N, H, W, C) array, one sorted read per shard."""
        idx = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(idx), *self.manifest.shape), dtype=np.uint8)
        if len(idx) == 0:
            return out
        if idx.min() < 0 or idx.max() >= self.manifest.count:
            raise IndexError(f"sample index out of range [0, {self.manifest.count})")
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        if self.manifest.storage == "zarr":
            out[order] = self.images.get_orthogonal_selection((sorted_idx,))
            return out
        starts = self.shard_starts
        shard_of = np.searchsorted(starts, sorted_idx, side="right") - 1
        bounds = np.flatnonzero(np.diff(shard_of)) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(sorted_idx)], strict=True):
            s = int(shard_of[lo])
            out[order[lo:hi]] = self.images[s][sorted_idx[lo:hi] - starts[s]]
        return out

    def verify(self) -> list[str]:
        """Re-hash every shard and side array; return one line per mismatch (empty: intact)."""
        problems = []
        for i, s in enumerate(self.manifest.shards):
            h = hashlib.sha256()
            for lo in range(s.start, s.start + s.count, _VERIFY_ROWS):
                hi = min(lo + _VERIFY_ROWS, s.start + s.count)
                if self.manifest.storage == "npy":
                    block = self.images[i][lo - s.start : hi - s.start]
                else:
                    block = self.images[lo:hi]
                h.update(memoryview(np.ascontiguousarray(block)).cast("B"))
            if h.hexdigest() != s.sha256:
                problems.append(f"{s.file} samples [{s.start}, {s.start + s.count}): checksum mismatch")
        for name, info in self.manifest.arrays.items():
            path = self.root / info.file
            try:
                if info.dtype == "str":
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                else:
                    digest = sha256_bytes(load_array(self.root, self.manifest, name))
            except (OSError, CacheCorruptError) as e:
                problems.append(f"{info.file}: {e}")
                continue
            if digest != info.sha256:
                problems.append(f"{info.file}: checksum mismatch")
        return problems


def open_cache(path: str | os.PathLike[str]) -> CacheReader:
    """Open and validate the cache at ``path`` (a folder holding ``manifest.json``)."""
    return CacheReader(path)
