"""The ``cachebuild`` command line: parse, validate, call the library. No logic lives here.

The build commands (one per source kind) are generated from the sources registry (``cachebuild.cli_build``);
the sharing commands live in ``cachebuild.share.cli``; more come from other packages' entry points.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cachebuild.cli_build import build_command
from cachebuild.errors import CacheBuildError
from cachebuild.options import REQUIRED, Options, command, option
from cachebuild.sources.registry import get_source, source_names

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["COMMAND_GROUP", "main"]


COMMAND_GROUP = "cachebuild.commands"  # entry points: more `cachebuild` commands from other packages
# the sharing commands (cachebuild.share.cli), imported when one is run: a build's start-up does not pay for the
# transfer code
SHARE_COMMANDS = ("columns", "gc", "ls", "pull", "push", "resolve", "serve", "status")


def _command_entry_points() -> dict[str, EntryPoint]:
    from importlib.metadata import entry_points  # not on a build command's way to its workers

    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def _unloadable(name: str, ep: EntryPoint, error: Exception) -> click.Command:
    """Stands in for a registered command whose code cannot be imported: says so when run, instead of
    the command silently missing from the tool."""
    why = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   add_help_option=False, help=f"(unavailable: {why})")
    def command() -> None:
        raise click.ClickException(f"`cachebuild {name}` is registered ({ep.value}) but cannot be loaded: {why}; "
                                   f"reinstall the package that provides it")

    return command


class _Commands(click.Group):
    """The built-in commands, one build command per registered source kind (made when asked for, so
    that ``cachebuild info`` imports no source), plus those registered under the ``cachebuild.commands``
    entry point group (the training loop's ``train``): ``cachebuild`` never imports the packages that
    provide them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(SHARE_COMMANDS) | set(source_names())
                      | set(_command_entry_points()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        if cmd_name in SHARE_COMMANDS:
            from cachebuild.share.cli import commands

            return commands()[cmd_name]
        if cmd_name in source_names():  # made afresh: a kind registered later is seen as it is now
            return build_command(get_source(cmd_name))
        ep = _command_entry_points().get(cmd_name)
        if ep is None:
            return None
        try:
            loaded = ep.load()
        except Exception as e:  # an import error of the providing package: report it where it is used
            return _unloadable(cmd_name, ep, e)
        if not isinstance(loaded, click.Command):
            return _unloadable(cmd_name, ep, TypeError(f"{ep.value} is a {type(loaded).__name__}, not a command"))
        return loaded


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cachebuild")
def main() -> None:
    """Decode an image dataset once into a fixed-shape uint8 cache that training jobs memory-map."""


def _open(where: str):
    from cachebuild.storage.cache import open_cache

    try:
        return open_cache(where)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None


@dataclass(frozen=True)
class InfoOptions(Options):
    where: str = option(REQUIRED, None, argument=True, metavar="PATH|URL")
    as_json: bool = option(False, "Print the whole manifest as JSON.", flag="--json")


def info(o: InfoOptions) -> None:
    """Describe the cache at PATH or URL (s3://, gs://, https://...)."""
    cache = _open(o.where)
    m = cache.manifest
    if o.as_json:
        click.echo(json.dumps(m.to_dict(), indent=1))
        return
    from cachebuild.share.listing import cache_bytes

    disk = cache_bytes(cache.location, m)
    classes = ", ".join(m.classes[:5]) + (", ..." if len(m.classes) > 5 else "")
    lines = [
        f"{cache.location.describe()}",
        f"  {m.dataset}/{m.split}: {m.count} samples, {m.shape[0]}x{m.shape[1]}x{m.shape[2]} {m.dtype} {m.layout}",
        f"  storage: {m.storage}, {len(m.shards)} shard(s), "
        + (f"{disk / 1e6:.1f} MB" if disk is not None else "size not listed by the server"),
        f"  classes: {len(m.classes)} ({classes})",
        f"  fit: {m.fit}, interpolation: {m.interpolation}",
        f"  source: {m.source.get('root')} ({m.source.get('files')} files, "
        f"source digest {str(m.source.get('fingerprint'))[:12]})",
        f"  built: {m.created} by cachebuild {m.tool.get('version')} (format {m.format} v{m.format_version}, "
        f"{m.digest.name} checksums)"
        + (f", {m.built_by.get('user')}@{m.built_by.get('host')}" if m.built_by else ""),
        f"  fingerprint: {m.build_key[:12]} (build key: source + parameters; CachedImageDataset(expect_fingerprint=))",
        f"  skipped: {len(m.failures)}",
    ]
    if m.columns:  # arrays added after the build (`cachebuild columns`)
        shown = ", ".join(f"{n} {c.dtype}{list(c.shape)}" for n, c in sorted(m.columns.items()))
        lines.insert(-1, f"  columns: {shown}")
    lines += [f"    {f.path}: {f.reason}" for f in m.failures[:20]]
    if len(m.failures) > 20:
        lines.append(f"    ... {len(m.failures) - 20} more (--json lists all)")
    click.echo("\n".join(lines))


@dataclass(frozen=True)
class VerifyOptions(Options):
    where: str = option(REQUIRED, None, argument=True, metavar="PATH|URL")
    quick: bool = option(False, "Only sizes, headers and manifest consistency (seconds; no pixel is re-hashed).")


def verify(o: VerifyOptions) -> None:
    """Re-hash every shard and array of the cache at PATH or URL against its manifest."""
    if o.quick:
        from cachebuild.share.cli import quick_verify

        quick_verify(o.where)
        return
    cache = _open(o.where)
    shown = cache.location.describe()
    try:
        problems = cache.verify()
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    if problems:
        for p in problems:
            click.echo(f"{shown}: {p}", err=True)
        raise SystemExit(1)
    click.echo(f"{shown}: ok ({cache.manifest.count} samples in {len(cache.manifest.shards)} shard(s) verified)")


@dataclass(frozen=True)
class SampleOptions(Options):
    dest: Path = option(REQUIRED, None, argument=True, path="any")
    n_classes: int = option(10, None, flag="--classes", min=1, max=10)
    train_per_class: int = option(40, None, min=1)
    val_per_class: int = option(10, None, min=1)
    seed: int = option(0, None)


def sample(o: SampleOptions) -> None:
    """Write the built-in sample: real photographs in the ImageNet layout (with its quirks and a few
    broken files), made from images that ship inside scikit-image and scikit-learn."""
    from cachebuild.samples.imagenet_layout import write_imagenet

    if o.dest.exists() and any(o.dest.iterdir()):
        click.echo(f"{o.dest}: exists, left as it is")
        return
    try:
        written = write_imagenet(o.dest, n_classes=o.n_classes, train_per_class=o.train_per_class,
                                 val_per_class=o.val_per_class, seed=o.seed, quirks=True, broken=True)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{o.dest}: {len(written['train'])} train and {len(written['val'])} val images, "
               f"{o.n_classes} classes")


main.add_command(command("info", InfoOptions, info))
main.add_command(command("verify", VerifyOptions, verify))
main.add_command(command("sample", SampleOptions, sample))
