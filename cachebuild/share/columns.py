"""``cachebuild columns add|ls|rm``: extra per-sample arrays on a finished cache, no pixel rewritten.

Parse, take the cache's writer lock (the one builds and pulls of that folder take, so a column is never added
to a cache being replaced), call ``cachebuild.storage.columns``, print. ``ls`` reads URLs too.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from cachebuild.builder.locks import exclusive_lock
from cachebuild.cli_common import WAIT
from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import entry_key

__all__ = ["columns"]


@click.group()
def columns() -> None:
    """Extra per-sample arrays (relabelled classes, soft labels, scores...) added to a cache without
    rewriting its pixels; read with CachedImageDataset(..., DatasetOptions(columns=[NAME]))."""


@columns.command(name="add")
@click.argument("cache", metavar="CACHE")
@click.argument("name", metavar="NAME")
@click.argument("file", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--replace", is_flag=True, help="Replace an existing column of that name.")
@click.option("--wait", **WAIT)
def add(cache: str, name: str, file: str, replace: bool, wait: float | None) -> None:
    """Add column NAME to the local CACHE from FILE: an .npy of one row per sample (cache order), a .csv of
    path,value[,value...] rows or a .json object {path: value}, keyed by the samples' source paths.

    The column file is written first, then the manifest swapped atomically: a crash leaves the cache as it
    was, and jobs reading it keep what they opened.
    """
    from cachebuild.storage.columns import add_column, local_folder

    try:
        folder = local_folder(cache)
        with exclusive_lock(folder, wait=wait, action="changing the columns of"):
            m = add_column(folder, name, file, replace=replace)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    c = m.columns[name]
    click.echo(f"{folder}: column {name} {c.dtype}{list(c.shape)} added ({c.file}, format version "
               f"{m.format_version})")


@columns.command(name="rm")
@click.argument("cache", metavar="CACHE")
@click.argument("name", metavar="NAME")
@click.option("--wait", **WAIT)
def rm(cache: str, name: str, wait: float | None) -> None:
    """Remove column NAME from the local CACHE (its file is deleted once no job reads it)."""
    from cachebuild.storage.columns import local_folder, remove_column

    try:
        folder = local_folder(cache)
        with exclusive_lock(folder, wait=wait, action="changing the columns of"):
            m = remove_column(folder, name)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{folder}: column {name} removed ({len(m.columns)} left, format version {m.format_version})")


@columns.command(name="ls")
@click.argument("cache", metavar="CACHE|URL")
@click.option("--json", "as_json", is_flag=True, help="Print the columns as a JSON object.")
def ls(cache: str, as_json: bool) -> None:
    """The columns of CACHE (a folder or a URL): name, dtype, shape, file."""
    from cachebuild.storage.cache import read_manifest

    try:
        m = read_manifest(cache)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        rows = {n: {"dtype": c.dtype, "shape": list(c.shape), "file": c.file, "bytes": c.size,
                    entry_key(m.format_version): c.digest}  # as the manifest keys it
                for n, c in sorted(m.columns.items())}
        click.echo(json.dumps(rows, indent=1))
    elif not m.columns:
        click.echo(f"{cache}: no columns (add one with `cachebuild columns add {cache} NAME FILE`)", err=True)
    for n, c in sorted(m.columns.items()) if not as_json else ():
        click.echo(f"{n}  {c.dtype}{list(c.shape)}  {Path(c.file).name}")
