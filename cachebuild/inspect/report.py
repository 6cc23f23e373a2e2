"""``cachebuild report``: one static folder that describes a cache (``index.html``, class pages, PNGs).

Opens from disk or any static web server: relative links only, no script. Reads the label array once
(counts, per-class picks), the pixels of the samples it shows and of the statistics' sample, and the
source paths of the samples it shows; nothing grows with the cache but the label pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachebuild.inspect import page as P
from cachebuild.inspect.charts import counts_chart, histogram_chart, pyplot
from cachebuild.inspect.output import FILE_LIST, IMG, ReportFolder
from cachebuild.inspect.select import pick_per_class, pick_random
from cachebuild.inspect.show import Selection, show, source_paths
from cachebuild.inspect.stats import PixelStats, pixel_stats
from cachebuild.options import Options, option
from cachebuild.storage.cache import CacheReader

__all__ = ["FILE_LIST", "ReportOptions", "RunCurves", "write_report"]

# (run folder, PNG to write) -> (the PNG, a few summary lines) or None when the folder holds no metrics
RunCurves = Callable[[Path, Path], "tuple[Path, dict[str, object]] | None"]

_FITS = {"crop": "short side resized to the target, then centre-cropped",
         "squash": "resized to the target without keeping the aspect ratio",
         "pad": "letterboxed: resized to fit, zeros around (the real pixels' boxes are stored)"}


@dataclass(frozen=True)
class ReportOptions(Options):
    """What a report shows; each field declared once (``cachebuild report``'s flags are made from them)."""

    stats_sample: int = option(10_000, "Samples the pixel statistics are computed over (all when the cache is "
                               "smaller).", min=1)
    per_class: int = option(8, "Samples on each class's contact sheet.", min=1)
    classes_per_page: int = option(10, None, min=1)
    overview: int = 32  # random samples on the first page (not a flag)
    seed: int = option(0, None)


def _words(reader: CacheReader) -> dict[str, object]:
    m = reader.manifest
    src, b = m.source, m.build
    recipe: dict[str, object] = src["recipe"] if isinstance(src.get("recipe"), dict) else {}
    who = f"{m.built_by.get('user')}@{m.built_by.get('host')}" if m.built_by else "not recorded (older release)"
    h, w, _ = m.shape
    return {
        "cache": reader.location.describe(),
        "dataset / split": f"{m.dataset} / {m.split}",
        "samples": f"{m.count} samples of {h}x{w}x3 uint8 ({m.layout}), {len(m.classes)} classes, "
                   f"{len(m.failures)} source files skipped",
        "source": f"{src.get('root') or '(in-memory arrays)'}"
                  + (f", read as {recipe.get('kind')}" if recipe.get("kind") else "")
                  + f"; {src.get('files')} files planned",
        "fit": f"{m.fit}: {_FITS.get(m.fit, m.fit)}; interpolation {m.interpolation}",
        "storage": f"{m.storage}, {len(m.shards)} shard(s)"
                   + (f", quality {b.get('quality')}, subsampling {b.get('subsampling')}"
                      if b.get("codec") else ""),
        "fingerprint": f"{m.build_key} (build key: source digest + parameters; "
                       f"CachedImageDataset(expect_fingerprint=...))",
        "source digest": str(src.get("fingerprint")),
        "built": f"{m.created or 'time not recorded'} by {who}",
        "tool": ", ".join(f"{k} {v}" for k, v in m.tool.items()),
        "format": f"{m.format} version {m.format_version}",
    }


def _counts(reader: CacheReader) -> np.ndarray:
    m = reader.manifest
    return np.bincount(reader.labels, minlength=len(m.classes)) if m.count else np.zeros(len(m.classes), np.int64)


def _stats_html(st: PixelStats, pad: bool) -> str:
    mean = ", ".join(f"{v:.4f}" for v in st.mean)
    std = ", ".join(f"{v:.4f}" for v in st.std)
    how = "all samples" if st.samples == st.count else \
        f"a random sample of {st.samples} of the {st.count} samples (seed {st.seed}, drawn without replacement)"
    rows = [(ch, f"{st.mean[c]:.4f}", f"{st.std[c]:.4f}") for c, ch in enumerate("RGB")]
    text = (f"<p>Over {how}: {st.pixels} pixels per channel, values divided by 255"
            f"{' (letterbox padding included: it is what the model sees)' if pad else ''}.</p>\n"
            + P.table(["channel", "mean", "std"], rows)
            + f"<pre>transforms.Normalize(mean=({mean}), std=({std}))</pre>\n")
    if st.inside is not None:
        real = st.inside
        text += (f"<p>Over the real pixels only (inside each sample's box, {real.pixels} per channel): mean "
                 f"({', '.join(f'{v:.4f}' for v in real.mean)}), std ({', '.join(f'{v:.4f}' for v in real.std)})."
                 f"</p>\n")
    return text + f'<img src="{IMG}/histogram.png" alt="pixel value histograms">\n'


def _failures_html(reader: CacheReader) -> str:
    fails = reader.manifest.failures
    if not fails:
        return "<p>None: every planned source file produced a sample.</p>\n"
    return (f"<p>{len(fails)} source file(s) produced no sample (the build skipped them and listed them in the "
            f"manifest):</p>\n" + P.table(["file", "reason"], [(f.path, f.reason) for f in fails]))


def _class_pages(reader: CacheReader, folder: ReportFolder, counts: np.ndarray, opts: ReportOptions,
                 table: list[str]) -> list[str]:
    """One contact sheet per class, ``classes_per_page`` classes per page; returns the pages written."""
    m = reader.manifest
    n_pages = max(1, math.ceil(len(m.classes) / opts.classes_per_page))
    picks = pick_per_class(reader.labels, range(len(m.classes)), opts.per_class, opts.seed)
    written = []
    for p in range(n_pages):
        lo, hi = p * opts.classes_per_page, min(len(m.classes), (p + 1) * opts.classes_per_page)
        nav = ['<a href="index.html">overview</a>']
        nav += [f'<a href="{_page_name(p - 1)}">previous</a>'] if p else []
        nav += [f'<a href="{_page_name(p + 1)}">next</a>'] if p + 1 < n_pages else []
        parts = []
        for c in range(lo, hi):
            parts.append(f"<h3>{c}: {P.esc(m.classes[c])} ({int(counts[c])} samples)</h3>\n")
            if not len(picks[c]):
                parts.append('<p class="muted">no samples</p>\n')
                continue
            sheet = show(reader, Selection(picks[c]), columns=opts.per_class, paths=table)
            name = f"{IMG}/class-{c:05d}.png"
            with folder.open(name) as f:
                sheet.save(f)
            parts.append(f'<img src="{name}" alt="samples of class {P.esc(m.classes[c])}">\n')
        title = f"{m.dataset}/{m.split}: classes {lo}-{hi - 1}"
        folder.write_text(_page_name(p), P.page(title, "".join(parts), " ".join(nav)))
        written.append(_page_name(p))
    return written


def _page_name(p: int) -> str:
    return f"classes-{p + 1:03d}.html"


def write_report(reader: CacheReader, out: str | Path, options: ReportOptions | None = None, *,
                 run: Path | None = None, run_curves: RunCurves | None = None) -> Path:
    """Write the report of ``reader``'s cache into ``out``; returns ``out/index.html``."""
    opts = options or ReportOptions()
    out = Path(out)
    pyplot()  # before anything is written: without matplotlib, a one-line error and no folder
    folder = ReportFolder(out)
    folder.prepare()
    m = reader.manifest
    counts = _counts(reader)
    with folder.open(f"{IMG}/counts.png") as f:
        counts_chart(counts, m.classes, f)
    st = pixel_stats(reader, opts.stats_sample, opts.seed)
    with folder.open(f"{IMG}/histogram.png") as f:
        histogram_chart(st.histogram, f)
    table = source_paths(reader)
    body = [f"<h2>The cache</h2>\n{P.definition_list(_words(reader))}",
            "<h2>Build parameters</h2>\n" + P.table(["parameter", "value"], sorted(m.build.items()))]
    if m.count:
        sheet = show(reader, Selection(pick_random(m.count, opts.overview, opts.seed)), paths=table)
        with folder.open(f"{IMG}/samples.png") as f:
            sheet.save(f)
        body.append(f"<h2>Samples</h2>\n<p>{len(sheet.tiles)} at random (seed {opts.seed}); each captioned "
                    f"with its index, label, class and source file.</p>\n"
                    f'<img src="{IMG}/samples.png" alt="random samples">')
    pages = _class_pages(reader, folder, counts, opts, table) if m.classes else []
    links = " ".join(f'<a href="{n}">{n.removesuffix(".html")}</a>' for n in pages)
    nonzero = counts[counts > 0] if len(counts) else counts
    spread = (f"min {int(counts.min())}, median {int(np.median(counts))}, max {int(counts.max())}"
              if len(counts) else "no classes")
    body.append(f"<h2>Classes</h2>\n<p>{len(m.classes)} classes ({len(nonzero)} with samples): {spread} "
                f"samples per class. Contact sheets of {opts.per_class} random samples per class, "
                f"{opts.classes_per_page} classes per page: {links}</p>\n"
                f'<img src="{IMG}/counts.png" alt="samples per class">')
    body.append("<h2>Pixel statistics</h2>\n" + _stats_html(st, m.fit == "pad"))
    body.append("<h2>Skipped files</h2>\n" + _failures_html(reader))
    if run is not None and run_curves is not None:
        body.append(_run_html(run, folder, run_curves))
    title = f"{m.dataset}/{m.split}: {m.count} samples, {m.shape[0]}x{m.shape[1]}"
    nav = " ".join(['<a href="index.html">overview</a>', links])
    folder.write_text("index.html", P.page(title, "\n".join(body), nav))
    return out / "index.html"


def _run_html(run: Path, folder: ReportFolder, run_curves: RunCurves) -> str:
    got = run_curves(run, folder.claim(f"{IMG}/curves.png"))
    if got is None:
        return f"<h2>Training</h2>\n<p>{P.esc(run)} holds no metrics file: no curves to show.</p>\n"
    _png, summary = got
    return (f"<h2>Training</h2>\n<p>Run folder {P.esc(run)}.</p>\n"
            + (P.definition_list(summary) if summary else "")
            + f'<img src="{IMG}/curves.png" alt="training curves">\n')
