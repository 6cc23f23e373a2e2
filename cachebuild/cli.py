"""The ``cachebuild`` command line: parse, validate, call the library. No logic lives here."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import click

from cachebuild.decode import DEFAULT_MAX_PIXELS, FITS, INTERPOLATIONS
from cachebuild.errors import CacheBuildError, DecodeError, OptionError

__all__ = ["COMMAND_GROUP", "default_out", "main"]

log = logging.getLogger("cachebuild")


def default_out(dataset: str, size: int, fit: str, storage: str) -> Path:
    """``$CACHEBUILD_HOME`` (default ``~/.cache/cachebuild``) / ``<dataset>-<size>[-<fit>][-zarr]``."""
    home = Path(os.environ.get("CACHEBUILD_HOME", Path.home() / ".cache" / "cachebuild"))
    name = f"{dataset}-{size}" + ("" if fit == "crop" else f"-{fit}") + ("-zarr" if storage == "zarr" else "")
    return home / name


def _setup_logging(quiet: bool, verbose: bool) -> None:
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def build_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options every build command shares."""
    opts = [
        click.option("--out", type=click.Path(path_type=Path), default=None,
                     help="Output folder; one sub-folder per split. Default: $CACHEBUILD_HOME/<dataset>-<size>."),
        click.option("--format", "storage", type=click.Choice(["npy", "zarr"]), default="npy", show_default=True,
                     help="npy: fixed-shape shards to memory-map; zarr: one v3 array chunked along samples."),
        click.option("--fit", type=click.Choice(FITS), default="crop", show_default=True,
                     help="crop: short side to S then centre crop; squash: to SxS; pad: letterbox, boxes recorded."),
        click.option("--interpolation", type=click.Choice(INTERPOLATIONS), default="antialias", show_default=True,
                     help="antialias: bilinear with antialiasing (PIL/torchvision's default); area/linear: OpenCV."),
        click.option("--jobs", "-j", type=int, default=-1, show_default=True,
                     help="Worker processes (joblib); -1: all cores."),
        click.option("--dask-scheduler", metavar="ADDRESS", default=None,
                     help="Run the blocks on a Dask cluster (joblib's dask backend), e.g. tcp://host:8786; "
                          "its workers must see SRC and --out at the same paths. Needs cachebuild[dask]."),
        click.option("--shard-size", type=click.IntRange(min=1), default=None,
                     help="Samples per block and npy shard (zarr: rounded down to whole chunks). "
                          "Default: about 64 MB of pixels."),
        click.option("--chunk-size", type=click.IntRange(min=1), default=None,
                     help="zarr: samples per chunk. Default: about 4 MB of pixels."),
        click.option("--compression", type=click.Choice(["none", "zstd", "blosc"]), default="none",
                     show_default=True, help="zarr chunk compression."),
        click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
                     help="skip: list bad files in the manifest and go on; fail: stop at the first."),
        click.option("--max-pixels", type=click.IntRange(min=1), default=DEFAULT_MAX_PIXELS, show_default=True,
                     help="Refuse, before decoding, any image whose header declares more pixels."),
        click.option("--force", is_flag=True, help="Replace a different cache already at --out."),
        click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal)."),
        click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors."),
        click.option("--verbose", "-v", is_flag=True, help="Debug logging."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _build_plans(plans: list[Any], root: Path, opts: Any) -> None:
    from cachebuild.pipeline import build

    for plan in plans:
        dest = root / plan.split
        log.info("%s/%s: %d files from %s -> %s", plan.dataset, plan.split, len(plan), plan.root, dest)
        result = build(plan, dest, opts)
        if result.status == "up to date":
            click.echo(f"{dest}: up to date ({result.count} samples)")
            continue
        mb = result.bytes_written / 1e6
        click.echo(
            f"{dest}: {result.count} samples, {result.failures} skipped, {result.seconds:.1f} s, "
            f"{result.images_per_second:.0f} img/s, {mb / result.seconds:.0f} MB/s written"
        )
        if result.failures:
            click.echo(f"  skipped files are listed in {dest / 'manifest.json'} (cachebuild info {dest})")


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


def _run_builds(plans_fn: Callable[[], list[Any]], dataset: str, size: int, out: Path | None,
                **kw: Any) -> None:
    from cachebuild.pipeline import BuildOptions

    _setup_logging(kw.pop("quiet"), kw.pop("verbose"))
    if kw["jobs"] == 0:
        raise click.BadParameter("must be a positive count or -1 (all cores), not 0", param_hint="--jobs")
    try:
        opts = BuildOptions(size=size, fit=kw["fit"], interpolation=kw["interpolation"], storage=kw["storage"],
                            jobs=kw["jobs"], block_size=kw["shard_size"], chunk_size=kw["chunk_size"],
                            compression=kw["compression"], on_error=kw["on_error"], max_pixels=kw["max_pixels"],
                            force=kw["force"], progress=kw["progress"])
    except OptionError as e:
        raise click.UsageError(str(e)) from None
    root = out if out is not None else default_out(dataset, size, opts.fit, opts.storage)
    try:
        plans = plans_fn()
        with _parallel_backend(kw["dask_scheduler"]):
            _build_plans(plans, root, opts)
    except DecodeError as e:
        raise click.ClickException(
            f"{e.path}: {e.reason}\n(--on-error fail stopped the build; finished blocks are kept and the same "
            f"command resumes; --on-error skip lists such files instead)"
        ) from None
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; finished blocks are kept: rerun the same command to resume") from None


COMMAND_GROUP = "cachebuild.commands"  # entry points: more `cachebuild` commands from other packages


def _command_entry_points() -> dict[str, EntryPoint]:
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
    """The built-in commands plus those registered under the ``cachebuild.commands`` entry point group
    (the training loop's ``train``): ``cachebuild`` never imports the packages that provide them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_command_entry_points()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
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


_SIZE = click.IntRange(min=8, max=8192)


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--split", type=click.Choice(["train", "val", "all"]), default="all", show_default=True)
@click.option("--size", type=_SIZE, default=224, show_default=True, help="Output side S (samples are S x S x 3).")
@build_options
def imagenet(src: Path, split: str, size: int, out: Path | None, **kw: Any) -> None:
    """ILSVRC2012 at SRC: the root (train/, val/), the Kaggle root, or one split folder."""
    from cachebuild.sources.imagenet import imagenet_plans

    _run_builds(lambda: imagenet_plans(src, split), "imagenet", size, out, **kw)


def _cifar_command(variant: str) -> click.Command:
    @click.argument("src", type=click.Path(path_type=Path))
    @click.option("--split", type=click.Choice(["train", "test", "all"]), default="all", show_default=True)
    @click.option("--size", type=_SIZE, default=32, show_default=True, help="Output side; 32 keeps CIFAR's pixels.")
    @build_options
    def command(src: Path, split: str, size: int, out: Path | None, **kw: Any) -> None:
        from cachebuild.sources.cifar import cifar_plans

        _run_builds(lambda: cifar_plans(src, variant, split), variant, size, out, **kw)

    command.__doc__ = (f"{variant.upper()} python batches at SRC: the folder holding them, their folder, "
                       f"or the .tar.gz.")
    return main.command(name=variant)(command)


_cifar_command("cifar10")
_cifar_command("cifar100")


@main.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--size", type=_SIZE, default=224, show_default=True, help="Output side S.")
@click.option("--split", default="train", show_default=True, help="Name of the split this tree is.")
@click.option("--name", default=None, help="Dataset name (default: the folder's name).")
@build_options
def folder(src: Path, size: int, split: str, name: str | None, out: Path | None, **kw: Any) -> None:
    """Any class-folder tree at SRC (ImageFolder's rules: one sub-folder per class)."""
    from cachebuild.sources.folder import folder_plan

    dataset = name or src.resolve().name or "folder"
    _run_builds(lambda: [folder_plan(src, dataset=dataset, split=split)], dataset, size, out, **kw)


def _open(path: Path):
    from cachebuild.format import open_cache

    try:
        return open_cache(path)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def info(path: Path, as_json: bool) -> None:
    """Describe the cache at PATH."""
    cache = _open(path)
    m = cache.manifest
    if as_json:
        click.echo(json.dumps(m.to_dict(), indent=1))
        return
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    classes = ", ".join(m.classes[:5]) + (", ..." if len(m.classes) > 5 else "")
    lines = [
        f"{path}",
        f"  {m.dataset}/{m.split}: {m.count} samples, {m.shape[0]}x{m.shape[1]}x{m.shape[2]} {m.dtype} {m.layout}",
        f"  storage: {m.storage}, {len(m.shards)} shard(s), {disk / 1e6:.1f} MB on disk",
        f"  classes: {len(m.classes)} ({classes})",
        f"  fit: {m.fit}, interpolation: {m.interpolation}",
        f"  source: {m.source.get('root')} ({m.source.get('files')} files, "
        f"fingerprint {str(m.source.get('fingerprint'))[:12]})",
        f"  built: {m.created} by cachebuild {m.tool.get('version')} (format {m.format} v{m.format_version})",
        f"  skipped: {len(m.failures)}",
    ]
    lines += [f"    {f.path}: {f.reason}" for f in m.failures[:20]]
    if len(m.failures) > 20:
        lines.append(f"    ... {len(m.failures) - 20} more (--json lists all)")
    click.echo("\n".join(lines))


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
def verify(path: Path) -> None:
    """Re-hash every shard and array of the cache at PATH against its manifest."""
    cache = _open(path)
    problems = cache.verify()
    if problems:
        for p in problems:
            click.echo(f"{path}: {p}", err=True)
        raise SystemExit(1)
    click.echo(f"{path}: ok ({cache.manifest.count} samples in {len(cache.manifest.shards)} shard(s) verified)")


@main.command()
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--classes", "n_classes", type=click.IntRange(1, 10), default=10, show_default=True)
@click.option("--train-per-class", type=click.IntRange(1), default=40, show_default=True)
@click.option("--val-per-class", type=click.IntRange(1), default=10, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def sample(dest: Path, n_classes: int, train_per_class: int, val_per_class: int, seed: int) -> None:
    """Write the built-in sample: real photographs in the ImageNet layout (with its quirks and a few
    broken files), made from images that ship inside scikit-image and scikit-learn."""
    from cachebuild.samples.imagenet_layout import write_imagenet

    if dest.exists() and any(dest.iterdir()):
        click.echo(f"{dest}: exists, left as it is")
        return
    written = write_imagenet(dest, n_classes=n_classes, train_per_class=train_per_class,
                             val_per_class=val_per_class, seed=seed, quirks=True, broken=True)
    click.echo(f"{dest}: {len(written['train'])} train and {len(written['val'])} val images, "
               f"{n_classes} classes")
