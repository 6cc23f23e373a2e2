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

from cachebuild.atomic import write_json_atomic
from cachebuild.decode import DEFAULT_MAX_PIXELS, ResizeSpec, decode_into
from cachebuild.errors import CacheBuildError, CacheExistsError, DecodeError
from cachebuild.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Failure, Manifest, read_manifest
from cachebuild.format.source_inputs import save_source_inputs
from cachebuild.format.writer import commit_cache, save_side_arrays, staging_path, tool_versions, utc_now
from cachebuild.locks import exclusive_lock
from cachebuild.sources.plan import Plan, block_reader
from cachebuild.storage import get_backend, is_url

__all__ = ["BuildOptions", "BuildResult", "build"]

log = logging.getLogger("cachebuild")

BLOCK_TARGET_BYTES = 64 << 20  # ~64 MB of pixels per block/shard: few files, tasks long enough to amortise
MIN_BLOCKS = 64  # a plan of n files makes at least min(64, n / 64) blocks


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
    decode_device: str = "cpu"  # "cuda": decode source JPEGs in batches on the GPU (cachebuild.gpu_build)
    on_error: str = "skip"  # or "fail"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = True
    force: bool = False
    progress: bool | None = None  # None: a bar when stderr is a terminal
    lock_wait: float | None = None  # another build of the same output: None fail at once, N s, math.inf

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


def _run_block(plan_reader: Any, keys: list[str], start: int, block: int, spec: ResizeSpec,
               staging: str, on_error: str, storage: str, params: dict[str, Any],
               decode_device: str = "cpu", claim: str = "") -> dict[str, Any]:
    """Decode one block into its storage backend's sink and write its record; returns the record.

    Each sample is decoded into a reused buffer and hashed while it is hot in cache. No fsync: a finished
    block survives any kill of the build (the kernel holds the pages); after a machine crash,
    ``cachebuild verify`` checks every shard against its checksum. ``decode_device="cuda"`` decodes the
    block's sources in batches on this worker's GPU instead (``cachebuild.gpu_build``).
    """
    _init_worker()
    folder = Path(staging)
    shape = (spec.size, spec.size, 3)
    sink = get_backend(storage).sink(folder, block, start, len(keys), shape, params)
    digest = hashlib.sha256()
    ok, sizes, boxes, failures = [], [], [], []
    if decode_device == "cpu":
        def fill(i: int, key: str, slot: np.ndarray) -> Any:
            return decode_into(plan_reader(start + i, key), spec, slot, path=key)
    else:
        from cachebuild.gpu_build import GpuBlockDecoder  # only imported where a GPU build runs

        fill = GpuBlockDecoder(plan_reader, keys, start, spec, claim)
    try:
        for i, key in enumerate(keys):
            slot = sink.next_slot()
            try:
                placed = fill(i, key, slot)
            except (DecodeError, OSError) as e:
                reason = e.reason if isinstance(e, DecodeError) else f"unreadable: {e.strerror or e}"
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
              "sha256": digest.hexdigest(), "ok": ok, "sizes": sizes, "boxes": boxes, "failures": failures,
              # what a backend records beyond the raw pixels' checksum (jpeg: the stored shard's own)
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
    blob = json.dumps({"source": plan.fingerprint, "params": params}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest(), params


def _check_destination(out: Path, key: str, force: bool) -> Manifest | None:
    """The manifest of ``out`` when it already holds this exact build, else None (``out`` may be
    replaced). Raises rather than overwrite anything else without ``force``."""
    if not out.exists():
        return None
    if (out / MANIFEST_NAME).is_file():
        try:
            existing = read_manifest(out)
        except CacheBuildError:
            existing = None
        if existing is not None and existing.build_key == key and not force:
            return existing
        if not force:
            raise CacheExistsError(
                f"{out} holds a different cache (other source files or build parameters); "
                f"pass --force to replace it, or choose another --out"
            )
        return None
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        return None
    if not force:
        raise CacheExistsError(f"{out} exists and is not a cachebuild cache; choose another --out")
    return None


def _prepare_staging(staging: Path, key: str, storage: str) -> dict[int, dict[str, Any]]:
    """Create or reopen the staging folder; return the records of blocks finished by an earlier run."""
    build_file = staging / "build.json"
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
    (``cachebuild.locks``)."""
    with exclusive_lock(out, wait=wait):
        yield


def build(plan: Plan, out: str | os.PathLike[str], opts: BuildOptions) -> BuildResult:
    """Build (or resume, or confirm up to date) the cache of ``plan`` at ``out``."""
    out = Path(out)
    with _exclusive(out, opts.lock_wait):
        return _build_locked(plan, out, opts)


def _build_locked(plan: Plan, out: Path, opts: BuildOptions) -> BuildResult:
    t0 = time.perf_counter()
    key, params = _build_key(plan, opts)
    jobs, claim = opts.jobs, ""
    if opts.decode_device != "cpu":
        from cachebuild.gpu_build import gpu_workers  # only imported where a GPU build is asked for

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
    failures = tuple(Failure(f["path"], f["reason"]) for r in ordered for f in r["failures"])
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
