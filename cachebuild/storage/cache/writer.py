"""Finishing a cache: side arrays, manifest last, then one rename of the staging folder into place."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.atomic import fsync_dir, write_bytes_atomic
from cachebuild.errors import CacheExistsError, OptionError
from cachebuild.format.manifest import MANIFEST_NAME, SHA256, ArrayInfo, Failure, Manifest, ShardInfo, manifest_bytes
from cachebuild.storage import get_backend
from cachebuild.storage.cache.file_table import is_unfinished_write, with_file_table
from cachebuild.storage.cache.provenance import built_by
from cachebuild.storage.kinds.base import BlockRecord
from cachebuild.storage.kinds.jpeg import codec as jpeg_codec
from cachebuild.storage.kinds.side_arrays import array_digest, save_array, save_paths
from cachebuild.storage.locations.replacement import set_aside, sweep_replaced

__all__ = ["commit_cache", "install_staged", "remove_unfinished_writes", "save_side_arrays", "staging_path",
           "tool_versions", "utc_now", "write_cache"]


def staging_path(out: Path) -> Path:
    """The build folder beside ``out`` (same filesystem, so the final rename is atomic)."""
    return out.with_name(out.name + ".partial")


def tool_versions() -> dict[str, Any]:
    import cv2

    from cachebuild import __version__

    return {
        "name": "cachebuild",
        "version": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "opencv": cv2.__version__,
    }


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def save_side_arrays(
    staging: Path,
    labels: np.ndarray,
    sizes: np.ndarray,
    paths: list[str],
    boxes: np.ndarray | None = None,
    extra_labels: dict[str, np.ndarray] | None = None,
) -> dict[str, ArrayInfo]:
    """The per-sample arrays beside the images, in their on-disk dtypes; returns the manifest's ``arrays``."""
    arrays = {
        "labels": save_array(staging, "labels", np.asarray(labels, dtype=np.int64)),
        "sizes": save_array(staging, "sizes", np.asarray(sizes, dtype=np.int32)),
        "paths": save_paths(staging, paths),
    }
    if boxes is not None:
        arrays["boxes"] = save_array(staging, "boxes", np.asarray(boxes, dtype=np.int32))
    for name, values in (extra_labels or {}).items():
        arrays[name] = save_array(staging, name, np.asarray(values, dtype=np.int64))
    return arrays


def commit_cache(staging: Path, out: Path, manifest: Manifest, *, replace: bool = False) -> Manifest:
    """Write ``files.json`` and ``manifest.json`` into ``staging`` and rename it to ``out``; returns the
    manifest as written (with its file table and who built it).

    The manifest is the last file written, and the folder appears at ``out`` only complete. With
    ``replace``, an existing cache at ``out`` is renamed aside first and kept until no job reads it any
    more (``cachebuild.storage.locations.replacement``): readers of the old cache keep reading it whole.
    """
    manifest.check_consistent()
    get_backend(manifest.storage).finalize_folder(staging, manifest)
    remove_unfinished_writes(staging)
    if not manifest.built_by:
        manifest = dataclasses.replace(manifest, built_by=built_by())
    manifest = with_file_table(staging, manifest)
    write_bytes_atomic(staging / MANIFEST_NAME, manifest_bytes(manifest))
    install_staged(staging, out, replace=replace)
    return manifest


def remove_unfinished_writes(staging: Path) -> None:
    """Leftovers of writers killed in an earlier run (ours and zarr's temporary files): never part of a cache."""
    for dirpath, _, names in os.walk(staging):
        for name in names:
            if is_unfinished_write(name):
                os.unlink(os.path.join(dirpath, name))


def install_staged(staging: Path, out: Path, *, replace: bool = False) -> None:
    """Rename the complete cache in ``staging`` (its manifest written) to ``out``; see :func:`commit_cache`."""
    if out.exists() or out.is_symlink():
        if not replace:
            raise CacheExistsError(f"{out} already exists; pass --force to replace it")
        if out.is_symlink() or not (out / MANIFEST_NAME).is_file():
            # --force replaces caches, never anything else (a source tree, a user's folder).
            raise CacheExistsError(f"{out} is not a cachebuild cache (no {MANIFEST_NAME}); refusing to replace it: "
                                   f"choose another output folder")
        set_aside(out)
    staging.rename(out)
    fsync_dir(out.parent)
    sweep_replaced(out)


@dataclass(frozen=True)
class _ArrayOptions:
    """The ``StorageParams`` of in-memory images."""

    size: int
    chunk_size: int | None
    compression: str
    quality: int = jpeg_codec.DEFAULT_QUALITY
    subsampling: str = jpeg_codec.DEFAULT_SUBSAMPLING


def _write_through_sinks(staging: Path, images: np.ndarray, storage: str, shard_size: int,
                         compression: str) -> list[ShardInfo]:
    backend = get_backend(storage)
    sample_shape = (int(images.shape[1]), int(images.shape[2]), 3)
    opts = _ArrayOptions(size=sample_shape[0], chunk_size=min(shard_size, 64), compression=compression)
    try:
        params = backend.build_params(opts)
    except ValueError as e:  # what only the storage kind knows (npy and jpeg shards take no compression)
        raise OptionError(str(e)) from None
    block = backend.align_block(shard_size, opts)
    backend.prepare(staging, len(images), sample_shape, opts)
    records = []
    for b, lo in enumerate(range(0, len(images), block)):
        part = images[lo : lo + block]
        sink = backend.sink(staging, b, lo, len(part), sample_shape, params)
        try:
            for image in part:
                sink.next_slot()[...] = image
                sink.commit()
        except BaseException:
            sink.abort()
            raise
        file, digest = sink.close()
        records.append(BlockRecord(b, lo, len(part), len(part), file, digest, stored_bytes=sink.stored_bytes))
    shards = backend.finish(staging, records, len(images), len(images))
    backend.cleanup(staging)
    return shards


def write_cache(
    out: str | os.PathLike[str],
    images: np.ndarray,
    labels: np.ndarray,
    classes: list[str],
    *,
    storage: str = "npy",
    shard_size: int = 1024,
    sizes: np.ndarray | None = None,
    boxes: np.ndarray | None = None,
    paths: list[str] | None = None,
    dataset: str = "arrays",
    split: str = "train",
    fit: str = "crop",
    compression: str = "none",
    replace: bool = False,
) -> Manifest:
    """Write an in-memory (N, H, W, 3) uint8 array as a cache (tests, tools, small synthetic sets), through
    the storage kind's build path (prepare, one sink per block of ``shard_size`` samples, finish, commit):
    the files are those a build writes. jpeg: at the default quality and subsampling; zarr: chunks of
    ``min(shard_size, 64)`` samples, blocks of whole chunks."""
    out = Path(out)
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        raise OptionError(f"images must be uint8 (N, H, W, 3), got {images.dtype}{list(images.shape)}")
    n = len(images)
    sample_shape = (int(images.shape[1]), int(images.shape[2]), 3)
    staging = staging_path(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = _write_through_sinks(staging, images, storage, shard_size, compression)
    if sizes is None:
        sizes = np.tile(np.array(sample_shape[:2], dtype=np.int32), (n, 1))
    arrays = save_side_arrays(staging, labels, sizes,
                              paths if paths is not None else [f"sample-{i}" for i in range(n)], boxes)
    manifest = Manifest(
        dataset=dataset,
        split=split,
        count=n,
        shape=sample_shape,
        storage=storage,
        classes=tuple(classes),
        fit=fit,
        interpolation="none",
        # identity, not a checksum: sha256 in every format version (format.digests)
        source={"root": "", "fingerprint": array_digest(images, SHA256), "files": n},
        build={"key": array_digest(images, SHA256), "writer": "write_cache", "shard_size": shard_size},
        tool=tool_versions(),
        shards=tuple(shards),
        arrays=arrays,
        failures=tuple[Failure, ...](),
        created=utc_now(),
    )
    return commit_cache(staging, out, manifest, replace=replace)
