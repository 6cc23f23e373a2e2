"""``cachebuild show`` and ``cachebuild report``: parse, check, call :mod:`cachebuild.inspect`.

Made from dataclasses (:func:`cachebuild.options.field_options`: ``ShowOptions``; ``ReportTarget`` and
``cachebuild.inspect.ReportOptions``), each flag declared once, on its field. Registered as
``cachebuild.commands`` entry points, like ``train``: ``--augment`` runs the device transforms and ``--run``
reads a training run's metrics, and ``cachebuild`` never imports ``loaders``. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cachebuild.errors import CacheBuildError
from cachebuild.inspect.report import ReportOptions  # no torch: numpy and the cache reader, as report needs
from cachebuild.options import REQUIRED, check_fields, field_options, option

__all__ = ["ReportTarget", "ShowOptions", "report", "run_curves", "run_figures", "show"]

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
    from cachebuild.inspect.output import check_file_target, write_file

    o = ShowOptions(**kw)
    t0 = time.perf_counter()
    reader = _open(o.cache)
    try:
        check_file_target(o.out, "png")  # before any pixel is read: a cache's own file, a link, a FIFO...
        if o.layout is not None:
            check_file_target(o.layout, "layout")
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
        write_file(o.out, sheet.save)
        if o.layout is not None:
            doc = {"scale": sheet.scale, "columns": sheet.columns, "tiles": tiles}
            text = json.dumps(doc, indent=1)  # ASCII: non-UTF-8 names survive as \udcXX escapes
            write_file(o.layout, lambda f: f.write(text.encode("ascii")))
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or o.out}: {e.strerror or e}") from None
    if sheet.missing_glyphs:
        shown = " ".join(sheet.missing_glyphs[:10]) + (" ..." if len(sheet.missing_glyphs) > 10 else "")
        click.echo(f"note: no installed font draws {len(sheet.missing_glyphs)} character(s) of the captions "
                   f"({shown}): they show as boxes; --layout writes the names exactly. Install a font that has "
                   f"them (e.g. Noto Sans CJK for Chinese, Japanese, Korean) and run show again", err=True)
    extra = f", --augment {o.augment} beside each" if o.augment else ""
    click.echo(f"{o.out}: {len(sheet.tiles)} samples of {reader.location.describe()} ({sheet.columns} per "
               f"row{extra}), {time.perf_counter() - t0:.2f} s")


show = click.Command("show", params=field_options(ShowOptions), callback=_show, help=_show.__doc__,
                     context_settings={"show_default": True})


def run_curves(run: Path, png: Path) -> tuple[Path, dict[str, object]] | None:
    """The report's training section: ``plot_metrics`` of the run's metrics file, and its figures in words."""
    from loaders.train.metrics import plot_metrics, read_metrics
    from loaders.train.run.fit import METRICS_NAME

    metrics = run / METRICS_NAME
    if not metrics.is_file():
        return None
    plot_metrics(metrics, png)
    return png, run_figures(read_metrics(metrics), _planned_epochs(run))


def _planned_epochs(run: Path) -> int | None:
    try:
        doc = json.loads((run / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a run folder without its config (copied in part): the epochs done are still counted
    epochs = doc.get("epochs") if isinstance(doc, dict) else None
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None


_FIGURES = (("train_loss", "train loss", "{:.4f}"), ("val_loss", "val loss", "{:.4f}"),
            ("val_top1", "val top-1", "{:.1%}"), ("val_top5", "val top-5", "{:.1%}"),
            ("img_per_s", "throughput", "{:,.0f} img/s"), ("data_wait", "data wait", "{:.1%} of step time"))


def run_figures(records: list[dict[str, Any]], planned: int | None) -> dict[str, object]:
    """A run's figures as a reader wants them: epochs counted from the metrics file's epoch records (they
    survive a resume, where ``summary.json`` counts only the epochs of the last process), the last epoch's
    losses to 4 decimals, accuracies and the data-wait share in percent, throughput in whole images a second."""
    epochs: dict[int, dict[str, Any]] = {}
    for r in records:
        e = r.get("epoch")
        if r.get("kind") == "epoch" and isinstance(e, int) and e >= 0:
            epochs[e] = r  # a resumed epoch's record replaces the one logged before the kill
    out: dict[str, object] = {"epochs": f"{len(epochs)} of {planned}" if planned else str(len(epochs))}
    if not epochs:
        return out
    last = max(epochs)
    out["last epoch"] = str(last + 1)
    for key, label, fmt in _FIGURES:
        value = epochs[last].get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[label] = fmt.format(value)
    tops = [(r["val_top1"], e) for e, r in epochs.items() if isinstance(r.get("val_top1"), int | float)]
    if len(tops) > 1:
        top, at = max(tops)
        out["best val top-1"] = f"{top:.1%} (epoch {at + 1})"
    return out


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
