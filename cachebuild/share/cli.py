"""The sharing commands of the ``cachebuild`` CLI: ``pull``, ``push``, ``status``, ``ls`` (and ``columns``).
Parse, call the library, print; loaded by ``cachebuild.cli`` when one of them is run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import click

from cachebuild.errors import CacheBuildError, TransferError
from cachebuild.options import REQUIRED, Options, command, option, quiet_option, setup_logging, wait_option

__all__ = ["commands", "quick_verify"]


@dataclass(frozen=True)
class TransferOptions(Options):
    """``pull`` and ``push``: the same flags, SRC and DEST named by each command."""

    src: str = option(REQUIRED, None, argument=True, metavar="SRC")
    dest: str = option(REQUIRED, None, argument=True, metavar="DEST")
    force: bool = option(False, "Replace a different cache at DEST (see the command's help for what jobs "
                                "reading it see).")
    jobs: int = option(8, "Files moved at once.", short="-j", min=1)
    wait: float | None = wait_option()
    progress: bool | None = option(None, "Progress bar: bytes, files, rate (default: on a terminal).")
    quiet: bool = quiet_option()


def _transfer(run: Any, o: TransferOptions) -> None:
    """pull or push: one line per cache moved; a transfer error lists its files, any other is one line."""
    setup_logging(o.quiet)
    try:
        results = run(o.src, o.dest, force=o.force, jobs=o.jobs, progress=o.progress, wait=o.wait)
    except TransferError as e:  # several lines: the files and what to do
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(1) from None
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    for r in results:
        click.echo(r.describe())


def pull(o: TransferOptions) -> None:
    """Copy the cache at SRC, a URL or a path (or a folder of caches: train/, val/...), to the local folder DEST.

    Every file is checked against the cache's file table (size and checksum) as it arrives; the manifest is
    written last and the folder renamed into place, so an interrupted pull never looks complete. Rerun the
    same command to resume: files already arrived and checked are not fetched again. With --force, jobs
    reading the cache DEST held keep the old one.
    """
    from cachebuild.share.pull import pull as run

    _transfer(run, o)


def push(o: TransferOptions) -> None:
    """Copy the local cache at SRC (or a folder of caches) to DEST, a URL: data files first, each checked against
    the file table before it leaves, the manifest last. Rerun to resume.

    With --force, the different cache at DEST goes first: its manifest, so new readers see no cache until the
    push completes; jobs already reading it from the URL stop with an error naming the changed file (never the
    new bytes): push to a new prefix to replace a cache in use.
    """
    from cachebuild.share.push import push as run

    _transfer(run, o)


@dataclass(frozen=True)
class StatusOptions(Options):
    cache: str = option(REQUIRED, None, argument=True, metavar="CACHE")
    src: str | None = option(None, "The source the cache was built from (default: the root its manifest records).",
                             flag="--source", metavar="SRC")
    as_json: bool = option(False, "Print the result as JSON.", flag="--json")


def status(o: StatusOptions) -> None:
    """Is CACHE up to date with its source? Exit 0: up to date; 1: stale (files added, removed, modified:
    same inputs as the build's fingerprint, nothing decoded); 2: not a cache, or the source cannot be read."""
    from cachebuild.builder.status import cache_status

    try:
        result = cache_status(o.cache, o.src)
    except CacheBuildError as e:
        if o.as_json:
            click.echo(json.dumps({"cache": o.cache, "source": o.src, "status": "error", "message": str(e)},
                                  indent=1))
        else:
            click.echo(f"Error: {e}", err=True)
        raise SystemExit(2) from None
    if o.as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        click.echo(result.describe(), err=result.status == "not a cache")
    raise SystemExit(result.exit_code)


@dataclass(frozen=True)
class LsOptions(Options):
    where: str = option(REQUIRED, None, argument=True, metavar="FOLDER|URL")
    as_json: bool = option(False, "Print one JSON object per cache, in a list.", flag="--json")
    depth: int = option(4, "How many folder levels to look down.", min=0, max=16)


def ls(o: LsOptions) -> None:
    """The caches under FOLDER or URL prefix: dataset/split, shape, fit, storage, count, size, built when,
    by which cachebuild version, fingerprint. Unfinished and replaced ones are marked."""
    from cachebuild.share.listing import format_table, list_caches

    try:
        rows = list_caches(o.where, o.depth)
    except (CacheBuildError, OSError) as e:
        raise click.ClickException(f"{o.where}: {e}") from None
    if o.as_json:
        click.echo(json.dumps(rows, indent=1))
    elif rows:
        click.echo(format_table(rows))
    else:
        click.echo(f"{o.where}: no caches found (looked {o.depth} level(s) down)", err=True)


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

    made = [command("pull", TransferOptions, pull), command("push", TransferOptions, push),
            command("status", StatusOptions, status), command("ls", LsOptions, ls), columns]
    return {c.name or "": c for c in made}
