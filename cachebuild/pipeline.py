"""The build: a plan -> blocks of images -> joblib workers -> shards -> manifest -> rename into place.

Workers decode a block straight into its own npy shard, or into its own whole chunks of the zarr array
(blocks are a whole number of chunks, so no two workers touch one chunk), so the parent never holds
pixels and memory stays flat. A block is finished when its record (``blocks/block-NNNNN.json``) exists;
a killed build resumes by skipping those. Block boundaries depend only on the plan, so the arrays are
byte-identical whatever ``--jobs`` is. A zarr block writes its samples from its plan position; when
files failed, one task afterwards moves the later blocks down so that sample i stays the i-th readable
file (no copy at all when every file decoded).

No joblib backend is fixed here: run under ``joblib.parallel_config(backend="dask")`` to use a cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from joblib import Parallel, delayed
from joblib.externals.loky.process_executor import TerminatedWorkerError

from cachebuild.decode import DEFAULT_MAX_PIXELS, FITS, INTERPOLATIONS, ResizeSpec, decode_into
from cachebuild.destination import check_outside_source, check_replaceable, is_own_staging, output_error
from cachebuild.errors import CacheBuildError, CacheExistsError, DecodeError, OptionError
from cachebuild.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    STORAGES,
    Failure,
    Manifest,
    ShardInfo,
    read_manifest,
    write_json_atomic,
)
from cachebuild.format.writer import commit_cache, save_side_arrays, staging_path, tool_versions, utc_now
from cachebuild.options import parse_bool, parse_choice, parse_int, parse_optional_bool
from cachebuild.sinks import NpyShardSink, ZarrChunkSink
from cachebuild.sources.plan import Plan
from cachebuild.zarr_staging import COMPACTING, create_staging_zarr, place_zarr_blocks, undo_interrupted_compaction

__all__ = ["COMPRESSIONS", "MAX_SIZE", "ON_ERROR", "BuildOptions", "BuildResult", "build"]

log = logging.getLogger("cachebuild")

BLOCK_TARGET_BYTES = 64 << 20  # ~64 MB of pixels per block/shard: few files, tasks long enough to amortise
ZARR_CHUNK_TARGET_BYTES = 4 << 20  # ~4 MB chunks: random reads stay cheap
MIN_BLOCKS = 64  # a plan of n files makes at least min(64, n / 64) blocks
COMPRESSIONS = ("none", "zstd", "blosc")  # zarr chunk codecs
ON_ERROR = ("skip", "fail")
MAX_SIZE = 16384  # output side: one sample is then 768 MB


@dataclass(frozen=True)
class BuildOptions:
    size: int
    fit: str = "crop"
    interpolation: str = "antialias"
    storage: str = "npy"
    jobs: int = -1
    block_size: int | None = None  # samples per block (= per npy shard); default from BLOCK_TARGET_BYTES
    chunk_size: int | None = None  # zarr samples per chunk
    compression: str = "none"
    on_error: str = "skip"  # or "fail"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = True
    force: bool = False
    progress: bool | None = None  # None: a bar when stderr is a terminal

    def __post_init__(self) -> None:
        """Every value checked here, so a build that cannot be right never starts (an unknown ``fit``
        would build a cache no reader opens; an unknown interpolation would be recorded but not used)."""
        parse_int("size", self.size, 1, MAX_SIZE)
        parse_choice("fit", self.fit, FITS)
        parse_choice("interpolation", self.interpolation, INTERPOLATIONS)
        parse_choice("storage", self.storage, STORAGES)
        parse_int("jobs", self.jobs, not_zero=True)
        parse_int("block_size", self.block_size, 1, optional=True)
        parse_int("chunk_size", self.chunk_size, 1, optional=True)
        parse_choice("compression", self.compression, COMPRESSIONS)
        if self.compression != "none" and self.storage != "zarr":
            raise OptionError(f"compression={self.compression!r} applies to zarr storage only; "
                              f"{self.storage} shards are stored raw (use compression='none')")
        parse_choice("on_error", self.on_error, ON_ERROR)
        parse_int("max_pixels", self.max_pixels, 1)
        parse_bool("reduced_decode", self.reduced_decode)
        parse_bool("force", self.force)
        parse_optional_bool("progress", self.progress)

    def resolved_block(self, planned: int | None = None) -> int:
        """Samples per block: ``block_size``, else ~64 MB of pixels, but small enough that a plan of
        ``planned`` files makes >= 64 blocks (so every worker stays busy to the end of a small build:
        at 21 blocks for 2 workers the last one ran alone ~10% of the time). It depends on the plan alone,
        never on --jobs, so the shard layout does not either."""
        per = self.size * self.size * 3
        block = self.block_size or int(min(8192, max(64, BLOCK_TARGET_BYTES // per // 64 * 64)))
        if not self.block_size and planned:
            block = min(block, max(64, -(-planned // MIN_BLOCKS // 64) * 64))
        if self.storage == "zarr":  # whole chunks per block: workers never share a chunk
            chunk = self.resolved_chunk()
            block = max(chunk, block // chunk * chunk)
        return block

    def resolved_chunk(self) -> int:
        if self.chunk_size:
            return self.chunk_size
        per = self.size * self.size * 3
        return int(min(1024, max(1, ZARR_CHUNK_TARGET_BYTES // per)))


@dataclass(frozen=True)
class BuildResult:
    path: Path
    status: str  # "built" | "up to date"
    count: int
    failures: int
    seconds: float
    bytes_written: int

    @property
    def images_per_second(self) -> float:
        return (self.count + self.failures) / self.seconds if self.seconds > 0 else float("nan")


# ---------------------------------------------------------------- workers

_WORKER_READY = False


def _init_worker() -> None:
    """One thread per library inside a worker process: parallelism comes from the workers, not from within.
    Not in the caller's own process (--jobs 1, thread backends): its thread settings are the caller's."""
    global _WORKER_READY
    if _WORKER_READY or multiprocessing.parent_process() is None:
        return
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    _WORKER_READY = True


def _record_path(staging: Path, block: int) -> Path:
    return staging / "blocks" / f"block-{block:05d}.json"


def _skip_reason(e: Exception) -> str:
    """Why one source file gave no sample, in one line."""
    if isinstance(e, DecodeError):
        return e.reason
    if isinstance(e, OSError):
        return f"unreadable: {e.strerror or e}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1]}" if text else type(e).__name__


def _run_block(plan_reader: Any, keys: list[str], start: int, block: int, spec: ResizeSpec,
               staging: str, on_error: str, storage: str = "npy") -> dict[str, Any]:
    """Decode one block into its npy shard or zarr chunks and write its record; returns the record.

    Each sample is decoded into a reused buffer and hashed while it is hot in cache. No fsync: a finished
    block survives any kill of the build (the kernel holds the pages); after a machine crash,
    ``cachebuild verify`` checks every shard against its checksum.
    """
    _init_worker()
    folder = Path(staging)
    shape = (spec.size, spec.size, 3)
    sink = ZarrChunkSink(folder, start, shape) if storage == "zarr" else \
        NpyShardSink(folder, block, len(keys), shape)
    digest = hashlib.sha256()
    ok, sizes, boxes, failures = [], [], [], []
    try:
        for i, key in enumerate(keys):
            slot = sink.next_slot()
            try:
                data = plan_reader(start + i, key)
                placed = decode_into(data, spec, slot, path=key)
            except Exception as e:  # whatever one file does (reader or decoder) is that file's skip
                reason = _skip_reason(e)
                if on_error == "fail":
                    raise DecodeError(key, reason) from None
                failures.append({"index": start + i, "path": key, "reason": reason})
                continue
            digest.update(slot)
            sink.commit()
            ok.append(start + i)
            sizes.append([placed.height, placed.width])
            boxes.append(list(placed.box))
    except BaseException:
        sink.abort()
        raise
    file = sink.close()
    record = {"block": block, "start": start, "planned": len(keys), "count": len(ok), "file": file,
              "sha256": digest.hexdigest(), "ok": ok, "sizes": sizes, "boxes": boxes, "failures": failures}
    # Not fsynced: the shard it vouches for is not either, and an fsync here made ext4 write the whole
    # shard out while the worker waited (~0.15 s a block, 10-20% of the build).
    write_json_atomic(_record_path(folder, block), record, durable=False)
    return record


# ---------------------------------------------------------------- parent

def _build_key(plan: Plan, opts: BuildOptions) -> tuple[str, dict[str, Any]]:
    params = {
        "format_version": FORMAT_VERSION,
        "size": opts.size,
        "fit": opts.fit,
        "interpolation": opts.interpolation,
        "storage": opts.storage,
        "block_size": opts.resolved_block(len(plan)),
        "chunk_size": opts.resolved_chunk() if opts.storage == "zarr" else None,
        "compression": opts.compression if opts.storage == "zarr" else "none",
        "max_pixels": opts.max_pixels,
        "reduced_decode": opts.reduced_decode,
    }
    blob = json.dumps({"source": plan.fingerprint, "params": params}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest(), params


def _check_destination(out: Path, key: str, force: bool) -> Manifest | None:
    """The manifest of ``out`` when it already holds this exact build, else None: ``out`` does not exist,
    or ``force`` and it is provably a cache cachebuild wrote (``destination.check_replaceable``), so it
    may be replaced. Raises otherwise, saying what is there."""
    if not out.exists() and not out.is_symlink():
        return None
    if not out.is_dir():
        raise CacheExistsError(f"{out} exists and is a file, not a cache folder; choose another --out")
    if not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
        return None
    existing, problem = None, None
    if (out / MANIFEST_NAME).is_file():
        try:
            existing = read_manifest(out)
        except CacheBuildError as e:  # say what is wrong with it, not that it is "different"
            problem = str(e)
    if existing is not None and existing.build_key == key and not force:
        return existing
    if force:
        check_replaceable(out, problem)
        return None
    if problem is not None:
        raise CacheExistsError(
            f"{out} holds a cache whose manifest cannot be used ({problem}); pass --force to rebuild it "
            f"(replaced only if the folder holds nothing but files its manifest names), or choose another --out"
        )
    if existing is None:
        raise CacheExistsError(f"{out} exists and is not a cachebuild cache (no {MANIFEST_NAME}); "
                               f"choose another --out")
    raise CacheExistsError(
        f"{out} holds a different cache (other source files or build parameters); "
        f"pass --force to replace it, or choose another --out"
    )


def _prepare_staging(staging: Path, key: str) -> dict[int, dict[str, Any]]:
    """Create or reopen the staging folder; return the records of blocks finished by an earlier run."""
    build_file = staging / "build.json"
    if staging.exists() and not (staging.is_dir() and is_own_staging(staging)):
        raise CacheExistsError(f"{staging} exists and was not made by cachebuild (a build keeps its unfinished "
                               f"work there); move it away or choose another --out")
    if staging.exists():
        try:
            same = json.loads(build_file.read_text())["key"] == key
        except (OSError, ValueError, KeyError):
            same = False
        if not same:
            log.warning("discarding the unfinished build in %s: it was started with other inputs", staging)
            shutil.rmtree(staging)
    (staging / "blocks").mkdir(parents=True, exist_ok=True)
    if not build_file.exists():
        write_json_atomic(build_file, {"key": key})
    undo_interrupted_compaction(staging, lambda block: _record_path(staging, block).unlink(missing_ok=True))
    done = {}
    for rec_path in sorted((staging / "blocks").glob("block-*.json")):
        try:
            rec = json.loads(rec_path.read_text())
        except ValueError:
            continue  # a record is written atomically, but be lenient with foreign debris
        if (staging / rec["file"]).exists():
            done[rec["block"]] = rec
    return done


def _progress(total: int, initial: int, desc: str, enabled: bool | None):
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit="img", disable=not enabled, smoothing=0.1)


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[str]:
    """One build per output at a time: two would share one staging folder. ``flock`` is released by the
    kernel when the process dies, so a killed build never leaves a stale lock behind. The lock file holds
    the PID of the last build that took it; this yields the previous one's ("" if none)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.with_name(out.name + ".lock")
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheBuildError(
                f"another cachebuild process is building {out} (it holds {lock}); wait for it to finish"
            ) from None
        f.seek(0)
        previous = f.read(32).strip()
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield previous


def build(plan: Plan, out: str | os.PathLike[str], opts: BuildOptions) -> BuildResult:
    """Build (or resume, or confirm up to date) the cache of ``plan`` at ``out``.

    Errors of the output's environment (no space, read-only, no permission, a file in the way) and a
    worker process that died come out as one-line :class:`CacheBuildError` s naming the path; the finished
    blocks stay in ``<out>.partial`` and the same call resumes from them.
    """
    out = Path(out)
    staging = staging_path(out)
    try:
        # Refuse before anything (the lock file) is created beside the destination; checked again under the lock.
        if "://" not in str(plan.root):
            check_outside_source(out, plan.root)
        _check_destination(out, _build_key(plan, opts)[0], opts.force)
        with _exclusive(out) as previous_pid:
            return _build_locked(plan, out, opts, previous_pid)
    except CacheBuildError:
        raise
    except OSError as e:
        err = output_error(e, out, staging)
        if err is None:
            raise
        raise err from e
    except TerminatedWorkerError as e:
        raise CacheBuildError(
            f"a worker process building {out} died ({str(e).splitlines()[-1].strip()}); the finished blocks "
            f"are kept in {staging}: rerun the same command to resume (if it was killed for lack of memory, "
            f"lower --jobs)"
        ) from e


def _drop_replaced(out: Path, previous_pid: str) -> None:
    """A ``--force`` commit killed between its two renames, or before deleting the cache it replaced,
    leaves that cache at ``<out>.old-<PID>``. The one whose PID is the previous build of ``out`` (from the
    lock file) is that debris: removed when it is provably a cache of ours. Any other such cache may be a
    copy someone keeps (``train.old-2024``): only named."""
    for old in sorted(out.parent.glob(glob.escape(out.name) + ".old-*")):
        try:
            check_replaceable(old, None)
        except CacheBuildError:
            continue  # not a cache of ours: not our business
        if previous_pid and old.name == f"{out.name}.old-{previous_pid}":
            log.info("removing %s, the cache the interrupted --force build %s replaced", old, previous_pid)
            shutil.rmtree(old)
        else:
            log.warning("%s looks like a cache an interrupted --force build replaced; remove it if it is not "
                        "needed", old)


def _build_locked(plan: Plan, out: Path, opts: BuildOptions, previous_pid: str = "") -> BuildResult:
    t0 = time.perf_counter()
    _drop_replaced(out, previous_pid)
    key, params = _build_key(plan, opts)
    m = _check_destination(out, key, opts.force)
    if m is not None:
        return BuildResult(out, "up to date", m.count, len(m.failures), 0.0, 0)
    staging = staging_path(out)
    done = _prepare_staging(staging, key)

    spec = ResizeSpec(size=opts.size, fit=opts.fit, interpolation=opts.interpolation,
                      max_pixels=opts.max_pixels, reduced_decode=opts.reduced_decode)
    bs = opts.resolved_block(len(plan))
    n = len(plan)
    if opts.storage == "zarr":
        create_staging_zarr(staging, n, (spec.size, spec.size, 3), opts.resolved_chunk(), opts.compression)
    blocks = list(enumerate(range(0, n, bs)))
    todo = [(b, lo) for b, lo in blocks if b not in done]
    if done:
        log.info("resuming %s: %d of %d blocks already built", out, len(done), len(blocks))
    records = dict(done)
    tasks = (
        delayed(_run_block)(plan.reader, list(plan.keys[lo : lo + bs]), lo, b, spec, str(staging), opts.on_error,
                            opts.storage)
        for b, lo in todo
    )
    with _progress(n, sum(r["planned"] for r in done.values()), f"{plan.dataset}/{plan.split}",
                   opts.progress) as bar:
        for rec in Parallel(n_jobs=opts.jobs, return_as="generator_unordered")(tasks):
            records[rec["block"]] = rec
            bar.update(rec["planned"])
    manifest = _finish(plan, out, staging, records, opts, params, key, spec)
    seconds = time.perf_counter() - t0
    written = manifest.count * manifest.sample_nbytes
    return BuildResult(out, "built", manifest.count, len(manifest.failures), seconds, written)


def _finish(plan: Plan, out: Path, staging: Path, records: dict[int, dict[str, Any]], opts: BuildOptions,
            params: dict[str, Any], key: str, spec: ResizeSpec) -> Manifest:
    """Merge block records (in plan order) into side arrays and the manifest; commit atomically."""
    ordered = [records[b] for b in sorted(records)]
    ok = np.asarray([i for r in ordered for i in r["ok"]], dtype=np.int64)
    count = len(ok)
    failures = tuple(Failure(f["path"], f["reason"]) for r in ordered for f in r["failures"])
    if count == 0:
        raise CacheBuildError(
            f"none of the {len(plan)} source files of {plan.root} could be read; first failure: "
            f"{failures[0].path}: {failures[0].reason}" if failures else f"{plan.root} has no samples"
        )
    sample_shape = (spec.size, spec.size, 3)
    shards: list[ShardInfo] = []
    if opts.storage == "npy":
        pos = 0
        for r in ordered:
            if r["count"]:
                shards.append(ShardInfo(r["file"], pos, r["count"], r["sha256"]))
                pos += r["count"]
            else:
                (staging / r["file"]).unlink(missing_ok=True)
    else:
        shards = place_zarr_blocks(staging, ordered, count, len(plan))

    arrays = save_side_arrays(
        staging,
        labels=plan.labels[ok],
        sizes=np.asarray([s for r in ordered for s in r["sizes"]], np.int32),
        paths=[plan.keys[i] for i in ok.tolist()],
        boxes=np.asarray([b for r in ordered for b in r["boxes"]], np.int32) if opts.fit == "pad" else None,
        extra_labels={name: np.asarray(values)[ok] for name, values in plan.extra_labels.items()},
    )

    manifest = Manifest(
        dataset=plan.dataset,
        split=plan.split,
        count=count,
        shape=sample_shape,
        storage=opts.storage,
        classes=tuple(plan.classes),
        fit=opts.fit,
        interpolation=f"{opts.interpolation}" + ("+jpeg-dct-reduce" if opts.reduced_decode else ""),
        source={"root": str(Path(plan.root).resolve()), "fingerprint": plan.fingerprint, "files": len(plan)},
        build={"key": key, **params, "on_error": opts.on_error, "exif_orientation": "ignored"},
        tool=tool_versions(),
        shards=tuple(shards),
        arrays=arrays,
        failures=failures,
        extra=plan.extra,
        created=utc_now(),
    )
    shutil.rmtree(staging / "blocks")
    (staging / "build.json").unlink()  # from here a killed build starts afresh (safe: nothing is half-done)
    (staging / COMPACTING).unlink(missing_ok=True)
    commit_cache(staging, out, manifest, replace=opts.force)
    return manifest
