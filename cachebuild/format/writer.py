"""Finishing a cache: side arrays, manifest last, then one rename of the staging folder into place."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import CacheExistsError
from cachebuild.format.manifest import (
    MANIFEST_NAME,
    ArrayInfo,
    Failure,
    Manifest,
    ShardInfo,
    write_json_atomic,
)
from cachebuild.format.storage import (
    ZARR_NAME,
    create_npy_shard,
    create_zarr_images,
    save_array,
    save_paths,
    sha256_bytes,
    shard_file_name,
)

__all__ = ["commit_cache", "save_side_arrays", "staging_path", "tool_versions", "utc_now", "write_cache"]


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


def commit_cache(staging: Path, out: Path, manifest: Manifest, *, replace: bool = False) -> None:
    """Write ``manifest.json`` into ``staging`` and rename it to ``out``.

    The manifest is the last file written, and the folder appears at ``out`` only complete. With
    ``replace``, an existing ``out`` is moved aside first and deleted only after the new one is in place.
    """
    manifest.check_consistent()
    write_json_atomic(staging / MANIFEST_NAME, manifest.to_dict())
    old: Path | None = None
    if out.exists():
        if not replace:
            raise CacheExistsError(f"{out} already exists; pass --force to replace it")
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    """Write an in-memory (N, H, W, 3) uint8 array as a cache (tests, tools, small synthetic sets)."""
    out = Path(out)
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype}{list(images.shape)}")
    n = len(images)
    sample_shape = (int(images.shape[1]), int(images.shape[2]), 3)
    staging = staging_path(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = []
    if storage == "npy":
        for i, lo in enumerate(range(0, n, shard_size)):
            block = images[lo : lo + shard_size]
            mm = create_npy_shard(staging / shard_file_name(i), len(block), sample_shape)
            mm[:] = block
            mm.flush()
            del mm
            shards.append(ShardInfo(shard_file_name(i), lo, len(block), sha256_bytes(block)))
    elif storage == "zarr":
        arr = create_zarr_images(staging / ZARR_NAME, n, sample_shape, chunk=min(shard_size, 64),
                                 compression=compression)
        arr[:] = images
        shards = [
            ShardInfo(ZARR_NAME, lo, len(images[lo : lo + shard_size]), sha256_bytes(images[lo : lo + shard_size]))
            for lo in range(0, n, shard_size)
        ]
    else:
        raise ValueError(f"unknown storage {storage!r}: expected npy or zarr")
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
        source={"root": "", "fingerprint": sha256_bytes(images), "files": n},
        build={"key": sha256_bytes(images), "writer": "write_cache", "shard_size": shard_size},
        tool=tool_versions(),
        shards=tuple(shards),
        arrays=arrays,
        failures=tuple[Failure, ...](),
        created=utc_now(),
    )
    commit_cache(staging, out, manifest, replace=replace)
    return manifest
