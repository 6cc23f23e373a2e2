"""``cachebuild show`` and ``cachebuild report``: parse, check, call :mod:`cachebuild.inspect`.

Registered under the ``cachebuild.commands`` entry points (pyproject.toml), like ``train``: they live
beside the loaders because ``--augment`` runs the device transforms and ``--run`` reads a training run's
metrics, and ``cachebuild`` itself never imports ``loaders``. Importing this module imports no torch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from cachebuild.errors import CacheBuildError

__all__ = ["report", "run_curves", "show"]

_PRESETS = ("auto", "imagenet", "imagenet-eval", "cifar", "cifar-eval")  # loaders.augment_view.PRESETS


def _open(where: str) -> Any:
    from cachebuild.storage.cache.reader import open_cache

    try:
        return open_cache(where)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None


@click.command("show", context_settings={"show_default": True})
@click.argument("cache", metavar="PATH|URL")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The PNG to write.")
@click.option("--n", "n", type=click.IntRange(min=1), default=64,
              help="Random samples (without --per-class/--indices).")
@click.option("--seed", type=int, default=0, help="Seed of the random picks and of --augment's random parameters.")
@click.option("--per-class", type=click.IntRange(min=1), default=None,
              help="Samples of each class in --classes, one class per row [default with --classes: 8].")
@click.option("--classes", default=None, metavar="SPEC",
              help="Classes for --per-class: indices and ranges (0-15, 3,7) or class names [default: 0-15].")
@click.option("--indices", default=None, metavar="SPEC", help="These samples: 3,7,100-120 (ranges inclusive).")
@click.option("--augment", type=click.Choice(_PRESETS), default=None,
              help="Run the batch through this device-transform preset (on the CPU) and show the result beside "
                   "each stored sample; auto: cifar for 32x32 caches, else imagenet.")
@click.option("--crop", type=click.IntRange(min=8), default=None,
              help="--augment's output size [default: the cache's image size].")
@click.option("--columns", type=click.IntRange(min=1), default=None, help="Tiles per row [default: up to 8].")
@click.option("--layout", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write each tile's index, class, source file and pixel box as JSON here.")
def show(cache: str, out: Path, n: int, seed: int, per_class: int | None, classes: str | None,
         indices: str | None, augment: str | None, crop: int | None, columns: int | None,
         layout: Path | None) -> None:
    """A contact sheet of samples of the cache at PATH or URL: at random, per class, or given indices, each
    captioned with its index, class and source file."""
    from cachebuild.inspect import select
    from cachebuild.inspect import show as make_sheet

    t0 = time.perf_counter()
    reader = _open(cache)
    try:
        selection = select(reader, n=n, seed=seed, per_class=per_class, classes=classes, indices=indices)
        fn = None
        if augment is not None:
            from loaders.augment_view import augment_view

            fn = augment_view(augment, reader.manifest.shape, crop, seed)
        sheet = make_sheet(reader, selection, augment=fn, columns=columns)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    tiles = [{"index": t.index, "label": t.label, "class": t.class_name, "path": t.path, "stored": t.stored,
              "augmented": t.augmented, "caption": t.caption} for t in sheet.tiles]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        sheet.save(out)
        if layout is not None:
            doc = {"scale": sheet.scale, "columns": sheet.columns, "tiles": tiles}
            layout.write_text(json.dumps(doc, indent=1))  # ASCII: non-UTF-8 names survive as \udcXX escapes
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or out}: {e.strerror or e}") from None
    extra = f", --augment {augment} beside each" if augment else ""
    click.echo(f"{out}: {len(sheet.tiles)} samples of {reader.location.describe()} ({sheet.columns} per row{extra}), "
               f"{time.perf_counter() - t0:.2f} s")


def run_curves(run: Path, png: Path) -> tuple[Path, dict[str, object]] | None:
    """The report's training section: ``plot_metrics`` of the run's metrics file, and its summary's numbers."""
    from loaders.train.metrics import plot_metrics
    from loaders.train.run.fit import METRICS_NAME

    metrics = run / METRICS_NAME
    if not metrics.is_file():
        return None
    plot_metrics(metrics, png)
    summary: dict[str, object] = {}
    try:
        doc = json.loads((run / "summary.json").read_text(encoding="utf-8"))
        keys = ("epoch", "train_loss", "val_loss", "val_top1", "val_top5", "img_per_s", "data_wait")
        summary = {k: doc[k] for k in keys if isinstance(doc, dict) and doc.get(k) is not None}
    except (OSError, ValueError):
        pass  # a run still going (or killed) has metrics but no summary yet
    return png, summary


@click.command("report", context_settings={"show_default": True})
@click.argument("cache", metavar="PATH|URL")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for index.html and its images (new, empty, or an earlier report: only its files are "
                   "replaced).")
@click.option("--run", "run", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="A `cachebuild train --out` folder: add its training curves.")
@click.option("--stats-sample", type=click.IntRange(min=1), default=10_000,
              help="Samples the pixel statistics are computed over (all when the cache is smaller).")
@click.option("--per-class", type=click.IntRange(min=1), default=8, help="Samples on each class's contact sheet.")
@click.option("--classes-per-page", type=click.IntRange(min=1), default=10)
@click.option("--seed", type=int, default=0)
def report(cache: str, out: Path, run: Path | None, stats_sample: int, per_class: int, classes_per_page: int,
           seed: int) -> None:
    """A static HTML dataset card of the cache at PATH or URL: the manifest in words, per-class counts and
    contact sheets, pixel statistics for Normalize, skipped files, and (with --run) training curves."""
    from cachebuild.inspect import ReportOptions, write_report

    t0 = time.perf_counter()
    reader = _open(cache)
    opts = ReportOptions(per_class=per_class, classes_per_page=classes_per_page, stats_sample=stats_sample,
                         seed=seed)
    try:
        index = write_report(reader, out, opts, run=run, run_curves=run_curves)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or out}: {e.strerror or e}") from None
    click.echo(f"{index}: report of {reader.manifest.count} samples of {reader.location.describe()}, "
               f"{time.perf_counter() - t0:.1f} s (pixel statistics over "
               f"{min(stats_sample, reader.manifest.count)} samples)")
