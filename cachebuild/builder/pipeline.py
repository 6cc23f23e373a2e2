"""The build: a plan -> blocks of images -> joblib workers -> storage sinks -> manifest -> rename into place.

Workers decode a block straight into the sink their storage backend gives them (an npy shard of its own, or
whole chunks of the zarr array), so the build never holds a block's pixels twice and memory stays flat. A
block is finished when its record (``blocks/block-NNNNN.json``) exists; a killed build resumes by skipping
those. Block boundaries depend only on the plan, so the arrays are byte-identical whatever ``--jobs``, and
whatever runs the blocks. After the last block the backend puts samples in their final places
(``Backend.finish``), the block records become the side arrays and the manifest, and the staging folder is
renamed into place.

What runs the blocks is joblib's choice under one rule (:func:`_prefer`): threads of this process, which start
at once and share their imports; the heavy steps of a sample (file reads, libjpeg-turbo, OpenCV, torch) run
outside the GIL, its hashes (xxhash) and per-sample Python inside it, which worker processes would not contend
for, but a loky pool whose manager thread dies leaves joblib waiting for ever, and a build must not hang.
Processes where a worker needs one of its own (a GPU, or a storage kind whose sinks threads must not share).
A caller's ``joblib.parallel_config`` wins: under ``parallel_config(backend="dask")`` (``--dask-scheduler``) the
blocks run on a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from joblib import Parallel, delayed
from joblib.externals.loky.process_executor import TerminatedWorkerError

from cachebuild.atomic import write_json_atomic
from cachebuild.builder.block import BlockTask, load_input_digests, run_block
from cachebuild.builder.destination import (
    check_destination,
    check_outside_source,
    output_error,
    prepare_staging,
    replaced_cache,
)
from cachebuild.builder.locks import exclusive_lock
from cachebuild.builder.options import BuildOptions, BuildResult, build_key
from cachebuild.builder.sample import ResizeSpec, one_thread_each, pixel_tools
from cachebuild.builder.update import (
    Reuse,
    end_worker_processes,
    gc_paused,
    plan_reuse,
    racy_files,
    release_reader,
)
from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import Failure, Manifest, decode_path
from cachebuild.sources.plan import Plan, block_reader
from cachebuild.storage import get_backend, is_url
from cachebuild.storage.cache import (
    commit_cache,
    save_side_arrays,
    save_source_inputs,
    staging_path,
    tool_versions,
    utc_now,
)
from cachebuild.storage.kinds.base import BlockRecord

__all__ = ["BuildOptions", "BuildResult", "build", "build_source", "default_out", "plan_build"]

log = logging.getLogger("cachebuild")


def default_out(dataset: str, size: int, fit: str, storage: str) -> Path:
    """``$CACHEBUILD_HOME`` (default ``~/.cache/cachebuild``) / ``<dataset>-<size>[-<fit>][-<storage>]``."""
    from cachebuild.settings import settings
    from cachebuild.storage import DEFAULT_STORAGE

    name = f"{dataset}-{size}" + ("" if fit == "crop" else f"-{fit}")
    return settings().home / (name + ("" if storage == DEFAULT_STORAGE else f"-{storage}"))


def build_source(kind: str, src: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                 size: int | None = None, classes: list[str] | None = None,
                 report: Callable[[BuildResult], None] | None = None, **options: Any) -> list[BuildResult]:
    """Build the caches of ``src``, a source of the registered ``kind`` (``"imagenet"``, ``"cifar10"``,
    ``"folder"``, ``"wds"``...), one folder per split under ``out``: what ``cachebuild KIND SRC`` does.

    ``options``: the kind's own options (``split=``, ``val_labels=``...) and any field of
    :class:`BuildOptions` (``fit=``, ``storage=``, ``jobs=``...); ``size`` defaults to the kind's.
    ``report`` is called with each split's result as it is done."""
    t0 = time.perf_counter()
    plans, opts = plan_build(kind, src, size=size, classes=classes, **options)
    planned = time.perf_counter() - t0
    root = Path(out) if out is not None else default_out(plans[0].dataset, opts.size, opts.fit, opts.storage)
    results = []
    for plan in plans:
        log.info("%s/%s: %d files from %s -> %s", plan.dataset, plan.split, len(plan), plan.root, root / plan.split)
        results.append(build(plan, root / plan.split, opts))
        if report is not None:
            report(results[-1])
    if opts.summary is not None:  # --json FILE: the builds' counts (integers) and seconds, in all and per split
        total = {k: sum(r.summary()[k] for r in results)
                 for k in ("count", "decoded", "reused", "skipped", "bytes_written")}
        write_json_atomic(Path(opts.summary), {**total, "plan_seconds": round(planned, 3),
                                               "seconds": round(time.perf_counter() - t0, 3),
                                               "splits": [r.summary() for r in results]})
    return results


def plan_build(kind: str, src: str | os.PathLike[str], *, size: int | None = None, classes: list[str] | None = None,
               **options: Any) -> tuple[list[Plan], BuildOptions]:
    """The plans of ``src`` (one per split) and the build's options, from the keyword arguments of
    :func:`build_source` (the kind's own options and the fields of :class:`BuildOptions`): a listing and a
    ``stat`` per file, nothing decoded."""
    from cachebuild.sources.registry import get_source, plan_source

    source = get_source(kind)
    own = {f.name for f in dataclasses.fields(source.options)}
    opts = BuildOptions(size=size or source.default_size, **{k: v for k, v in options.items() if k not in own})
    plans = plan_source(kind, src, source.options(**{k: v for k, v in options.items() if k in own}),
                        classes=classes, jobs=opts.jobs)
    return plans, opts


def build(plan: Plan, out: str | os.PathLike[str], opts: BuildOptions) -> BuildResult:
    """Build (or resume, or confirm up to date) the cache of ``plan`` at ``out``.

    Errors of the output's environment (no space, read-only, no permission, a file in the way) and a worker
    process that died come out as one-line :class:`CacheBuildError` s naming the path; the finished blocks stay
    in ``<out>.partial`` and the same call resumes from them.
    """
    out = Path(out)
    staging = staging_path(out)
    key, params = build_key(plan, opts)
    try:
        # Refused before anything (the lock file) is made beside the destination; checked again under the lock.
        if not is_url(str(plan.root)):
            check_outside_source(out, plan.root)
        check_destination(out, plan.source_digest, key, params, opts.force, opts.update)
        with exclusive_lock(out, wait=opts.lock_wait):  # one build per output: two would share one staging folder
            t0 = time.perf_counter()
            m = check_destination(out, plan.source_digest, key, params, opts.force, opts.update)
            if m is not None and opts.update and racy_files(plan, m):  # same stats, but maybe not the same bytes
                log.info("%s: %d files were modified too close to its build to be trusted: decoding them again",
                         out, racy_files(plan, m))
                m = None
            if m is not None:
                return BuildResult(out, "up to date", m.count, len(m.failures), 0.0, 0, decoded=0, reused=m.count)
            if opts.force and (replaced := replaced_cache(out, plan.source_digest, params)):
                log.info("%s: replacing %s", out, replaced)
            # an update refuses another recipe before anything is written
            reuse = plan_reuse(out, plan, params, opts.resolved_block(len(plan)), opts.jobs) if opts.update else None
            records, tasks, jobs = _blocks(plan, out, opts, key, reuse)
            with _block_settings(opts, reuse), _progress(len(plan), sum(r.planned for r in records.values()),
                                                         f"{plan.dataset}/{plan.split}", opts.progress) as bar:
                for rec in Parallel(n_jobs=jobs, prefer=_prefer(opts), return_as="generator_unordered")(tasks):
                    records[rec.block] = rec
                    bar.update(rec.planned)
            if reuse is not None:
                release_reader()  # this process's reader of the cache an update replaces: gone before the commit
                if jobs > 1 and _prefer(opts) == "processes":
                    end_worker_processes()  # and the workers' readers, which would keep it on disk
            manifest = _finish(plan, out, records, opts, params, key, reuse)
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
    # Bytes as stored: kinds that encode samples say so in their block records.
    written = sum(r.count * manifest.sample_nbytes if r.stored_bytes is None else r.stored_bytes
                  for r in records.values())
    reused = sum(r.reused for r in records.values())
    return BuildResult(out, "built", manifest.count, len(manifest.failures), time.perf_counter() - t0, written,
                       decoded=sum(r.planned for r in records.values()) - reused, reused=reused)


def _prefer(opts: BuildOptions) -> str:
    """What runs the blocks, the one rule: threads, but where each worker needs a process of its own (a GPU
    build: one CUDA context and nvJPEG decoder per worker; a storage kind whose sinks threads must not share)."""
    return "threads" if opts.decode_device == "cpu" and get_backend(opts.storage).threaded_sinks else "processes"


def _blocks(plan: Plan, out: Path, opts: BuildOptions, key: str, reuse: Reuse | None
            ) -> tuple[dict[int, BlockRecord], Iterator[Any], int]:
    """The staging folder made or reopened: the records of the blocks an earlier run finished, the tasks of the
    others, and how many workers run them."""
    staging = staging_path(out)
    done = prepare_staging(staging, key, opts.storage)
    spec = ResizeSpec(size=opts.size, fit=opts.fit, interpolation=opts.interpolation, max_pixels=opts.max_pixels,
                      reduced_decode=opts.reduced_decode, exif_orientation=opts.exif_orientation)
    jobs, claim = opts.jobs, ""
    if opts.decode_device != "cpu":
        from cachebuild.builder.gpu_build import gpu_workers  # only imported where a GPU build is asked for

        jobs, claim = gpu_workers(opts.decode_device)
    backend = get_backend(opts.storage)
    n, bs = len(plan), opts.resolved_block(len(plan))
    backend.prepare(staging, n, (spec.size, spec.size, 3), opts)
    params = backend.build_params(opts)
    todo = [(b, lo) for b, lo in enumerate(range(0, n, bs)) if b not in done]
    if done:
        log.info("resuming %s: %d of %d blocks already built", out, len(done), len(done) + len(todo))
    tasks = (delayed(run_block)(BlockTask(block_reader(plan.reader, lo, lo + bs), list(plan.keys[lo : lo + bs]),
                                          lo, b, spec, str(staging), opts.on_error, opts.storage, params,
                                          opts.decode_device, claim,
                                          None if reuse is None else reuse.for_block(lo, lo + bs),
                                          digest_inputs=plan.file_stats is not None))
             for b, lo in todo)
    return dict(done), tasks, jobs


@contextlib.contextmanager
def _block_settings(opts: BuildOptions, reuse: Reuse | None) -> Iterator[None]:
    """Blocks in this process's threads: one thread each for the kernels, and an update's copies, which make no
    cycles worth the collector's passes over the plan, with the collector paused."""
    with contextlib.ExitStack() as stack:
        if _prefer(opts) == "threads":
            stack.enter_context(one_thread_each())
            if reuse is not None:
                stack.enter_context(gc_paused())
        yield


class _NoBar:
    """The bar when there is none: no tqdm import."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _progress(total: int, initial: int, desc: str, enabled: bool | None) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="img", smoothing=0.1)


def _joined(parts: list[np.ndarray], dtype: type[np.signedinteger[Any]], cols: int) -> np.ndarray:
    """The blocks' per-sample arrays end to end, in plan order (one copy; none of the blocks: no rows)."""
    if not parts:
        return np.zeros(0 if cols == 1 else (0, cols), dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def _finish(plan: Plan, out: Path, records: dict[int, BlockRecord], opts: BuildOptions, params: dict[str, Any],
            key: str, reuse: Reuse | None) -> Manifest:
    """Block records (in plan order) -> side arrays and the manifest, committed atomically. An update's columns
    are written for the new samples into the staging folder, so they commit with it."""
    staging = staging_path(out)
    ordered = [records[b] for b in sorted(records)]
    ok = _joined([r.ok for r in ordered], np.int64, 1)
    failures = tuple(Failure(decode_path(f.path, "a block record"), f.reason) for r in ordered for f in r.failures)
    if not len(ok):
        raise CacheBuildError(
            f"none of the {len(plan)} source files of {plan.root} could be read; first failure: "
            f"{failures[0].path}: {failures[0].reason}" if failures else f"{plan.root} has no samples"
        )
    backend = get_backend(opts.storage)
    shards = backend.finish(staging, ordered, len(ok), len(plan))
    arrays = save_side_arrays(
        staging,
        labels=plan.labels[ok],
        sizes=_joined([r.sizes for r in ordered], np.int32, 2),
        paths=[plan.keys[i] for i in ok.tolist()],
        boxes=_joined([r.boxes for r in ordered], np.int32, 4) if opts.fit == "pad" else None,
        extra_labels={name: np.asarray(values)[ok] for name, values in plan.extra_labels.items()},
    )
    root = plan.root if is_url(plan.root) else str(Path(plan.root).resolve())
    source: dict[str, Any] = {"root": root, "fingerprint": plan.source_digest, "files": len(plan)}
    if plan.recipe:  # how to plan the source again (`cachebuild status`)
        source["recipe"] = plan.recipe
    if plan.file_stats is not None:  # what `cachebuild status` compares a source against, file by file
        digests = load_input_digests(staging, ordered, len(plan), None if reuse is None else reuse.digests)
        source["inputs"] = save_source_inputs(staging, plan.keys, plan.labels, plan.file_stats, digests)
        if plan.listed_ns is not None:  # when those stats were taken: what an update trusts them from
            source["inputs"]["listed_ns"] = plan.listed_ns
    manifest = Manifest(
        dataset=plan.dataset,
        split=plan.split,
        count=len(ok),
        shape=(opts.size, opts.size, 3),
        storage=opts.storage,
        classes=tuple(plan.classes),
        fit=opts.fit,
        interpolation=f"{opts.interpolation}" + ("+jpeg-dct-reduce" if opts.reduced_decode else ""),
        source=source,
        build={"key": key, **params, "on_error": opts.on_error, "exif_orientation": opts.exif_orientation},
        tool={**tool_versions(), **pixel_tools()},
        shards=tuple(shards),
        arrays=arrays,
        failures=failures,
        extra=plan.extra,
        created=utc_now(),
    )
    if reuse is not None and reuse.columns is not None:
        manifest = dataclasses.replace(manifest, columns=reuse.columns.write(staging, ok))
    shutil.rmtree(staging / "blocks")
    (staging / "build.json").unlink()  # from here a killed build starts afresh (safe: nothing is half-done)
    backend.cleanup(staging)
    # drops killed writers' temporary files; an update replaces the old cache as --force does
    return commit_cache(staging, out, manifest, replace=opts.force or opts.update)
