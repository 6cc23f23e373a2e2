"""The sharing commands of the ``cachebuild`` CLI: ``pull``, ``push``, ``status``, ``ls``. Parse, call the
library, print; loaded by ``cachebuild.cli`` when one of them is run."""

from __future__ import annotations

import json
from typing import Any

import click

from cachebuild.cli_common import WAIT, setup_logging
from cachebuild.errors import CacheBuildError, TransferError

__all__ = ["WAIT_OPTION", "commands", "quick_verify"]

WAIT_OPTION = click.option("--wait", **WAIT)

_JOBS = click.option("--jobs", "-j", type=click.IntRange(min=1), default=8, show_default=True,
                     help="Files moved at once.")
_PROGRESS = click.option("--progress/--no-progress", default=None,
                         help="Progress bar: bytes, files, rate (default: on a terminal).")
_QUIET = click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors.")


def _fail(e: CacheBuildError) -> None:
    if isinstance(e, TransferError):  # several lines: the files and what to do
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(1)
    raise click.ClickException(str(e)) from None


def _transfer(run: Any, src: str, dest: str, *, quiet: bool, **options: Any) -> None:
    """pull or push: run it, one line per cache moved, a one-line error otherwise."""
    setup_logging(quiet, False)
    try:
        results = run(src, dest, **options)
    except CacheBuildError as e:
        _fail(e)
        return
    for r in results:
        click.echo(r.describe())


@click.command()
@click.argument("src", metavar="URL|PATH")
@click.argument("dest", metavar="DEST")
@click.option("--force", is_flag=True, help="Replace a different cache at DEST (jobs reading it keep the old one).")
@_JOBS
@WAIT_OPTION
@_PROGRESS
@_QUIET
def pull(src: str, dest: str, force: bool, jobs: int, wait: float | None, progress: bool | None,
         quiet: bool) -> None:
    """Copy the cache at URL (or a folder of caches: train/, val/...) to the local folder DEST.

    Every file is checked against the cache's file table (size and checksum) as it arrives; the manifest is
    written last and the folder renamed into place, so an interrupted pull never looks complete. Rerun the
    same command to resume: files already arrived and checked are not fetched again.
    """
    from cachebuild.share.pull import pull as run

    _transfer(run, src, dest, force=force, jobs=jobs, progress=progress, wait=wait, quiet=quiet)


@click.command()
@click.argument("src", metavar="PATH")
@click.argument("dest", metavar="URL")
@click.option("--force", is_flag=True,
              help="Replace a different cache at URL. Its manifest goes first, so new readers see no cache until "
                   "the push completes; jobs already reading it from the URL stop with an error naming the "
                   "changed file (never the new bytes): push to a new prefix to replace a cache in use.")
@_JOBS
@WAIT_OPTION
@_PROGRESS
@_QUIET
def push(src: str, dest: str, force: bool, jobs: int, wait: float | None, progress: bool | None,
         quiet: bool) -> None:
    """Copy the local cache at PATH (or a folder of caches) to URL: data files first, each checked against
    the file table before it leaves, the manifest last. Rerun to resume."""
    from cachebuild.share.push import push as run

    _transfer(run, src, dest, force=force, jobs=jobs, progress=progress, wait=wait, quiet=quiet)


@click.command()
@click.argument("cache", metavar="CACHE")
@click.option("--source", "src", default=None, metavar="SRC",
              help="The source the cache was built from (default: the root its manifest records).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def status(cache: str, src: str | None, as_json: bool) -> None:
    """Is CACHE up to date with its source? Exit 0: up to date; 1: stale (files added, removed, modified:
    same inputs as the build's fingerprint, nothing decoded); 2: not a cache, or the source cannot be read."""
    from cachebuild.builder.status import cache_status

    try:
        result = cache_status(cache, src)
    except CacheBuildError as e:
        if as_json:
            click.echo(json.dumps({"cache": cache, "source": src, "status": "error", "message": str(e)}, indent=1))
        else:
            click.echo(f"Error: {e}", err=True)
        raise SystemExit(2) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        click.echo(result.describe(), err=result.status == "not a cache")
    raise SystemExit(result.exit_code)


@click.command(name="ls")
@click.argument("where", metavar="FOLDER|URL")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per cache, in a list.")
@click.option("--depth", type=click.IntRange(min=0, max=16), default=4, show_default=True,
              help="How many folder levels to look down.")
def ls(where: str, as_json: bool, depth: int) -> None:
    """The caches under FOLDER or URL prefix: dataset/split, shape, fit, storage, count, size, built when,
    by which cachebuild version, fingerprint. Unfinished and replaced ones are marked."""
    from cachebuild.share.listing import format_table, list_caches

    try:
        rows = list_caches(where, depth)
    except (CacheBuildError, OSError) as e:
        raise click.ClickException(f"{where}: {e}") from None
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    elif rows:
        click.echo(format_table(rows))
    else:
        click.echo(f"{where}: no caches found (looked {depth} level(s) down)", err=True)


def quick_verify(where: str) -> None:
    """``cachebuild verify --quick``."""
    from cachebuild.storage.cache import quick_check

    try:
        report = quick_check(where)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    shown = report.location.describe()
    if report.problems:
        for p in report.problems:
            click.echo(f"{shown}: {p}", err=True)
        raise SystemExit(1)
    sizes = f", {report.sizes_checked} file sizes" if report.sizes_checked else " (no file table: sizes of shards only)"
    click.echo(f"{shown}: ok (quick: manifest, {report.headers_checked} headers{sizes}; pixels not re-hashed)")


def commands() -> dict[str, click.Command]:
    """The sharing commands by name, for the ``cachebuild`` group (``cachebuild.cli.SHARE_COMMANDS``)."""
    from cachebuild.share.columns import columns

    return {c.name or "": c for c in (pull, push, status, ls, columns)}
