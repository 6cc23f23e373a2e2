"""The build: a plan -> blocks of images -> joblib workers -> storage sinks -> manifest -> rename into place.

Workers decode a block straight into the sink their storage backend gives them (``cachebuild.storage``:
an npy shard of its own, or whole chunks of the zarr array), so the parent never holds pixels and memory
stays flat. A block is finished when its record (``blocks/block-NNNNN.json``) exists; a killed build
resumes by skipping those. Block boundaries depend only on the plan, so the arrays are byte-identical
whatever ``--jobs`` is. After the last block the backend puts samples in their final places
(``Backend.finish``), then the manifest is written and the staging folder renamed into place.

No joblib backend is fixed here: run under ``joblib.parallel_config(backend="dask")`` to use a cluster.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
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

from cachebuild.atomic import write_json_atomic
from cachebuild.build.decode import ANTIALIAS_FROM, DEFAULT_MAX_PIXELS, FITS, INTERPOLATIONS, ResizeSpec, decode_into
from cachebuild.build.destination import check_outside_source, check_replaceable, is_own_staging, output_error
from cachebuild.errors import CacheBuildError, CacheExistsError, DecodeError, OptionError, SourceError
from cachebuild.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Failure, Manifest
from cachebuild.storage.reader import read_manifest
from cachebuild.format.pathnames import decode_path, encode_path
from cachebuild.storage.source_inputs import save_source_inputs
from cachebuild.storage.writer import commit_cache, save_side_arrays, staging_path, tool_versions, utc_now
from cachebuild.build.locks import exclusive_lock
from cachebuild.options import parse_bool, parse_choice, parse_float, parse_int, parse_optional_bool
from cachebuild.sources.plan import Plan, block_reader
from cachebuild.storage import backend_names, get_backend, is_url

__all__ = ["COMPRESSIONS", "MAX_SIZE", "ON_ERROR", "BuildOptions", "BuildResult", "build"]

log = logging.getLogger("cachebuild")

BLOCK_TARGET_BYTES = 64 << 20  # ~64 MB of pixels per block/shard: few files, tasks long enough to amortise
MIN_BLOCKS = 64  # a plan of n files makes at least min(64, n / 64) blocks
COMPRESSIONS = ("none", "zstd", "blosc")  # chunk codecs, for the storage kinds that compress (zarr)
SUBSAMPLINGS = ("420", "444")  # chroma subsampling, for the storage kinds that encode samples (jpeg)
DECODE_DEVICES = ("cpu", "cuda")
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
    chunk_size: int | None = None  # samples per chunk, for storage kinds that chunk (zarr)
    compression: str = "none"
    quality: int = 90  # storage kinds that encode samples (jpeg): encoder quality 1..100
    subsampling: str = "420"  # ... and chroma subsampling, "420" or "444"
    decode_device: str = "cpu"  # "cuda": decode source JPEGs in batches on the GPU (cachebuild.build.gpu_build)
    on_error: str = "skip"  # or "fail"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = True
    force: bool = False
    progress: bool | None = None  # None: a bar when stderr is a terminal
    lock_wait: float | None = None  # another build of the same output: None fail at once, N s, math.inf

    def __post_init__(self) -> None:
        """Every value checked here, so a build that cannot be right never starts (an unknown ``fit``
        would build a cache no reader opens; an unknown interpolation would be recorded but not used)."""
        parse_int("size", self.size, 1, MAX_SIZE)
        parse_choice("fit", self.fit, FITS)
        parse_choice("interpolation", self.interpolation, INTERPOLATIONS)
        parse_choice("storage", self.storage, backend_names())
        parse_int("jobs", self.jobs, not_zero=True)
        parse_int("block_size", self.block_size, 1, optional=True)
        parse_int("chunk_size", self.chunk_size, 1, optional=True)
        parse_choice("compression", self.compression, COMPRESSIONS)
        parse_int("quality", self.quality, 1, 100)
        parse_choice("subsampling", self.subsampling, SUBSAMPLINGS)
        parse_choice("decode_device", self.decode_device, DECODE_DEVICES)
        parse_choice("on_error", self.on_error, ON_ERROR)
        parse_int("max_pixels", self.max_pixels, 1)
        parse_bool("reduced_decode", self.reduced_decode)
        parse_bool("force", self.force)
        parse_optional_bool("progress", self.progress)
        if self.lock_wait is not None and self.lock_wait != math.inf:  # inf: wait as long as it takes
            parse_float("lock_wait", self.lock_wait, 0.0)
        try:  # what only the storage kind knows (e.g. npy and jpeg shards take no compression)
            get_backend(self.storage).build_params(self)
        except ValueError as e:
            raise OptionError(str(e)) from None

    def resolved_block(self, planned: int | None = None) -> int:
        """Samples per block: ``block_size``, else ~64 MB of pixels, but small enough that a plan of
        ``planned`` files makes >= 64 blocks (so every worker stays busy to the end of a small build:
        at 21 blocks for 2 workers the last one ran alone ~10% of the time). It depends on the plan alone,
        never on --jobs, so the shard layout does not either."""
        per = self.size * self.size * 3
        block = self.block_size or int(min(8192, max(64, BLOCK_TARGET_BYTES // per // 64 * 64)))
        if not self.block_size and planned:
            block = min(block, max(64, -(-planned // MIN_BLOCKS // 64) * 64))
        return get_backend(self.storage).align_block(block, self)

    def resolved_chunk(self) -> int | None:
        """Samples per chunk of the storage kind (None for kinds without chunks)."""
        return get_backend(self.storage).build_params(self).get("chunk_size")


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
               staging: str, on_error: str, storage: str, params: dict[str, Any],
               decode_device: str = "cpu", claim: str = "") -> dict[str, Any]:
    """Decode one block into its storage backend's sink and write its record; returns the record.

    Each sample is decoded into its sink's reused slot; the sink writes and hashes it while it is hot in
    cache (``Sink.close``). No fsync: a finished
    block survives any kill of the build (the kernel holds the pages); after a machine crash,
    ``cachebuild verify`` checks every shard against its checksum. ``decode_device="cuda"`` decodes the
    block's sources in batches on this worker's GPU instead (``cachebuild.build.gpu_build``).
    """
    _init_worker()
    folder = Path(staging)
    shape = (spec.size, spec.size, 3)
    sink = get_backend(storage).sink(folder, block, start, len(keys), shape, params)
    ok, sizes, boxes, failures = [], [], [], []
    if decode_device == "cpu":
        def fill(i: int, key: str, slot: np.ndarray) -> Any:
            return decode_into(plan_reader(start + i, key), spec, slot, path=key)
    else:
        from cachebuild.build.gpu_build import GpuBlockDecoder  # only imported where a GPU build runs

        fill = GpuBlockDecoder(plan_reader, keys, start, spec, claim)
    try:
        for i, key in enumerate(keys):
            slot = sink.next_slot()
            try:
                placed = fill(i, key, slot)
            except SourceError:  # the source itself failed (a shard changed since planning, a dead server): stop
                raise
            except Exception as e:  # whatever one file does (reader or decoder) is that file's skip
                reason = _skip_reason(e)
                if on_error == "fail":
                    raise DecodeError(key, reason) from None
                failures.append({"index": start + i, "path": encode_path(key), "reason": reason})
                continue
            sink.commit()
            ok.append(start + i)
            sizes.append([placed.height, placed.width])
            boxes.append(list(placed.box))
    except BaseException:
        sink.abort()
        raise
    file, sha256 = sink.close()
    record = {"block": block, "start": start, "planned": len(keys), "count": len(ok), "file": file,
              "sha256": sha256, "ok": ok, "sizes": sizes, "boxes": boxes, "failures": failures,
              # what a backend records beyond its checksum (jpeg: the stored size)
              **getattr(sink, "record_fields", {})}
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
        **get_backend(opts.storage).build_params(opts),  # chunk_size, compression
        "max_pixels": opts.max_pixels,
        "reduced_decode": opts.reduced_decode,
    }
    if opts.decode_device != "cpu":  # other pixels than a CPU build (close, not equal): another cache
        params["decode_device"] = opts.decode_device
    if opts.interpolation == "antialias":  # the resize policy's switch-over scale: other pixels, another cache
        params["antialias_from"] = ANTIALIAS_FROM
        if opts.reduced_decode:  # DCT-reduced JPEGs fitted with the source's geometry (decode._fit_reduced):
            params["reduced_geometry"] = "source"  # other pixels than earlier releases, so never resumed into
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
    if existing.format_version != FORMAT_VERSION:
        raise CacheExistsError(
            f"{out} holds a cache written by another cachebuild release (format version "
            f"{existing.format_version}; this one writes {FORMAT_VERSION}); it still reads, but pass --force to "
            f"rebuild it with this release, or choose another --out"
        )
    raise CacheExistsError(
        f"{out} holds a different cache (other source files or build parameters); "
        f"pass --force to replace it, or choose another --out"
    )


def _prepare_staging(staging: Path, key: str, storage: str) -> dict[int, dict[str, Any]]:
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
    get_backend(storage).resume(staging, lambda block: _record_path(staging, block).unlink(missing_ok=True))
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
def _exclusive(out: Path, wait: float | None = None) -> Iterator[None]:
    """One build per output at a time: two would share one staging folder. The lock names its holder and
    the kernel drops it when the process dies, so a killed build never leaves a stale lock behind
    (``cachebuild.build.locks``)."""
    with exclusive_lock(out, wait=wait):
        yield


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
        if not is_url(str(plan.root)):
            check_outside_source(out, plan.root)
        _check_destination(out, _build_key(plan, opts)[0], opts.force)
        with _exclusive(out, opts.lock_wait):
            return _build_locked(plan, out, opts)
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


def _build_locked(plan: Plan, out: Path, opts: BuildOptions) -> BuildResult:
    t0 = time.perf_counter()
    key, params = _build_key(plan, opts)
    jobs, claim = opts.jobs, ""
    if opts.decode_device != "cpu":
        from cachebuild.build.gpu_build import gpu_workers  # only imported where a GPU build is asked for

        jobs, claim = gpu_workers(opts.decode_device)
    m = _check_destination(out, key, opts.force)
    if m is not None:
        return BuildResult(out, "up to date", m.count, len(m.failures), 0.0, 0)
    staging = staging_path(out)
    done = _prepare_staging(staging, key, opts.storage)

    spec = ResizeSpec(size=opts.size, fit=opts.fit, interpolation=opts.interpolation,
                      max_pixels=opts.max_pixels, reduced_decode=opts.reduced_decode)
    bs = opts.resolved_block(len(plan))
    n = len(plan)
    get_backend(opts.storage).prepare(staging, n, (spec.size, spec.size, 3), opts)
    storage_params = get_backend(opts.storage).build_params(opts)
    blocks = list(enumerate(range(0, n, bs)))
    todo = [(b, lo) for b, lo in blocks if b not in done]
    if done:
        log.info("resuming %s: %d of %d blocks already built", out, len(done), len(blocks))
    records = dict(done)
    tasks = (
        delayed(_run_block)(block_reader(plan.reader, lo, lo + bs), list(plan.keys[lo : lo + bs]), lo, b, spec,
                            str(staging), opts.on_error, opts.storage, storage_params, opts.decode_device, claim)
        for b, lo in todo
    )
    with _progress(n, sum(r["planned"] for r in done.values()), f"{plan.dataset}/{plan.split}",
                   opts.progress) as bar:
        for rec in Parallel(n_jobs=jobs, return_as="generator_unordered")(tasks):
            records[rec["block"]] = rec
            bar.update(rec["planned"])
    manifest = _finish(plan, out, staging, records, opts, params, key, spec)
    seconds = time.perf_counter() - t0
    # Bytes as stored: kinds that encode samples say so in their block records.
    written = sum(int(r.get("stored_bytes", r["count"] * manifest.sample_nbytes)) for r in records.values())
    return BuildResult(out, "built", manifest.count, len(manifest.failures), seconds, written)


def _finish(plan: Plan, out: Path, staging: Path, records: dict[int, dict[str, Any]], opts: BuildOptions,
            params: dict[str, Any], key: str, spec: ResizeSpec) -> Manifest:
    """Merge block records (in plan order) into side arrays and the manifest; commit atomically."""
    ordered = [records[b] for b in sorted(records)]
    ok = np.asarray([i for r in ordered for i in r["ok"]], dtype=np.int64)
    count = len(ok)
    failures = tuple(Failure(decode_path(f["path"], "a block record"), f["reason"])
                     for r in ordered for f in r["failures"])
    if count == 0:
        raise CacheBuildError(
            f"none of the {len(plan)} source files of {plan.root} could be read; first failure: "
            f"{failures[0].path}: {failures[0].reason}" if failures else f"{plan.root} has no samples"
        )
    sample_shape = (spec.size, spec.size, 3)
    backend = get_backend(opts.storage)
    shards = backend.finish(staging, ordered, count, len(plan))

    arrays = save_side_arrays(
        staging,
        labels=plan.labels[ok],
        sizes=np.asarray([s for r in ordered for s in r["sizes"]], np.int32),
        paths=[plan.keys[i] for i in ok.tolist()],
        boxes=np.asarray([b for r in ordered for b in r["boxes"]], np.int32) if opts.fit == "pad" else None,
        extra_labels={name: np.asarray(values)[ok] for name, values in plan.extra_labels.items()},
    )

    root = plan.root if is_url(plan.root) else str(Path(plan.root).resolve())
    source: dict[str, Any] = {"root": root, "fingerprint": plan.fingerprint, "files": len(plan)}
    if plan.recipe:  # how to plan the source again (`cachebuild status`)
        source["recipe"] = plan.recipe
    if plan.file_stats is not None:  # what `cachebuild status` compares a source against, file by file
        source["inputs"] = save_source_inputs(staging, plan.keys, plan.labels, plan.file_stats)
    manifest = Manifest(
        dataset=plan.dataset,
        split=plan.split,
        count=count,
        shape=sample_shape,
        storage=opts.storage,
        classes=tuple(plan.classes),
        fit=opts.fit,
        interpolation=f"{opts.interpolation}" + ("+jpeg-dct-reduce" if opts.reduced_decode else ""),
        source=source,
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
    backend.cleanup(staging)
    return commit_cache(staging, out, manifest, replace=opts.force)  # drops killed writers' temporary files
