"""The sharing commands of the ``cachebuild`` CLI: ``pull``, ``push``, ``status``, ``ls`` (and ``columns``).
Parse, call the library, print; loaded by ``cachebuild.cli`` when one of them is run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
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
    by which cachebuild version, fingerprint; in a team store also each cache's last use and live readers.
    Unfinished and replaced ones are marked."""
    from cachebuild.share.listing import format_table, list_caches
    from cachebuild.share.store import add_usage

    try:
        rows = add_usage(o.where, list_caches(o.where, o.depth))
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


# ---------------------------------------------------------------- the team store: resolve, serve, gc

# Build flags that do not change which cache a recipe makes (resolve leaves them out).
_NOT_RECIPE = ("size", "force", "update", "summary", "lock_wait", "progress", "on_error")


def _kind_flags() -> dict[str, click.Parameter]:
    """Every source kind's own flags, by name, as one set of options that default to None (only those given are
    passed; each kind's options check their values). A flag whose type differs between kinds is taken as text."""
    from cachebuild.options import field_options
    from cachebuild.sources.registry import get_source, source_names

    made: dict[str, click.Parameter] = {}
    for name in source_names():
        for p in field_options(get_source(name).options):
            assert p.name is not None
            seen = made.get(p.name)
            if seen is None:
                made[p.name] = click.Option([*p.opts, p.name], type=p.type, default=None,
                                            metavar=getattr(p, "metavar", None),
                                            help=f"As `cachebuild {name} {p.opts[0]}` (and the other kinds that have "
                                                 f"it).")
            elif type(seen.type) is not type(p.type):
                made[p.name] = click.Option([*p.opts, p.name], type=click.STRING, default=None, help=seen.help)
    return made


def _resolve_command() -> click.Command:
    """``cachebuild resolve STORE --kind KIND --source SRC [the build command's recipe flags]``."""
    from cachebuild.builder.options import BuildOptions
    from cachebuild.options import field_options
    from cachebuild.sources.registry import source_names

    kind_flags = _kind_flags()
    recipe = [p for p in field_options(BuildOptions) if p.name not in _NOT_RECIPE]
    params: list[click.Parameter] = [
        click.Argument(["store"], metavar="STORE"),
        click.Option(["--kind"], type=click.Choice(source_names()), required=True,
                     help="The source's kind: the build command that would make the cache."),
        click.Option(["--source", "src"], required=True, metavar="SRC", help="The source, as given to the build."),
        click.Option(["--size"], type=click.IntRange(min=8, max=8192), default=None,
                     help="Output side S (default: the kind's)."),
        click.Option(["--classes", "classes_file"], default=None, metavar="FILE",
                     help="Class names, one per line (the kinds with --classes)."),
        *recipe, *kind_flags.values(),
        click.Option(["--json", "as_json"], is_flag=True, help="Print one JSON object per split, in a list."),
    ]

    def run(store: str, kind: str, src: str, size: int | None, classes_file: str | None, as_json: bool,
            **given: Any) -> None:
        from cachebuild.share.store import resolve_all
        from cachebuild.sources.registry import get_source
        from cachebuild.sources.shards.plan import read_classes

        own = {p.name for p in field_options(get_source(kind).options)}
        options = {k: v for k, v in given.items() if k not in kind_flags or v is not None}
        foreign = sorted(k for k in options if k in kind_flags and k not in own)
        if foreign:
            raise click.UsageError(f"{kind_flags[foreign[0]].opts[0]} is not an option of `cachebuild {kind}`")
        try:
            classes = None if classes_file is None else read_classes(classes_file)
            got = resolve_all(store, kind, src, size=size, classes=classes, **options)
        except CacheBuildError as e:
            raise click.ClickException(str(e)) from None
        if as_json:
            click.echo(json.dumps([r.__dict__ for r in got], indent=1))
        for r in got:
            if r.found and not as_json:
                click.echo(r.url if len(got) == 1 else f"{r.split}\t{r.url}")
            elif not r.found:
                click.echo(f"{r.dataset}/{r.split}: not in {store} (build key {r.key[:12]}..., it would be {r.url}): "
                           f"build it with `cachebuild {kind} {src} --store {store}` and the same options", err=True)
        raise SystemExit(0 if all(r.found for r in got) else 1)

    return click.Command("resolve", params=params, callback=run, help=(
        "The URL (a path, in a folder store) of STORE's cache of the recipe `cachebuild KIND SRC [flags]` makes, "
        "one line per split; exit 1 when the store does not hold it. The source is planned (listed, every file "
        "stat'ed), nothing decoded. From Python: cachebuild.resolve(STORE, KIND, SRC, size=..., split=...)."))


@dataclass(frozen=True)
class ServeOptions(Options):
    root: Path = option(REQUIRED, None, argument=True, metavar="DIR", path="dir", exists=True)
    token_file: Path = option(REQUIRED, "The bearer token readers must send (one word; readers set "
                                        "CACHEBUILD_HTTP_TOKEN to it). Make one: openssl rand -hex 32 > FILE.",
                              path="file", exists=True, metavar="FILE")
    host: str = option("127.0.0.1", "The address to listen on (0.0.0.0: every interface; see the threat model in "
                                    "docs/sharing.md).")
    port: int = option(8470, "The port (0: a free one, printed).", min=0, max=65535)
    max_requests: int = option(64, "Answers sent at once; more wait (up to 16 times as many, then 503).", min=1)


def serve(o: ServeOptions) -> None:
    """Serve the folder of caches DIR (a team store) read-only over HTTP, to readers holding the token: ls, pull,
    verify, --store and CachedImageDataset("http://...") read it. Range requests, ETag, Last-Modified; nothing
    outside DIR (no "..", no symbolic link); the caches it serves are leased in DIR, so gc keeps them."""
    from cachebuild.share.serve import read_token
    from cachebuild.share.serve import serve as run

    setup_logging(False)
    try:
        run(o.root, read_token(o.token_file), host=o.host, port=o.port, max_requests=o.max_requests,
            announce=click.echo)
    except OSError as e:  # the port is taken, the address not ours...
        raise click.ClickException(f"cannot serve on {o.host}:{o.port}: {e}") from None
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None


def _parse_bytes(text: str) -> int:
    from cachebuild.share.gc import parse_bytes

    return parse_bytes(text)


def _parse_age(text: str) -> float:
    from cachebuild.share.gc import parse_age

    return parse_age(text)


@dataclass(frozen=True)
class GcOptions(Options):
    store: str = option(REQUIRED, None, argument=True, metavar="STORE")
    max_bytes: int | None = option(None, "Keep the store's caches within SIZE (500G, 2T, 800GiB): the least recently "
                                         "used go first.", parse=_parse_bytes, metavar="SIZE")
    older_than: float | None = option(None, "Remove the caches not used for AGE (30d, 12h, 90m).", parse=_parse_age,
                                      metavar="AGE")
    yes: bool = option(False, "Remove them; without it, a dry run that says what would go.")
    as_json: bool = option(False, "Print the report as JSON.", flag="--json")
    quiet: bool = quiet_option()


def gc(o: GcOptions) -> None:
    """Keep the team store STORE within --max-bytes and/or --older-than: whole caches, least recently used first,
    never one in use (a reader's lease, a job holding a folder cache open, a build or push of it). A dry run
    unless --yes. Exit 1 when the caches left are over --max-bytes (those in use)."""
    from cachebuild.share.gc import collect, describe

    setup_logging(o.quiet)
    try:
        report = collect(o.store, max_bytes=o.max_bytes, older_than_s=o.older_than, yes=o.yes)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    if o.as_json:
        click.echo(json.dumps({"dry_run": report.dry_run, "before": report.before, "after": report.after,
                               "max_bytes": report.max_bytes, "removed": [e.name for e in report.removed],
                               "kept": report.kept, "over_budget": report.over_budget}, indent=1))
    else:
        click.echo("\n".join(describe(report)))
    raise SystemExit(1 if report.over_budget else 0)


def commands() -> dict[str, click.Command]:
    """The sharing commands by name, for the ``cachebuild`` group (``cachebuild.cli.SHARE_COMMANDS``)."""
    from cachebuild.share.columns import columns

    made = [command("pull", TransferOptions, pull), command("push", TransferOptions, push),
            command("status", StatusOptions, status), command("ls", LsOptions, ls), columns,
            _resolve_command(), command("serve", ServeOptions, serve), command("gc", GcOptions, gc)]
    return {c.name or "": c for c in made}
