"""One block's work, in a worker: decode its source files into the storage kind's sink, write its record.

Each sample is decoded into its sink's reused slot; the sink writes and hashes it while it is hot in cache
(``Sink.close``). A build of files also digests each file's bytes as they are read (xxh3, far cheaper than
the decode), into ``blocks/inputs-NNNNN.npy`` beside the block's record: the build's ``source_files.json`` keeps
them, so that a later ``--update`` knows a file whose mtime alone changed unchanged.
No fsync: a finished block survives any kill of the build (the kernel holds the pages); after a machine crash,
``cachebuild verify`` checks every shard against its checksum. ``decode_device="cuda"``
decodes the block's sources in batches on this worker's GPU instead (``cachebuild.builder.gpu_build``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.atomic import write_bytes_atomic
from cachebuild.builder.sample import Placement, ResizeSpec, decode_into, one_thread_each
from cachebuild.errors import DecodeError, SourceError
from cachebuild.format.manifest import SOURCE_DIGEST, encode_path
from cachebuild.storage import get_backend
from cachebuild.storage.kinds.base import BlockFailure, BlockRecord, Sink

__all__ = ["BlockTask", "Decoded", "decode_run", "load_input_digests", "record_path", "run_block"]

_WORKER_SETTINGS: list[Any] = []  # a worker process's one_thread_each, entered once for its life


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
    claim: str = ""  # the GPUs a GPU build's workers claim one each (gpu_build.gpu_workers)
    reuse: Any = None  # --update: the samples to copy from the cache being replaced (update.BlockReuse)
    digest_inputs: bool = False  # digest each source file's bytes as they are read (plans of files)


def record_path(staging: Path, block: int) -> Path:
    return staging / "blocks" / f"block-{block:05d}.json"


def _inputs_path(staging: Path, block: int) -> Path:
    return staging / "blocks" / f"inputs-{block:05d}.npy"


_DIGEST_DTYPE = f"S{SOURCE_DIGEST.hex_len}"


class _DigestingReader:
    """The block's reader, digesting the bytes of every file it reads (in whichever thread reads it: the GPU
    decoder's reads ahead), so that nothing is read twice for it."""

    def __init__(self, reader: Callable[[int, str], Any], start: int, count: int) -> None:
        self.reader, self.start = reader, start
        self.digests = np.zeros(count, _DIGEST_DTYPE)

    def __call__(self, index: int, key: str) -> Any:
        data = self.reader(index, key)
        if isinstance(data, bytes | bytearray | memoryview):
            self.digests[index - self.start] = SOURCE_DIGEST.of(data).encode()
        return data


def load_input_digests(staging: Path, blocks: Iterable[BlockRecord], n: int,
                       carried: np.ndarray | None = None) -> np.ndarray:
    """The digests of the plan's files by plan position: those the blocks' workers took of the files they read,
    else ``carried`` (an update's: the old cache's, of the files it reused unread), else ``b""`` (not known)."""
    out = np.zeros(n, _DIGEST_DTYPE) if carried is None else np.asarray(carried, _DIGEST_DTYPE).copy()
    for rec in blocks:
        path = _inputs_path(staging, rec.block)
        if path.is_file():  # a block taken whole, or one a release without digests finished, read nothing
            got = np.load(path, allow_pickle=False)
            part = out[rec.start : rec.start + len(got)]
            part[got != b""] = got[got != b""]
    return out


def _skip_reason(e: Exception) -> str:
    """Why one source file gave no sample, in one line."""
    if isinstance(e, DecodeError):
        return e.reason
    if isinstance(e, OSError):
        return f"unreadable: {e.strerror or e}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1]}" if text else type(e).__name__


# What a run of a block's files gives: the kept samples' plan positions (int64 (n,)), source sizes (int32 (n, 2))
# and boxes (int32 (n, 4)), and the files that gave none.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, list[BlockFailure]]


def decode_run(task: BlockTask, sink: Sink, lo: int = 0, hi: int | None = None) -> Decoded:
    """Decode the block's files ``[lo, hi)`` into ``sink``; the kept positions, sizes, boxes (arrays: no tuple
    per sample in the record, its JSON or its pickle), and the skips."""
    hi = len(task.keys) if hi is None else hi
    gpu: Callable[[int, str, np.ndarray], Placement] | None = None
    if task.decode_device != "cpu":
        from cachebuild.builder.gpu_build import GpuBlockDecoder  # only imported where a GPU build runs

        gpu = GpuBlockDecoder(task.reader, task.keys, task.start, task.spec, task.claim)
    ok: list[int] = []
    placed: list[Placement] = []
    failures: list[BlockFailure] = []
    for i in range(lo, hi):
        key = task.keys[i]
        try:
            if gpu is None:
                placed.append(decode_into(task.reader(task.start + i, key), task.spec, sink.next_slot(), path=key))
            else:
                placed.append(gpu(i, key, sink.next_slot()))
        except SourceError:  # the source itself failed (a shard changed since planning, a dead server): stop
            raise
        except Exception as e:  # whatever one file does (reader or decoder) is that file's skip
            if task.on_error == "fail":
                raise DecodeError(key, _skip_reason(e)) from None
            failures.append(BlockFailure(task.start + i, encode_path(key), _skip_reason(e)))
            continue
        sink.commit()
        ok.append(task.start + i)
    sizes = np.array([(p.height, p.width) for p in placed], np.int32).reshape(-1, 2)
    boxes = np.array([p.box for p in placed], np.int32).reshape(-1, 4)
    return np.array(ok, np.int64), sizes, boxes, failures


def run_block(task: BlockTask) -> BlockRecord:
    """Decode one block into its storage backend's sink and write its record; returns the record."""
    if multiprocessing.parent_process() is not None and not _WORKER_SETTINGS:  # a worker process, first block
        _WORKER_SETTINGS.append(one_thread_each())
        _WORKER_SETTINGS[0].__enter__()
    folder = Path(task.staging)
    adopted = None if task.reuse is None else task.reuse.adopt(task)  # --update: an old shard taken whole
    if adopted is not None:
        _write_record(folder, adopted)
        return adopted
    digesting = _DigestingReader(task.reader, task.start, len(task.keys)) if task.digest_inputs else None
    if digesting is not None:
        task = dataclasses.replace(task, reader=digesting)
    shape = (task.spec.size, task.spec.size, 3)
    sink = get_backend(task.storage).sink(folder, task.block, task.start, len(task.keys), shape, task.params)
    try:
        ok, sizes, boxes, failures = decode_run(task, sink) if task.reuse is None else task.reuse.fill(task, sink)
    except BaseException:
        sink.abort()
        raise
    file, digest = sink.close()
    if digesting is not None:  # before the record: a block is finished when its record exists
        buf = io.BytesIO()
        np.save(buf, digesting.digests, allow_pickle=False)
        write_bytes_atomic(_inputs_path(folder, task.block), buf.getvalue(), durable=False)
    record = BlockRecord(task.block, task.start, len(task.keys), len(ok), file, digest, ok, sizes, boxes,
                         tuple(failures), sink.stored_bytes, 0 if task.reuse is None else task.reuse.reused)
    _write_record(folder, record)
    return record


def _write_record(folder: Path, record: BlockRecord) -> None:
    # Not fsynced: the shard it vouches for is not either, and an fsync here makes ext4 write the whole shard
    # out while the worker waits. Compact JSON: json's C encoder (an indent makes it fall back to Python's).
    data = json.dumps(record.to_json(), ensure_ascii=False, separators=(",", ":"))
    write_bytes_atomic(record_path(folder, record.block), data.encode("utf-8"), durable=False)
