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

from cachebuild.build.decode import DEFAULT_MAX_PIXELS, FITS, INTERPOLATIONS
from cachebuild.errors import CacheBuildError, DecodeError, OptionError
from cachebuild.share.cli import WAIT_OPTION, quick_verify, register
from cachebuild.storage import DEFAULT_STORAGE, backend_names

__all__ = ["COMMAND_GROUP", "default_out", "main"]

# --codec NAME stores samples encoded, in the storage kind of the same name.
CODECS = ("jpeg",)

log = logging.getLogger("cachebuild")


def default_out(dataset: str, size: int, fit: str, storage: str) -> Path:
    """``$CACHEBUILD_HOME`` (default ``~/.cache/cachebuild``) / ``<dataset>-<size>[-<fit>][-<storage>]``."""
    home = Path(os.environ.get("CACHEBUILD_HOME", Path.home() / ".cache" / "cachebuild"))
    name = f"{dataset}-{size}" + ("" if fit == "crop" else f"-{fit}")
    name += "" if storage == DEFAULT_STORAGE else f"-{storage}"
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
        click.option("--format", "storage", type=click.Choice(list(backend_names())), default=DEFAULT_STORAGE,
                     show_default=True,
                     help="npy: fixed-shape shards to memory-map; zarr: one v3 array chunked along samples."),
        click.option("--fit", type=click.Choice(FITS), default="crop", show_default=True,
                     help="crop: short side to S then centre crop; squash: to SxS; pad: letterbox, boxes recorded."),
        click.option("--interpolation", type=click.Choice(INTERPOLATIONS), default="antialias", show_default=True,
                     help="antialias: PIL/torchvision's antialiased bilinear from a 2x downscale on, OpenCV bilinear "
                          "below (same filter within +-1); area/linear: OpenCV."),
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
        click.option("--codec", type=click.Choice(["none", *CODECS]), default="none", show_default=True,
                     help="jpeg: store each resized sample as a JPEG (a compact cache, ~10x smaller at 224 px, "
                          "decoded when read); none: raw pixels."),
        click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
                     help="--codec jpeg: encoder quality."),
        click.option("--subsampling", type=click.Choice(["420", "444"]), default="420", show_default=True,
                     help="--codec jpeg: chroma subsampling (444 keeps full colour resolution, ~1.3x the bytes)."),
        click.option("--decode-device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                     help="cuda: decode source JPEGs in batches with nvJPEG and resize on the GPU, one worker per "
                          "GPU (close to, not byte-equal with, a CPU build); files nvJPEG cannot take go to the CPU."),
        click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
                     help="skip: list bad files in the manifest and go on; fail: stop at the first."),
        click.option("--max-pixels", type=click.IntRange(min=1), default=DEFAULT_MAX_PIXELS, show_default=True,
                     help="Refuse, before decoding, any image whose header declares more pixels."),
        click.option("--force", is_flag=True, help="Replace a different cache already at --out."),
        WAIT_OPTION,
        click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal)."),
        click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors."),
        click.option("--verbose", "-v", is_flag=True, help="Debug logging."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _build_plans(plans: list[Any], root: Path, opts: Any) -> None:
    from cachebuild.build.pipeline import build

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
    from cachebuild.build.pipeline import BuildOptions

    _setup_logging(kw.pop("quiet"), kw.pop("verbose"))
    if kw["jobs"] == 0:
        raise click.BadParameter("must be a positive count or -1 (all cores), not 0", param_hint="--jobs")
    storage = kw["storage"]
    if kw["codec"] != "none":
        if storage not in (DEFAULT_STORAGE, kw["codec"]):
            raise click.BadParameter(f"--codec {kw['codec']} stores its own shards; drop --format {storage}",
                                     param_hint="--codec")
        storage = kw["codec"]
    try:
        opts = BuildOptions(size=size, fit=kw["fit"], interpolation=kw["interpolation"], storage=storage,
                            jobs=kw["jobs"], block_size=kw["shard_size"], chunk_size=kw["chunk_size"],
                            compression=kw["compression"], quality=kw["quality"], subsampling=kw["subsampling"],
                            decode_device=kw["decode_device"], on_error=kw["on_error"], max_pixels=kw["max_pixels"],
                            force=kw["force"], progress=kw["progress"], lock_wait=kw["wait"])
    except OptionError as e:  # the storage kind's own checks included (e.g. jpeg takes no --compression)
        raise click.UsageError(str(e)) from None
    root = out if out is not None else default_out(dataset, size, opts.fit, opts.storage)
    try:
        if opts.decode_device != "cpu":  # before listing a large source: no GPU, no build
            from cachebuild.build.gpu_build import check_decode_device

            check_decode_device(opts.decode_device)
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
@click.argument("src", metavar="SRC")
@click.option("--size", type=_SIZE, default=224, show_default=True, help="Output side S.")
@click.option("--split", default="train", show_default=True, help="Name of the split this tree is.")
@click.option("--name", default=None, help="Dataset name (default: the folder's name).")
@build_options
def folder(src: str, size: int, split: str, name: str | None, out: Path | None, **kw: Any) -> None:
    """Any class-folder tree at SRC, a path or a URL (s3://bucket/images, https://...): ImageFolder's rules,
    one sub-folder per class."""
    from cachebuild.sources.folder import folder_plan
    from cachebuild.storage import is_url

    last = src.rstrip("/").rsplit("/", 1)[-1] if is_url(src) else Path(src).resolve().name
    dataset = name or last or "folder"
    _run_builds(lambda: [folder_plan(src, dataset=dataset, split=split)], dataset, size, out, **kw)


_SHARD_SPLIT = click.option(
    "--split", default=None,
    help="Split to build: picks the shards whose names carry it (train-*, *-validation-*, test/...) and names the "
         "output sub-folder. Default: the one split the names carry, else train.")
_SHARD_CLASSES = click.option(
    "--classes", "classes_file", default=None, metavar="FILE",
    help="Class names, one per line (line number = class index); a path or URL.")


def _classes(classes_file: str | None) -> list[str] | None:
    from cachebuild.sources.shard_plan import read_classes

    return read_classes(classes_file) if classes_file is not None else None


@main.command()
@click.argument("src")
@_SHARD_SPLIT
@click.option("--size", type=_SIZE, default=224, show_default=True, help="Output side S.")
@_SHARD_CLASSES
@click.option("--label-key", default=None, metavar="FIELD",
              help="Take each label from this field of the sample's .json member instead of its .cls member.")
@click.option("--cls-key", default="cls", show_default=True, metavar="EXT",
              help="Extension of the member holding the class index (ASCII digits).")
@click.option("--image-keys", default="jpg,jpeg,png,webp", show_default=True, metavar="EXT,...",
              help="Extensions of the image member; the first one a sample has is used (content is sniffed).")
@click.option("--name", default=None, help="Dataset name (default: from the shard names).")
@build_options
def wds(src: str, split: str | None, size: int, classes_file: str | None, label_key: str | None, cls_key: str,
        image_keys: str, name: str | None, out: Path | None, **kw: Any) -> None:
    """WebDataset tar shards at SRC: a brace pattern (x-{0000..1023}.tar), a glob, a folder or prefix of .tar
    files, or one file; local or a URL (s3://, https://...). Shards in name order, samples in archive order."""
    from cachebuild.sources.shard_plan import dataset_name
    from cachebuild.sources.wds import WdsLayout, wds_plan

    keys = tuple(k.strip().lower().lstrip(".") for k in image_keys.split(",") if k.strip())
    if not keys:
        raise click.BadParameter("name at least one extension", param_hint="--image-keys")
    layout = WdsLayout(image_keys=keys, cls_key=cls_key.lower().lstrip("."), label_key=label_key)
    dataset = name or dataset_name(src)
    _run_builds(lambda: [wds_plan(src, split=split, classes=_classes(classes_file), layout=layout, dataset=dataset,
                                  jobs=kw["jobs"])], dataset, size, out, **kw)


@main.command()
@click.argument("src")
@_SHARD_SPLIT
@click.option("--size", type=_SIZE, default=224, show_default=True, help="Output side S.")
@_SHARD_CLASSES
@click.option("--image-column", default=None, metavar="NAME",
              help="Column of image bytes (binary, or Hugging Face's struct<bytes, path>). Default: image, "
                   "else the column the metadata calls an Image.")
@click.option("--label-column", default=None, metavar="NAME",
              help="Column of class indices. Default: label, else the column the metadata calls a ClassLabel.")
@click.option("--name", default=None, help="Dataset name (default: from SRC).")
@build_options
def parquet(src: str, split: str | None, size: int, classes_file: str | None, image_column: str | None,
            label_column: str | None, name: str | None, out: Path | None, **kw: Any) -> None:
    """Parquet files at SRC in the Hugging Face layout (data/train-00000-of-00004.parquet): a folder or prefix, a
    glob, a brace pattern or one file; local or a URL. Class names come from the ClassLabel in the files'
    metadata unless --classes is given. Needs pyarrow (cachebuild[parquet])."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise click.UsageError("reading Parquet needs pyarrow: pip install 'cachebuild[parquet]'") from None
    from cachebuild.sources.parquet import ParquetColumns, parquet_plan
    from cachebuild.sources.shard_plan import dataset_name

    columns = ParquetColumns(image=image_column, label=label_column)
    dataset = name or dataset_name(src)
    _run_builds(lambda: [parquet_plan(src, split=split, classes=_classes(classes_file), columns=columns,
                                      dataset=dataset, jobs=kw["jobs"])], dataset, size, out, **kw)


def _open(where: str):
    from cachebuild.storage.reader import open_cache

    try:
        return open_cache(where)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None


def _disk_bytes(cache: Any) -> int | None:
    """Bytes the cache's files take (None when a server lists no sizes)."""
    from cachebuild.errors import RemoteError

    try:
        sizes = cache.location.list_files().values()
    except RemoteError:
        return None
    return None if any(v < 0 for v in sizes) else sum(sizes)


@main.command()
@click.argument("where", metavar="PATH|URL")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def info(where: str, as_json: bool) -> None:
    """Describe the cache at PATH or URL (s3://, gs://, https://...)."""
    cache = _open(where)
    m = cache.manifest
    if as_json:
        click.echo(json.dumps(m.to_dict(), indent=1))
        return
    disk = _disk_bytes(cache)
    classes = ", ".join(m.classes[:5]) + (", ..." if len(m.classes) > 5 else "")
    lines = [
        f"{cache.location.describe()}",
        f"  {m.dataset}/{m.split}: {m.count} samples, {m.shape[0]}x{m.shape[1]}x{m.shape[2]} {m.dtype} {m.layout}",
        f"  storage: {m.storage}, {len(m.shards)} shard(s), "
        + (f"{disk / 1e6:.1f} MB" if disk is not None else "size not listed by the server")
        + (" on disk" if cache.location.is_local else ""),
        f"  classes: {len(m.classes)} ({classes})",
        f"  fit: {m.fit}, interpolation: {m.interpolation}",
        f"  source: {m.source.get('root')} ({m.source.get('files')} files, "
        f"fingerprint {str(m.source.get('fingerprint'))[:12]})",
        f"  built: {m.created} by cachebuild {m.tool.get('version')} (format {m.format} v{m.format_version})"
        + (f", {m.built_by.get('user')}@{m.built_by.get('host')}" if m.built_by else ""),
        f"  fingerprint: {m.build_key[:12]} (build key: source + parameters; CachedImageDataset(expect_fingerprint=))",
        f"  skipped: {len(m.failures)}",
    ]
    lines += [f"    {f.path}: {f.reason}" for f in m.failures[:20]]
    if len(m.failures) > 20:
        lines.append(f"    ... {len(m.failures) - 20} more (--json lists all)")
    click.echo("\n".join(lines))


@main.command()
@click.argument("where", metavar="PATH|URL")
@click.option("--quick", is_flag=True,
              help="Only sizes, headers and manifest consistency (seconds; no pixel is re-hashed).")
def verify(where: str, quick: bool) -> None:
    """Re-hash every shard and array of the cache at PATH or URL against its manifest."""
    if quick:
        quick_verify(where)
        return
    cache = _open(where)
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


register(main)  # pull, push, status, ls
