"""``cachebuild show`` and ``cachebuild report``: parse, check, call :mod:`cachebuild.inspect`.

Made from dataclasses (:func:`cachebuild.options.field_options`: ``ShowOptions``; ``ReportTarget`` and
``cachebuild.inspect.ReportOptions``), each flag declared once, on its field. Registered as
``cachebuild.commands`` entry points, like ``train``: ``--augment`` runs the device transforms and ``--run``
reads a training run's metrics, and ``cachebuild`` never imports ``loaders``. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cachebuild.errors import CacheBuildError
from cachebuild.inspect.report import ReportOptions  # no torch: numpy and the cache reader, as report needs
from cachebuild.options import REQUIRED, check_fields, field_options, option

__all__ = ["ReportTarget", "ShowOptions", "report", "run_curves", "show"]

_PRESETS = ("auto", "imagenet", "imagenet-eval", "cifar", "cifar-eval")  # loaders.augment_view.PRESETS


def _open(where: str) -> Any:
    from cachebuild.storage.cache import open_cache

    try:
        return open_cache(where)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None


@dataclass(frozen=True)
class ShowOptions:
    """``cachebuild show``: each field is one flag (``cache`` the argument), declared once."""

    cache: str = option(REQUIRED, None, argument=True, metavar="PATH|URL")
    out: Path = option(REQUIRED, "The PNG to write.", path="file")
    n: int = option(64, "Random samples (without --per-class/--indices).", min=1)
    seed: int = option(0, "Seed of the random picks and of --augment's random parameters.")
    per_class: int | None = option(None, "Samples of each class in --classes, one class per row [default with "
                                   "--classes: 8].", min=1)
    classes: str | None = option(None, "Classes for --per-class: indices and ranges (0-15, 3,7) or class names "
                                 "[default: 0-15].", metavar="SPEC")
    indices: str | None = option(None, "These samples: 3,7,100-120 (ranges inclusive).", metavar="SPEC")
    augment: str | None = option(None, "Run the batch through this device-transform preset (on the CPU) and show "
                                 "the result beside each stored sample; auto: cifar for 32x32 caches, else "
                                 "imagenet.", choices=_PRESETS)
    crop: int | None = option(None, "--augment's output size [default: the cache's image size].", min=8)
    columns: int | None = option(None, "Tiles per row [default: up to 8].", min=1)
    layout: Path | None = option(None, "Also write each tile's index, class, source file and pixel box as JSON "
                                 "here.", path="file")

    def __post_init__(self) -> None:
        check_fields(self)


def _show(**kw: Any) -> None:
    """A contact sheet of samples of the cache at PATH or URL: at random, per class, or given indices, each
    captioned with its index, class and source file."""
    from cachebuild.inspect import select
    from cachebuild.inspect import show as make_sheet

    o = ShowOptions(**kw)
    t0 = time.perf_counter()
    reader = _open(o.cache)
    try:
        selection = select(reader, n=o.n, seed=o.seed, per_class=o.per_class, classes=o.classes,
                           indices=o.indices)
        fn = None
        if o.augment is not None:
            from loaders.augment_view import augment_view

            fn = augment_view(o.augment, reader.manifest.shape, o.crop, o.seed)
        sheet = make_sheet(reader, selection, augment=fn, columns=o.columns)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    tiles = [{"index": t.index, "label": t.label, "class": t.class_name, "path": t.path, "stored": t.stored,
              "augmented": t.augmented, "caption": t.caption} for t in sheet.tiles]
    try:
        o.out.parent.mkdir(parents=True, exist_ok=True)
        sheet.save(o.out)
        if o.layout is not None:
            doc = {"scale": sheet.scale, "columns": sheet.columns, "tiles": tiles}
            o.layout.write_text(json.dumps(doc, indent=1))  # ASCII: non-UTF-8 names survive as \udcXX escapes
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or o.out}: {e.strerror or e}") from None
    extra = f", --augment {o.augment} beside each" if o.augment else ""
    click.echo(f"{o.out}: {len(sheet.tiles)} samples of {reader.location.describe()} ({sheet.columns} per "
               f"row{extra}), {time.perf_counter() - t0:.2f} s")


show = click.Command("show", params=field_options(ShowOptions), callback=_show, help=_show.__doc__,
                     context_settings={"show_default": True})


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


@dataclass(frozen=True)
class ReportTarget:
    """``cachebuild report``'s cache and folders; what the report shows is ``ReportOptions``' flags."""

    cache: str = option(REQUIRED, None, argument=True, metavar="PATH|URL")
    out: Path = option(REQUIRED, "Folder for index.html and its images (new, empty, or an earlier report: only its "
                       "files are replaced).", path="dir")
    run: Path | None = option(None, "A `cachebuild train --out` folder: add its training curves.", path="dir",
                              exists=True)

    def __post_init__(self) -> None:
        check_fields(self)


def _report(**kw: Any) -> None:
    """A static HTML dataset card of the cache at PATH or URL: the manifest in words, per-class counts and
    contact sheets, pixel statistics for Normalize, skipped files, and (with --run) training curves."""
    from cachebuild.inspect import write_report

    target = ReportTarget(**{f.name: kw.pop(f.name) for f in dataclasses.fields(ReportTarget)})
    opts = ReportOptions(**kw)
    t0 = time.perf_counter()
    reader = _open(target.cache)
    try:
        index = write_report(reader, target.out, opts, run=target.run, run_curves=run_curves)
    except CacheBuildError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or target.out}: {e.strerror or e}") from None
    click.echo(f"{index}: report of {reader.manifest.count} samples of {reader.location.describe()}, "
               f"{time.perf_counter() - t0:.1f} s (pixel statistics over "
               f"{min(opts.stats_sample, reader.manifest.count)} samples)")


report = click.Command("report", params=[*field_options(ReportTarget), *field_options(ReportOptions)],
                       callback=_report, help=_report.__doc__, context_settings={"show_default": True})
