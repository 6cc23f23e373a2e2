"""The build: a plan -> blocks of images -> joblib workers -> storage sinks -> manifest -> rename into place.

Workers (threads of this process for a local build of photos, else loky processes: ``worker_kind``) decode
a block straight into the sink their storage backend gives them (``cachebuild.storage``: an npy shard of its
own, or whole chunks of the zarr array), so the parent never holds pixels and memory stays flat. A block is
finished when its record (``blocks/block-NNNNN.json``) exists; a killed build resumes by skipping those.
Block boundaries depend only on the plan, so the arrays are byte-identical whatever ``--jobs`` (or
``--workers``) is. After the last block the backend puts samples in their final places (``Backend.finish``),
then the manifest is written and the staging folder renamed into place.

The steps, one module each: ``options`` (what is asked), ``staging`` (key, destination, resume),
``block`` (one block's work in a worker), ``finish`` (records -> manifest -> commit); this module runs them.
No joblib backend is fixed here: run under ``joblib.parallel_config(backend="dask")`` to use a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from joblib import Parallel, delayed, effective_n_jobs
from joblib.externals.loky.process_executor import TerminatedWorkerError

from cachebuild.builder.block import BlockTask, run_block
from cachebuild.builder.destination import check_outside_source, output_error
from cachebuild.builder.finish import finish
from cachebuild.builder.locks import exclusive_lock
from cachebuild.builder.options import COMPRESSIONS, MAX_SIZE, ON_ERROR, BuildOptions, BuildResult
from cachebuild.builder.sample.geometry import TORCH_RESIZE_FROM, ResizeSpec
from cachebuild.builder.small_plan import default_backend, in_process, runs_in_process, update_runs_in_process
from cachebuild.builder.staging import build_key, check_destination, prepare_staging
from cachebuild.builder.update import gc_paused, plan_reuse, racy_files, release_reader
from cachebuild.builder.worker_kind import use_threads
from cachebuild.errors import CacheBuildError
from cachebuild.sources.plan import Plan, block_reader
from cachebuild.storage import get_backend, is_url
from cachebuild.storage.cache import staging_path

__all__ = ["COMPRESSIONS", "MAX_SIZE", "ON_ERROR", "BuildOptions", "BuildResult", "build"]

log = logging.getLogger("cachebuild")


class _NoBar:
    """The bar when there is none: no tqdm import (~30 ms of a build's start-up, issue 36)."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _progress(total: int, initial: int, desc: str, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="img", smoothing=0.1)


@contextlib.contextmanager
def _exclusive(out: Path, wait: float | None = None) -> Iterator[None]:
    """One build per output at a time: two would share one staging folder. The lock names its holder and
    the kernel drops it when the process dies, so a killed build never leaves a stale lock behind
    (``cachebuild.builder.locks``)."""
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
        check_destination(out, build_key(plan, opts)[0], opts.force, opts.update)
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
    key, params = build_key(plan, opts)
    jobs, claim = opts.jobs, ""
    if opts.decode_device != "cpu":
        from cachebuild.builder.gpu_build import gpu_workers  # only imported where a GPU build is asked for

        jobs, claim = gpu_workers(opts.decode_device)
    m = check_destination(out, key, opts.force, opts.update)
    if m is not None and opts.update and racy_files(plan, m):  # same stats, but maybe not the same bytes
        log.info("%s: %d files were modified too close to its build to be trusted: decoding them again", out,
                 racy_files(plan, m))
        m = None
    if m is not None:
        return BuildResult(out, "up to date", m.count, len(m.failures), 0.0, 0, decoded=0, reused=m.count)
    # an update refuses another recipe before anything is written
    reuse = plan_reuse(out, plan, params, opts.resolved_block(len(plan))) if opts.update else None
    staging = staging_path(out)
    done = prepare_staging(staging, key, opts.storage)

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
    inline = opts.decode_device == "cpu" and (runs_in_process(jobs, plan) or (reuse is not None and
                                              update_runs_in_process(plan, reuse.old < 0,
                                                                     reuse.reused * spec.size * spec.size * 3)))
    # the same bytes either way: torch's resize only where a worker's share pays for importing it
    to_decode = sum(min(n, lo + bs) - lo for _, lo in todo) - (0 if reuse is None else reuse.reused)
    torch_resize = (opts.decode_device == "cpu" and spec.interpolation == "antialias" and not inline
                    and to_decode >= TORCH_RESIZE_FROM * max(1, effective_n_jobs(jobs)))
    pool = opts.decode_device == "cpu" and not inline and effective_n_jobs(jobs) > 1 and default_backend()
    threads = use_threads(opts.workers, plan, pool=pool, torch_resize=torch_resize, update=reuse is not None,
                          threaded_sinks=get_backend(opts.storage).threaded_sinks)
    torch_resize = torch_resize and not threads  # threads never import torch into the caller (the same bytes)
    tasks = (
        delayed(run_block)(BlockTask(block_reader(plan.reader, lo, lo + bs), list(plan.keys[lo : lo + bs]), lo, b,
                                     spec, str(staging), opts.on_error, opts.storage, storage_params,
                                     opts.decode_device, claim,
                                     None if reuse is None else reuse.for_block(lo, lo + bs), torch_resize))
        for b, lo in todo
    )
    with gc_paused(inline and reuse is not None):  # an update copying in this process: no decode between records
        with _progress(n, sum(r.planned for r in done.values()), f"{plan.dataset}/{plan.split}",
                       opts.progress) as bar, in_process(inline or threads):
            for rec in Parallel(n_jobs=1 if inline else jobs, prefer="threads" if threads else None,
                                return_as="generator_unordered")(tasks):
                records[rec.block] = rec
                bar.update(rec.planned)
        release_reader()  # in-process blocks' reader of the cache being replaced: let it go before the commit
        manifest = finish(plan, out, staging, records, opts, params, key, spec,
                          None if reuse is None else reuse.columns)
    seconds = time.perf_counter() - t0
    # Bytes as stored: kinds that encode samples say so in their block records.
    written = sum(r.count * manifest.sample_nbytes if r.stored_bytes is None else r.stored_bytes
                  for r in records.values())
    reused = sum(r.reused for r in records.values())
    return BuildResult(out, "built", manifest.count, len(manifest.failures), seconds, written,
                       decoded=sum(r.planned for r in records.values()) - reused, reused=reused)
