"""The build commands of ``cachebuild``, one per source kind, generated from the sources registry.

A command's flags are its kind's options (the fields of its options dataclass, made into flags by
:func:`cachebuild.flags.field_options`, as ``train``, ``show`` and ``report`` are), then
``--size``, then the flags every build shares (:func:`build_params`), whose defaults are read from
``BuildOptions`` and whose choices are the tuples it checks against: each is declared once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from cachebuild.cli_common import WAIT, setup_logging
from cachebuild.errors import CacheBuildError, DecodeError, MissingExtraError, OptionError, SourceError
from cachebuild.flags import field_options
from cachebuild.settings import settings
from cachebuild.sources.kind import SourceKind
from cachebuild.sources.plan import Plan
from cachebuild.storage import DEFAULT_STORAGE, backend_names, codecs

__all__ = ["SIZE", "build_command", "build_params", "default_out"]

log = logging.getLogger("cachebuild")

SIZE = click.IntRange(min=8, max=8192)


def default_out(dataset: str, size: int, fit: str, storage: str) -> Path:
    """``$CACHEBUILD_HOME`` (default ``~/.cache/cachebuild``) / ``<dataset>-<size>[-<fit>][-<storage>]``."""
    home = settings().home
    name = f"{dataset}-{size}" + ("" if fit == "crop" else f"-{fit}")
    name += "" if storage == DEFAULT_STORAGE else f"-{storage}"
    return home / name


def _codecs() -> list[str]:
    """The storage kinds that store samples encoded: ``--codec NAME`` picks one."""
    return sorted(codecs())


def build_params() -> list[click.Option]:
    """The flags every build command shares. Those named as a ``BuildOptions`` field go to it as they are."""
    from cachebuild.builder.options import COMPRESSIONS, DECODE_DEVICES, ON_ERROR, SUBSAMPLINGS, WORKERS, BuildOptions
    from cachebuild.builder.sample.geometry import FITS, INTERPOLATIONS

    default = {f.name: f.default for f in dataclasses.fields(BuildOptions)}

    def choice(flag: str, field: str, choices: tuple[str, ...] | list[str], help: str) -> click.Option:
        return click.Option([flag, field], type=click.Choice(list(choices)), default=default[field],
                            show_default=True, help=help)

    def count(flags: list[str], field: str, kind: Any, help: str) -> click.Option:
        return click.Option([*flags, field], type=kind, default=default[field],
                            show_default=default[field] is not None, help=help)

    return [
        click.Option(["--out"], type=click.Path(path_type=Path), default=None,
                     help="Output folder; one sub-folder per split. Default: $CACHEBUILD_HOME/<dataset>-<size>."),
        choice("--format", "storage", backend_names(),
               "npy: fixed-shape shards to memory-map; zarr: one v3 array chunked along samples."),
        choice("--fit", "fit", FITS,
               "crop: short side to S then centre crop; squash: to SxS; pad: letterbox, boxes recorded."),
        choice("--interpolation", "interpolation", INTERPOLATIONS,
               "antialias: PIL/torchvision's antialiased bilinear from a 2x downscale on, OpenCV bilinear below "
               "(same filter within +-1); area/linear: OpenCV."),
        count(["--jobs", "-j"], "jobs", int, "Parallel workers (joblib); -1: all cores."),
        choice("--workers", "workers", WORKERS,
               "What runs the --jobs blocks of a local CPU build: threads of this process (no start-up; the "
               "decoders release the GIL), worker processes, or auto: threads for photo-sized sources."),
        click.Option(["--dask-scheduler"], metavar="ADDRESS", default=None,
                     help="Run the blocks on a Dask cluster (joblib's dask backend), e.g. tcp://host:8786; its "
                          "workers must see SRC and --out at the same paths. Needs cachebuild[dask]."),
        count(["--shard-size"], "block_size", click.IntRange(min=1),
              "Samples per block and npy shard (zarr: rounded down to whole chunks). Default: about 64 MB of pixels."),
        count(["--chunk-size"], "chunk_size", click.IntRange(min=1),
              "zarr: samples per chunk. Default: about 4 MB of pixels."),
        choice("--compression", "compression", COMPRESSIONS, "zarr chunk compression."),
        click.Option(["--codec"], type=click.Choice(["none", *_codecs()]), default="none", show_default=True,
                     help="jpeg: store each resized sample as a JPEG (a compact cache, ~10x smaller at 224 px, "
                          "decoded when read); none: raw pixels."),
        count(["--quality"], "quality", click.IntRange(1, 100), "--codec jpeg: encoder quality."),
        choice("--subsampling", "subsampling", SUBSAMPLINGS,
               "--codec jpeg: chroma subsampling (444 keeps full colour resolution, ~1.3x the bytes)."),
        choice("--decode-device", "decode_device", DECODE_DEVICES,
               "cuda: decode source JPEGs in batches with nvJPEG and resize on the GPU, one worker per GPU (close "
               "to, not byte-equal with, a CPU build); files nvJPEG cannot take go to the CPU."),
        choice("--on-error", "on_error", ON_ERROR,
               "skip: list bad files in the manifest and go on; fail: stop at the first."),
        count(["--max-pixels"], "max_pixels", click.IntRange(min=1),
              "Refuse, before decoding, any image whose header declares more pixels."),
        click.Option(["--force", "force"], is_flag=True, default=default["force"],
                     help="Replace a different cache already at --out."),
        click.Option(["--update", "update"], is_flag=True, default=default["update"],
                     help="--out holds this recipe's cache of an earlier state of SRC: decode only the files added "
                          "or changed, copy every other sample's stored bytes, drop removed ones (as a fresh "
                          "build of SRC, replaced as --force replaces)."),
        click.Option(["--json", "summary"], metavar="FILE", default=default["summary"],
                     help="Write a JSON summary there: decoded, reused, skipped, seconds (per split and in all)."),
        click.Option(["--wait", "lock_wait"], **WAIT),
        click.Option(["--progress/--no-progress", "progress"], default=default["progress"],
                     help="Progress bar (default: on a terminal)."),
        click.Option(["--quiet", "-q"], is_flag=True, help="Only warnings and errors."),
        click.Option(["--verbose", "-v"], is_flag=True, help="Debug logging."),
    ]


def build_command(kind: SourceKind) -> click.Command:
    """``cachebuild <kind> SRC [its options] --size S [build options]``."""
    own = field_options(kind.options)
    size: list[click.Parameter] = [click.Option(["--size"], type=SIZE, default=kind.default_size, show_default=True,
                                                help=kind.size_help)]
    if kind.classes_flag:
        size.append(click.Option(["--classes", "classes_file"], default=None, metavar="FILE",
                                 help="Class names, one per line (line number = class index); a path or URL."))
    src = click.Argument(["src"], type=click.STRING if kind.url_src else click.Path(path_type=Path), metavar="SRC")
    names = [p.name for p in own]

    def run(src: str | Path, size: int, classes_file: str | None = None, **kw: Any) -> None:
        try:
            kind.check()
        except SourceError as e:
            raise click.UsageError(str(e)) from None
        options = {name: kw.pop(name) for name in names}

        def plans() -> list[Plan]:
            from cachebuild.sources.registry import plan_source

            classes = None
            if classes_file is not None:  # (the shard sources' module: ~20 ms a folder build does not need)
                from cachebuild.sources.shards.plan import read_classes

                classes = read_classes(classes_file)
            return plan_source(kind.name, src, kind.options(**options), classes=classes, jobs=kw["jobs"])

        _run_builds(plans, size, **kw)

    params = [src, *own[:kind.size_at], *size, *own[kind.size_at:], *build_params()]
    return click.Command(kind.name, params=params, callback=run, help=kind.help)


def _build_plans(plans: list[Plan], root: Path, opts: Any) -> list[Any]:
    from cachebuild.builder.pipeline import build

    results = []
    for plan in plans:
        dest = root / plan.split
        log.info("%s/%s: %d files from %s -> %s", plan.dataset, plan.split, len(plan), plan.root, dest)
        result = build(plan, dest, opts)
        results.append(result)
        if result.status == "up to date":
            click.echo(f"{dest}: up to date ({result.count} samples)")
            continue
        mb = result.bytes_written / 1e6
        click.echo(
            f"{dest}: {result.count} samples, {result.failures} skipped, {result.seconds:.1f} s, "
            f"{result.images_per_second:.0f} img/s, {mb / result.seconds:.0f} MB/s written"
        )
        if result.reused:
            click.echo(f"  updated: {result.decoded} decoded, {result.reused} reused from the cache it replaced")
        if result.failures:
            click.echo(f"  skipped files are listed in {dest / 'manifest.json'} (cachebuild info {dest})")
    return results


def _write_summary(path: str, results: list[Any], plan_seconds: float, seconds: float) -> None:
    """``--json FILE``: the builds' counts (integers) and seconds, in all and per split."""
    from cachebuild.atomic import write_json_atomic

    total = {k: sum(r.summary()[k] for r in results) for k in ("count", "decoded", "reused", "skipped",
                                                                  "bytes_written")}
    write_json_atomic(Path(path), {**total, "plan_seconds": round(plan_seconds, 3), "seconds": round(seconds, 3),
                                   "splits": [r.summary() for r in results]})


@contextlib.contextmanager
def _parallel_backend(scheduler: str | None) -> Iterator[None]:
    """joblib's default (loky processes), or its dask backend on the cluster at ``scheduler``."""
    if scheduler is None:
        yield
        return
    try:
        from dask.distributed import Client
    except ImportError:
        raise click.UsageError("--dask-scheduler needs Dask: pip install 'cachebuild[dask]'") from None
    from joblib import parallel_config

    try:
        client = Client(scheduler)  # waits up to Dask's distributed.comm.timeouts.connect (30 s)
    except (OSError, TimeoutError) as e:
        raise click.ClickException(f"cannot reach the Dask scheduler at {scheduler}: {e}") from None
    with client, parallel_config(backend="dask"):
        log.info("building on the Dask cluster at %s (%d workers)", scheduler,
                 len(client.scheduler_info()["workers"]))
        yield


def _build_options(size: int, kw: dict[str, Any]) -> Any:
    """``BuildOptions`` of the shared flags; ``--codec NAME`` is the storage kind that stores NAME."""
    from cachebuild.builder.pipeline import BuildOptions

    if kw["jobs"] == 0:
        raise click.BadParameter("must be a positive count or -1 (all cores), not 0", param_hint="--jobs")
    storage = kw["storage"]
    if kw["codec"] != "none":
        encoded = codecs()[kw["codec"]]  # the storage kind the registry maps this codec to
        if storage not in (DEFAULT_STORAGE, encoded):
            raise click.BadParameter(f"--codec {kw['codec']} stores its own shards; drop --format {storage}",
                                     param_hint="--codec")
        storage = encoded
    fields = {f.name for f in dataclasses.fields(BuildOptions)}
    try:
        return BuildOptions(size=size, **{**{k: v for k, v in kw.items() if k in fields}, "storage": storage})
    except OptionError as e:  # the storage kind's own checks included (e.g. jpeg takes no --compression)
        raise click.UsageError(str(e)) from None
    except MissingExtraError as e:  # a storage kind whose optional package is not installed (zarr)
        raise click.ClickException(str(e)) from None


def _run_builds(plans_fn: Callable[[], list[Plan]], size: int, *, out: Path | None, quiet: bool, verbose: bool,
                **kw: Any) -> None:
    setup_logging(quiet, verbose)
    opts = _build_options(size, kw)
    try:
        if opts.decode_device != "cpu":  # before listing a large source: no GPU, no build
            from cachebuild.builder.gpu_build import check_decode_device

            check_decode_device(opts.decode_device)
        t0 = time.perf_counter()
        plans = plans_fn()
        planned = time.perf_counter()
        root = out if out is not None else default_out(plans[0].dataset, size, opts.fit, opts.storage)
        with _parallel_backend(kw["dask_scheduler"]):
            results = _build_plans(plans, root, opts)
        if opts.summary is not None:
            _write_summary(opts.summary, results, planned - t0, time.perf_counter() - t0)
    except DecodeError as e:
        raise click.ClickException(
            f"{e.path}: {e.reason}\n(--on-error fail stopped the build; finished blocks are kept and the same "
            f"command resumes; --on-error skip lists such files instead)"
        ) from None
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; finished blocks are kept: rerun the same command to resume") from None
