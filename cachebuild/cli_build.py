"""The build commands of ``cachebuild``, one per source kind, generated from the sources registry.

A command's flags are its kind's options, ``--size`` (and ``--classes``), every field of
:class:`~cachebuild.builder.options.BuildOptions`, then :class:`BuildCommand`'s: each a dataclass field
declared once with :func:`cachebuild.options.option` and made into a flag by
:func:`cachebuild.options.field_options`. The command calls :func:`cachebuild.builder.pipeline.build_source`,
the library's ``cachebuild.build``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cachebuild.errors import CacheBuildError, DecodeError, OptionError, SourceError
from cachebuild.options import field_options, option, quiet_option, setup_logging
from cachebuild.sources.kind import SourceKind

__all__ = ["SIZE", "BuildCommand", "build_command", "build_params", "read_classes_file"]

log = logging.getLogger("cachebuild")

SIZE = click.IntRange(min=8, max=8192)


def _gone(flag: str, instead: str) -> Any:
    def check(value: object) -> None:
        raise ValueError(f"{flag} is no longer a flag of the build commands: {instead}")

    return check


@dataclass(frozen=True)
class BuildCommand:
    """What the build commands take beyond a build's own options: where, on what, and how much to say."""

    out: Path | None = option(None, "Output folder; one sub-folder per split. Default: $CACHEBUILD_HOME/<dataset>-"
                              "<size>.", path="any")
    dask_scheduler: str | None = option(None, "Run the blocks on a Dask cluster (joblib's dask backend), e.g. "
                                        "tcp://host:8786; its workers must see SRC and --out at the same paths. "
                                        "Needs cachebuild[dask].", metavar="ADDRESS")
    store: str | None = option(None, "A team store (a folder, s3://..., or http(s):// of `cachebuild serve`; default "
                               "$CACHEBUILD_STORE): its cache of this recipe is used (nothing decoded; --out pulls "
                               "it), one being built elsewhere is waited for, else it is built and published there.",
                               metavar="URL")
    no_wait: bool = option(False, "With --store: exit naming the build of this recipe running elsewhere instead of "
                                  "waiting for it.")
    quiet: bool = quiet_option()
    verbose: bool = option(False, "Debug logging.", short="-v")
    # spellings of earlier releases: an error that names what to write instead
    codec: str | None = option(None, None, hidden=True, check=_gone("--codec", "a compact cache is --format jpeg"))
    workers: str | None = option(None, None, hidden=True,
                                 check=_gone("--workers", "the build runs its --jobs blocks in threads (or, for "
                                                          "zarr and GPU builds, processes) by itself"))


def build_command(kind: SourceKind) -> click.Command:
    """``cachebuild <kind> SRC [its options] --size S [build options]``."""
    own = field_options(kind.options)
    size: list[click.Parameter] = [click.Option(["--size"], type=SIZE, default=kind.default_size, show_default=True,
                                                help=kind.size_help)]
    if kind.classes_flag:
        size.append(click.Option(["--classes", "classes_file"], default=None, metavar="FILE",
                                 help="Class names, one per line (line number = class index); a path or URL."))
    src = click.Argument(["src"], type=click.STRING if kind.url_src else click.Path(path_type=Path), metavar="SRC")

    def run(src: str | Path, size: int, out: Path | None, dask_scheduler: str | None, store: str | None,
            no_wait: bool, quiet: bool, verbose: bool, classes_file: str | None = None, codec: None = None,
            workers: None = None, **kw: Any) -> None:
        setup_logging(quiet, verbose)
        try:
            kind.check()
        except SourceError as e:
            raise click.UsageError(str(e)) from None
        try:
            if kw.get("decode_device", "cpu") != "cpu":  # before listing a large source: no GPU, no build
                from cachebuild.builder.gpu_build import check_decode_device

                check_decode_device(kw["decode_device"])
            classes = read_classes_file(classes_file)
            from cachebuild.settings import settings

            store = store or settings().store
            with _parallel_backend(dask_scheduler):
                if store:
                    from cachebuild.share.store_build import build_with_store

                    build_with_store(kind.name, src, out, store=store, wait=not no_wait, size=size, classes=classes,
                                     report=lambda r: click.echo(r.describe()), **kw)
                else:
                    from cachebuild.builder.pipeline import build_source

                    build_source(kind.name, src, out, size=size, classes=classes, report=_echo, **kw)
        except DecodeError as e:
            raise click.ClickException(
                f"{e.path}: {e.reason}\n(--on-error fail stopped the build; finished blocks are kept and the same "
                f"command resumes; --on-error skip lists such files instead)") from None
        except OptionError as e:  # options that cannot work together (e.g. jpeg takes no --compression)
            raise click.UsageError(str(e)) from None
        except CacheBuildError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            raise click.ClickException("interrupted; finished blocks are kept: rerun the same command to "
                                       "resume") from None

    params = [src, *own[: kind.size_at], *size, *own[kind.size_at :], *build_params()]
    return click.Command(kind.name, params=params, callback=run, help=kind.help)


def read_classes_file(classes_file: str | None) -> list[str] | None:
    """``--classes FILE``: the class names it lists (a path or URL), or None."""
    if classes_file is None:
        return None
    from cachebuild.sources.shards.plan import read_classes

    return read_classes(classes_file)


def build_params() -> list[click.Parameter]:
    """The flags every build command shares: the fields of ``BuildOptions`` (but ``--size``, the kind's) and of
    :class:`BuildCommand`."""
    from cachebuild.builder.options import BuildOptions

    return [*(p for p in field_options(BuildOptions) if p.name != "size"), *field_options(BuildCommand)]


def _echo(result: Any) -> None:
    dest = result.path
    if result.status == "up to date":
        click.echo(f"{dest}: up to date ({result.count} samples)")
        return
    mb = result.bytes_written / 1e6
    click.echo(f"{dest}: {result.count} samples, {result.failures} skipped, {result.seconds:.1f} s, "
               f"{result.images_per_second:.0f} img/s, {mb / result.seconds:.0f} MB/s written")
    if result.reused:
        click.echo(f"  updated: {result.decoded} decoded, {result.reused} reused from the cache it replaced")
    if result.failures:
        click.echo(f"  skipped files are listed in {dest / 'manifest.json'} (cachebuild info {dest})")


@contextlib.contextmanager
def _parallel_backend(scheduler: str | None) -> Iterator[None]:
    """The build's own choice of joblib backend, or joblib's dask backend on the cluster at ``scheduler``."""
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
        log.info("building on the Dask cluster at %s (%d workers)", scheduler, len(client.scheduler_info()["workers"]))
        yield
