"""``cachebuild parity CACHE --source SRC``: parse, check, run the checks of :mod:`loaders.parity`.

Made from :class:`ParityOptions` (:func:`cachebuild.options.field_options`): each flag declared once, on its
field. Registered under the ``cachebuild.commands`` entry points (pyproject.toml), like ``train``. Exit 0
when every check passes, 1 when one fails (each named on its line), 2 on bad input (with the reason).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

from cachebuild.errors import CacheBuildError, OptionError
from cachebuild.options import REQUIRED, check_fields, field_options, option

__all__ = ["ParityOptions", "parity", "run_parity"]

EXIT_FAIL, EXIT_INPUT = 1, 2


@dataclass(frozen=True)
class ParityOptions:
    """``cachebuild parity``: each field is one flag (``cache`` the argument), declared once."""

    cache: str = option(REQUIRED, None, argument=True, metavar="PATH|URL")
    source: Path = option(REQUIRED, "The source the cache was built from (what its build command was given).",
                          path="any", exists=True)
    n: int = option(256, "Samples whose pixels are compared (all when the cache has fewer).", min=1)
    seed: int = option(0, "Seed of the sampled samples, the crop draws and the training A/B.")
    min_median_psnr: float | None = option(None, "The pixels check's floor for the median PSNR, dB [default: 40 "
                                           "for antialias, 25 for area and linear; at most 32 for a jpeg cache].",
                                           min=0.0)
    min_psnr: float | None = option(None, "The pixels check's floor for every sample's PSNR, dB [default: 24 for "
                                    "antialias, 15 for area and linear, at most 18 for a jpeg cache].", min=0.0)
    draws: int = option(200_000, "Crops drawn by each of our two paths for the augmentation tests.", min=100)
    reference_draws: int = option(20_000, "Crops drawn by torchvision's get_params for the same tests.", min=100)
    alpha: float = option(1e-3, "A two-sample test fails under this p-value.", min=1e-12, max=0.5)
    train_steps: int | None = option(None, "Also train the same model for K steps on torchvision's pipeline and "
                                     "on the cache's, and compare.", min=1, metavar="K")
    train_batch: int = option(32, "The training A/B's batch size.", min=1)
    train_model: str = option("small_cnn", "The training A/B's model (a loaders.train model name).")
    train_lr: float = option(0.05, "The training A/B's SGD learning rate.", min=0.0)
    train_runs: int = option(5, "Paired runs of the training A/B (each: one initialisation and sample order for "
                             "both pipelines); its verdict is on the spread of their differences.", min=2)
    train_alpha: float = option(0.01, "The training A/B fails when the 1 - ALPHA interval of the mean accuracy "
                                "difference lies beyond +-MARGIN.", min=1e-6, max=0.5, metavar="ALPHA")
    train_margin: float = option(0.1, "The accuracy difference (0 to 1) the two pipelines may train apart before "
                                 "the training A/B fails: an honest cache's stored crop alone moves a short run "
                                 "a few points.", min=0.0, max=1.0, metavar="MARGIN")
    train_eval: int = option(2000, "Images both models of a run are evaluated on (a seeded subset when there are "
                             "more).", min=1, metavar="N")
    val: str | None = option(None, "The cache of a held-out split: the A/B's models are evaluated on its source "
                             "files [default: the trained split's].", metavar="PATH|URL")
    val_source: Path | None = option(None, "The source the --val cache was built from [default: found beside "
                                     "--source as the two builds recorded their sources (train/ and val/ built "
                                     "apart), else --source].", path="any", exists=True)
    json_file: Path | None = option(None, "Write every figure here as JSON.", flag="--json", path="file")
    out: Path | None = option(None, "Folder for an HTML page (index.html) with the worst pixels and the loss "
                              "curves: a new or empty folder, or one an earlier parity wrote (only its own files "
                              "are replaced).", path="dir")

    def __post_init__(self) -> None:
        check_fields(self)


def _open(where: str) -> Any:
    from cachebuild.storage.cache import open_cache
    from loaders.parity.recipe import ParityInputError

    try:
        return open_cache(where)
    except CacheBuildError as e:
        raise ParityInputError(f"{where}: not a cache ({str(e).splitlines()[0]})") from None


def _thresholds(o: ParityOptions, recipe: Any) -> tuple[float, float]:
    """The PSNR floors: antialiased resizes match torchvision closely; plain bilinear and area filters alias,
    so a sub-pixel difference in where the crop starts changes many pixels; a jpeg cache adds its coding."""
    median, each = (40.0, 24.0) if recipe.interpolation == "antialias" else (25.0, 15.0)
    if recipe.codec:
        median, each = min(median, 32.0), min(each, 18.0)
    return (o.min_median_psnr if o.min_median_psnr is not None else median,
            o.min_psnr if o.min_psnr is not None else each)


def _side(where: str, src: Path, flag: str = "--source") -> tuple[Any, Any, Any, Any]:
    """(reader, recipe, listing, matching) of one cache against its reference; ParityInputError naming
    ``flag`` when ``src`` is not the tree the cache was built from (:func:`_same_tree`)."""
    from loaders.parity.checks import match_samples
    from loaders.parity.recipe import recipe_of
    from loaders.parity.references import reference_listing

    reader = _open(where)
    recipe = recipe_of(reader.manifest)
    listing = reference_listing(recipe, src)
    match = match_samples(reader.paths(), listing)
    _same_tree(where, src, flag, reader, listing, match)
    return reader, recipe, listing, match


SIZES_CHECKED = 1000  # source files whose sizes are compared with the build's record (a seeded choice)


def _same_tree(where: str, src: Path, flag: str, reader: Any, listing: Any, match: Any) -> None:
    """Bad input, not a failed check, when ``src`` is another tree than the cache's: none of its samples is a
    file of ``src``, none at its own path (only by file name: a folder above or beside the build's), or most
    of the files at their paths differ in size from the build's record of them (``source_files.json``: a
    sibling tree with the same names). A few changed or moved files are the checks' to report."""
    from cachebuild.storage.cache import load_source_inputs
    from loaders.parity.recipe import ParityInputError

    n = reader.manifest.count
    found = match.ref_index >= 0
    if not n:
        return
    if not found.any():
        raise ParityInputError(f"none of the {n} samples of {where} is a file of {src} ({listing.how}): another "
                               f"source? pass the one the cache was built from to {flag}")
    if found.sum() == match.by_name:
        raise ParityInputError(f"another tree: none of the {n} samples of {where} is at its path in {src} (only "
                               f"{match.by_name} files of the same names elsewhere in it): pass the folder the "
                               f"cache was built from to {flag}")
    inputs = load_source_inputs(reader.location, reader.manifest) if listing.files is not None else None
    if inputs is None:
        return
    built = dict(zip(inputs.keys, inputs.rows[:, 1].tolist(), strict=True))  # rows: label, size, mtime
    paths = reader.paths()
    at_path = [i for i in np.flatnonzero(found) if paths[i] in built and listing.keys[match.ref_index[i]] == paths[i]]
    picks = np.random.default_rng(0).permutation(len(at_path))[:SIZES_CHECKED]
    differ = []
    for k in picks.tolist():
        i = at_path[k]
        f = listing.files[match.ref_index[i]]
        size = f.stat().st_size if f.is_file() else -1
        if size != built[paths[i]]:
            differ.append((paths[i], built[paths[i]], size))
    if differ and len(differ) * 2 > len(picks):
        key, was, now = differ[0]
        raise ParityInputError(f"{src} is not the tree {where} was built from: {len(differ)} of the {len(picks)} "
                               f"files checked differ in size from the build's record of them, e.g. {key}: "
                               f"{was} bytes when built, {now} now; pass the source the cache was built from to "
                               f"{flag}, or rebuild the cache from this one")


def _val_source(o: ParityOptions, train: Any) -> tuple[Path, str]:
    """Where ``--val``'s cache was built from, and the flag that names it: ``--val-source``; else, when the two
    caches were built from different folders (``train/`` and ``val/`` apart), the val one where it lies relative
    to ``--source`` as the builds recorded them; else ``--source`` (an ImageNet root holds both splits)."""
    import os

    if o.val_source is not None:
        return o.val_source, "--val-source"
    val = _open(str(o.val))
    recipes = [r.manifest.source.get("recipe") or {} for r in (train, val)]
    built = [r.get("src") for r in recipes]
    if all(isinstance(b, str) and b for b in built) and built[0] != built[1]:
        beside = Path(os.path.normpath(o.source / os.path.relpath(str(built[1]), str(built[0]))))
        if beside.exists():
            return beside, "--val-source"
    return o.source, "--val-source"


def run_parity(o: ParityOptions, echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every check of ``o.cache`` against ``o.source``; the JSON document (``passed``, ``checks``...).
    :class:`~loaders.parity.recipe.ParityInputError` on bad input."""
    from loaders import CachedImageDataset
    from loaders.parity import augment, checks, output
    from loaders.parity.recipe import need_scipy

    need_scipy()
    t0 = time.perf_counter()
    if o.out is not None:
        output.prepare_out(o.out)
    reader, recipe, listing, match = _side(o.cache, o.source)
    echo(f"{reader.location.describe()}: {recipe.describe()}; reference: {listing.how}")
    results = checks.order_and_labels(reader, listing, match)
    median, each = _thresholds(o, recipe)
    pix, res = checks.pixels(reader, listing, match, recipe, n=o.n, seed=o.seed, min_median=median, min_each=each)
    results.append(pix)
    s = recipe.size
    boxes = np.asarray(reader.boxes) if reader.boxes is not None else np.array([[0, 0, s, s]])
    results.append(augment.augmentation(boxes.astype(np.int64), (s, s), draws=o.draws,
                                        reference_draws=o.reference_draws, seed=o.seed, alpha=o.alpha))
    dataset = CachedImageDataset(o.cache)
    picks = np.random.default_rng(o.seed).permutation(len(dataset))[: min(64, len(dataset))]
    results.append(augment.eval_crop(dataset, picks, max(8, round(s * 0.875)), reader.boxes))
    png = _curves_png(o, echo)
    if o.train_steps is not None:
        results.append(_training(o, dataset, reader, listing, match, png))
    doc = output.document({"cache": reader.location.describe(), "source": str(o.source),
                           "recipe": recipe.describe(), "reference": listing.how}, results)
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    _write(o, doc, res, reader, png is not None)
    return doc


def _curves_png(o: ParityOptions, echo: Callable[[str], None]) -> Path | None:
    """Where the training A/B's loss curves go: in ``--out`` when there is a training A/B and matplotlib (the
    ``plots`` extra) to draw them; without it, one line says so and the page goes without."""
    from loaders.parity.output import CURVES
    from loaders.train.metrics import PlotsUnavailableError, pyplot

    if o.out is None or o.train_steps is None:
        return None
    try:
        pyplot(f"parity's {CURVES}")
    except PlotsUnavailableError as e:
        echo(str(e))
        return None
    return o.out / CURVES


def _training(o: ParityOptions, dataset: Any, reader: Any, listing: Any, match: Any, png: Path | None) -> Any:
    from loaders import CachedImageDataset
    from loaders.parity.train_ab import AbData, AbSettings, training_ab

    train = AbData(dataset, listing, match.ref_index)
    if o.val is not None:
        src, flag = _val_source(o, reader)
        _, _, v_listing, v_match = _side(o.val, src, flag)
        val = AbData(CachedImageDataset(o.val), v_listing, v_match.ref_index)
    else:
        val = train
    for side in (train, val):
        if (side.ref_index < 0).any():
            from loaders.parity.checks import Check

            return Check("training", False, "some samples have no source file: see the labels check", {})
    return training_ab(train, val, AbSettings(o.train_steps or 0, o.train_batch, o.train_model, o.train_lr,
                                              o.seed, o.train_runs, o.train_alpha, o.train_eval, o.train_margin), png)


def _write(o: ParityOptions, doc: dict[str, Any], res: Any, reader: Any, curves: bool) -> None:
    from loaders.parity import output

    if o.json_file is not None:
        output.write_json(o.json_file, doc)
    if o.out is not None:
        sheet = output.worst_sheet(res, list(reader.manifest.classes), np.asarray(reader.labels), reader.paths(),
                                   o.out / output.SHEET)
        output.write_html(o.out, doc, sheet, curves)


def _parity(**kw: Any) -> None:
    """Check that the cache at PATH or URL trains like the torchvision pipeline it replaces: its pixels, order
    and labels against torchvision's reading of --source, our crop and flip against torchvision's, the eval
    crop, and (--train-steps) a short training A/B. Exit 0: every check passed; 1: one failed; 2: bad input."""
    from loaders.parity.recipe import ParityInputError

    try:
        o = ParityOptions(**kw)
    except OptionError as e:
        raise click.UsageError(str(e)) from None
    try:
        doc = run_parity(o, echo=click.echo)
    except ParityInputError as e:
        click.echo(f"Error: {e}", err=True)
        raise SystemExit(EXIT_INPUT) from None
    except CacheBuildError as e:
        click.echo(f"Error: {str(e).splitlines()[0]}", err=True)
        raise SystemExit(EXIT_INPUT) from None
    for c in doc["checks"]:
        click.echo(f"{c['name']}: {'ok' if c['passed'] else 'FAIL'}, {c['verdict']}")
    failed = doc["failed"]
    click.echo(f"parity: {'every check passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
               f"({doc['seconds']:.1f} s)")
    if failed:
        raise SystemExit(EXIT_FAIL)


#: ``cachebuild parity CACHE --source SRC [options]``: one parameter per ``ParityOptions`` field.
parity = click.Command("parity", params=field_options(ParityOptions), callback=_parity, help=_parity.__doc__,
                       context_settings={"show_default": True, "max_content_width": 110})
