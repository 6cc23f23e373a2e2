"""``cachebuild columns add|ls|rm``: extra per-sample arrays on a finished cache, no pixel rewritten.

Parse, take the cache's writer lock (the one builds and pulls of that folder take, so a column is never added
to a cache being replaced), call ``cachebuild.storage.cache.columns``, print. ``ls`` reads URLs too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click

from cachebuild.builder.locks import exclusive_lock
from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import entry_key
from cachebuild.options import REQUIRED, Options, command, option, wait_option

__all__ = ["columns"]


@click.group()
def columns() -> None:
    """Extra per-sample arrays (relabelled classes, soft labels, scores...) added to a cache without
    rewriting its pixels; read with CachedImageDataset(..., DatasetOptions(columns=[NAME]))."""


def _cache_folder(cache: str) -> Path:
    """The local cache folder ``cache`` names, checked to be a cache before its writer lock is taken: the lock
    file goes beside the folder, and a wrong path must leave nothing behind (no lock, no folders)."""
    from cachebuild.storage.cache import read_manifest
    from cachebuild.storage.columns import local_folder

    folder = local_folder(cache)
    read_manifest(folder)  # a missing path, or one that is not a cache: one line, nothing made
    return folder


@dataclass(frozen=True)
class AddOptions(Options):
    cache: str = option(REQUIRED, None, argument=True, metavar="CACHE")
    name: str = option(REQUIRED, None, argument=True, metavar="NAME")
    file: str = option(REQUIRED, None, argument=True, metavar="FILE", path="file")
    replace: bool = option(False, "Replace an existing column of that name.")
    wait: float | None = wait_option()


def add(o: AddOptions) -> None:
    """Add column NAME to the local CACHE from FILE: an .npy of one row per sample (cache order), a .csv of
    path,value[,value...] rows or a .json object {path: value}, keyed by the samples' source paths.

    The column file is written first, then the manifest swapped atomically: a crash leaves the cache as it
    was, and jobs reading it keep what they opened.
    """
    from cachebuild.storage.columns import add_column

    try:
        folder = _cache_folder(o.cache)
        with exclusive_lock(folder, wait=o.wait, action="changing the columns of"):
            m = add_column(folder, o.name, o.file, replace=o.replace)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    c = m.columns[o.name]
    click.echo(f"{folder}: column {o.name} {c.dtype}{list(c.shape)} added ({c.file}, format version "
               f"{m.format_version})")


@dataclass(frozen=True)
class RemoveOptions(Options):
    cache: str = option(REQUIRED, None, argument=True, metavar="CACHE")
    name: str = option(REQUIRED, None, argument=True, metavar="NAME")
    wait: float | None = wait_option()


def rm(o: RemoveOptions) -> None:
    """Remove column NAME from the local CACHE (its file is deleted once no job reads it)."""
    from cachebuild.storage.columns import remove_column

    try:
        folder = _cache_folder(o.cache)
        with exclusive_lock(folder, wait=o.wait, action="changing the columns of"):
            m = remove_column(folder, o.name)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{folder}: column {o.name} removed ({len(m.columns)} left, format version {m.format_version})")


@dataclass(frozen=True)
class ListOptions(Options):
    cache: str = option(REQUIRED, None, argument=True, metavar="CACHE|URL")
    as_json: bool = option(False, "Print the columns as a JSON object.", flag="--json")


def ls(o: ListOptions) -> None:
    """The columns of CACHE (a folder or a URL): name, dtype, shape, file."""
    from cachebuild.storage.cache import read_manifest

    try:
        m = read_manifest(o.cache)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    if o.as_json:
        rows = {n: {"dtype": c.dtype, "shape": list(c.shape), "file": c.file, "bytes": c.size,
                    entry_key(m.format_version): c.digest}  # as the manifest keys it
                for n, c in sorted(m.columns.items())}
        click.echo(json.dumps(rows, indent=1))
        return
    if not m.columns:
        click.echo(f"{o.cache}: no columns (add one with `cachebuild columns add {o.cache} NAME FILE`)", err=True)
    for n, c in sorted(m.columns.items()):
        click.echo(f"{n}  {c.dtype}{list(c.shape)}  {Path(c.file).name}")


columns.add_command(command("add", AddOptions, add))
columns.add_command(command("rm", RemoveOptions, rm))
columns.add_command(command("ls", ListOptions, ls))
