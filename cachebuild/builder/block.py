"""One block's work, in a worker: decode its source files into the storage kind's sink, write its record.

Each sample is decoded into its sink's reused slot; the sink writes and hashes it while it is hot in cache
(``Sink.close``). No fsync: a finished block survives any kill of the build (the kernel holds the pages);
after a machine crash, ``cachebuild verify`` checks every shard against its checksum. ``decode_device="cuda"``
decodes the block's sources in batches on this worker's GPU instead (``cachebuild.builder.gpu_build``).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.atomic import write_bytes_atomic
from cachebuild.builder.sample.geometry import Placement, ResizeSpec
from cachebuild.errors import DecodeError, SourceError
from cachebuild.format.manifest import encode_path
from cachebuild.storage import get_backend
from cachebuild.storage.kinds.base import BlockFailure, BlockRecord, Sink

__all__ = ["BlockTask", "Filled", "record_path", "run_block"]

_WORKER_READY = False


@dataclass(frozen=True)
class BlockTask:
    """Everything a worker needs for block ``block``: plan positions ``[start, start + len(keys))``."""

    reader: Callable[[int, str], Any]  # (plan position, key) -> the source file's bytes (sources.plan)
    keys: list[str]
    start: int
    block: int
    spec: ResizeSpec
    staging: str
    on_error: str  # "skip" | "fail"
    storage: str
    params: dict[str, Any]  # the backend's build_params
    decode_device: str = "cpu"
    claim: str = ""  # the GPU this worker claims (gpu_build.gpu_workers)
    reuse: Any = None  # --update: the samples to copy from the cache being replaced (update.BlockReuse)
    torch_resize: bool = False  # a worker share large enough to pay torch's import (geometry.TORCH_RESIZE_FROM)


def _init_worker(decode_device: str = "cpu", torch_resize: bool = False) -> None:
    """One thread per library inside a worker process: parallelism comes from the workers, not from within.
    Not in the caller's own process (--jobs 1, thread backends): its thread settings are the caller's.
    A small CPU build needs no torch (its resize is :mod:`cachebuild.builder.sample.aa_resize`); a GPU build's
    worker, and one with a large share (``torch_resize``), import it here, at the start of its first block,
    before any storage I/O thread of its own runs. Only here: a worker loky reuses from a build without
    torch keeps numpy's resize (the same bytes), because importing torch later grows it by more than
    loky's leak limit (300 MB), loky then stops it mid-build, and joblib's unordered generator hung on that."""
    global _WORKER_READY
    if _WORKER_READY or multiprocessing.parent_process() is None:
        return
    import cv2

    cv2.setNumThreads(1)
    if decode_device != "cpu" or torch_resize:
        import torch

        torch.set_num_threads(1)
    _WORKER_READY = True


def record_path(staging: Path, block: int) -> Path:
    return staging / "blocks" / f"block-{block:05d}.json"


def _skip_reason(e: Exception) -> str:
    """Why one source file gave no sample, in one line."""
    if isinstance(e, DecodeError):
        return e.reason
    if isinstance(e, OSError):
        return f"unreadable: {e.strerror or e}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1]}" if text else type(e).__name__


def _decoder(task: BlockTask) -> Callable[[int, str, np.ndarray], Placement]:
    if task.decode_device == "cpu":
        from cachebuild.builder.sample.decode import decode_into  # OpenCV: in the worker only, not in the parent

        def fill(i: int, key: str, slot: np.ndarray) -> Placement:
            return decode_into(task.reader(task.start + i, key), task.spec, slot, path=key)

        return fill
    from cachebuild.builder.gpu_build import GpuBlockDecoder  # only imported where a GPU build runs

    return GpuBlockDecoder(task.reader, task.keys, task.start, task.spec, task.claim)


# What a block's decode gives: the kept samples' plan positions (int64 (n,)), source sizes (int32 (n, 2)) and
# boxes (int32 (n, 4)), and the files that gave none.
Filled = tuple[np.ndarray, np.ndarray, np.ndarray, list[BlockFailure]]


def _fill(task: BlockTask, sink: Sink) -> Filled:
    """Decode every file of the block into ``sink``; the kept positions, sizes, boxes, and the skips. Written
    into arrays made for the whole block (no tuple per sample for the record, its JSON or its pickle)."""
    fill = _decoder(task)
    planned = len(task.keys)
    ok = np.empty(planned, np.int64)
    sizes = np.empty((planned, 2), np.int32)
    boxes = np.empty((planned, 4), np.int32)
    failures: list[BlockFailure] = []
    n = 0
    for i, key in enumerate(task.keys):
        slot = sink.next_slot()
        try:
            placed = fill(i, key, slot)
        except SourceError:  # the source itself failed (a shard changed since planning, a dead server): stop
            raise
        except Exception as e:  # whatever one file does (reader or decoder) is that file's skip
            reason = _skip_reason(e)
            if task.on_error == "fail":
                raise DecodeError(key, reason) from None
            failures.append(BlockFailure(task.start + i, encode_path(key), reason))
            continue
        sink.commit()
        ok[n] = task.start + i
        sizes[n] = placed.height, placed.width
        boxes[n] = placed.box
        n += 1
    return ok[:n], sizes[:n], boxes[:n], failures


def run_block(task: BlockTask) -> BlockRecord:
    """Decode one block into its storage backend's sink and write its record; returns the record."""
    _init_worker(task.decode_device, task.torch_resize)
    folder = Path(task.staging)
    adopted = None if task.reuse is None else task.reuse.adopt(task)  # --update: an old shard taken whole
    if adopted is not None:
        _write_record(folder, adopted)
        return adopted
    shape = (task.spec.size, task.spec.size, 3)
    sink = get_backend(task.storage).sink(folder, task.block, task.start, len(task.keys), shape, task.params)
    fill = _fill if task.reuse is None else functools.partial(task.reuse.fill, decode=_fill)
    try:
        ok, sizes, boxes, failures = fill(task, sink)
    except BaseException:
        sink.abort()
        raise
    file, digest = sink.close()
    record = BlockRecord(task.block, task.start, len(task.keys), len(ok), file, digest, ok, sizes, boxes,
                         tuple(failures), sink.stored_bytes,
                         0 if task.reuse is None else task.reuse.reused)
    _write_record(folder, record)
    return record


def _write_record(folder: Path, record: BlockRecord) -> None:
    # Not fsynced: the shard it vouches for is not either, and an fsync here made ext4 write the whole
    # shard out while the worker waited (~0.15 s a block, 10-20% of the build). Compact JSON: json's C
    # encoder (an indent makes it fall back to the Python one); the per-sample arrays are one string each.
    data = json.dumps(record.to_json(), ensure_ascii=False, separators=(",", ":"))
    write_bytes_atomic(record_path(folder, record.block), data.encode("utf-8"), durable=False)
