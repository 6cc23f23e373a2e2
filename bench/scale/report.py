"""scale.md (the curves as tables, the checks, the targets) and scale.png (each step's time against N on
log-log axes, with the linear reference through the smallest N)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.scale.curves import STEP_NAMES
from bench.scale.targets import get_path

__all__ = ["write_md", "write_png"]

MB = 2**20
_WHAT = {
    "plan": "plan (list, label, stat every file, digest)",
    "build": "build (`cachebuild imagenet --split train`)",
    "info": "`info`", "verify_quick": "`verify --quick`", "verify": "`verify`",
    "status": "`status` (unchanged tree)", "status_touched": "`status` after touching 10 files",
    "ls": "`ls` of the output folder", "open": "`CachedImageDataset(...)` open",
    "first_batch_spawn": "first batch, DataLoader(num_workers=2, spawn)",
    "first_batch_fork": "first batch, DataLoader(num_workers=2, fork)",
    "epoch": "one shuffled epoch (fork, 2 workers)", "sampler": "CacheSampler set_epoch + iteration, 8 ranks",
    "pull": "`pull` from the loopback HTTP server",
}


def _cell(step: dict[str, Any] | None) -> str:
    if not step or "seconds" not in step:
        return "failed" if step else "-"
    s = f"{step['seconds']:.2f} s" if step["seconds"] < 100 else f"{step['seconds']:,.0f} s"
    extra = ""
    if "img_per_s" in step:
        extra = f", {step['img_per_s']:,.0f} img/s"
        if "cpu_us_per_img" in step:
            extra += f" ({step['cpu_us_per_img']:,.0f} us CPU/img)"
    elif "mb_per_s" in step:
        extra = f", {step['mb_per_s']:,.0f} MB/s"
    elif "over_plain" in step:
        extra = f" (plain {step['plain']['seconds']:.2f} s)"
    err = " **error**" if "error" in step else ""
    return f"{s}{extra}; {step['rss_self_peak'] / MB:,.0f} / {step['tree_pss_peak'] / MB:,.0f} MB{err}"


def _growth(lo: dict[str, Any], hi: dict[str, Any], name: str) -> str:
    """(t at ``hi``'s N / t at ``lo``'s) / (N ratio): 1 is linear, below 1 is sub-linear."""
    a, b = lo.get(name, {}), hi.get(name, {})
    if "seconds" not in a or "seconds" not in b or a["seconds"] <= 0:
        return "-"
    return f"{(b['seconds'] / a['seconds']) / (hi['n'] / lo['n']):.2f}"


def write_md(path: Path, res: dict[str, Any], targets: list[dict[str, Any]]) -> None:
    curves = res["curves"]
    m, cfg = res["machine"], res["config"]
    ns = ", ".join(f"{c['n']:,}" for c in curves)
    lines = [f"# Scale: the ImageNet shape, N = {ns}", "",
             f"Run {res['run']} at commit `{res['git_commit']}`; {m.get('cpu')}, {m.get('cores_usable')} cores, "
             f"load average {res['load_before']} before and {res['load_after']} after (other sessions share the box). "
             f"`--size {cfg['size']} --jobs {cfg['jobs']}`; source: the generated ILSVRC2012-layout tree "
             f"(`bench/scale/tree.py`: 1,000 class folders, 40-80 px real-photo crops; the subsets are the first "
             f"files of every class folder). Each step is its own process.", "",
             "Each cell: the step's time (after its imports), then the peak RSS of the process itself (the parent "
             "of a build's workers; the reader) / the peak PSS of its whole process tree. *growth*: (time at the "
             "largest N / time at the smallest) / (N ratio); 1 = linear, below 1 sub-linear (fixed costs: "
             "start-up, imports of workers); the last column the same between the two largest N.", "",
             "| step | " + " | ".join(f"N = {c['n']:,}" for c in curves) + " | growth | growth, last two |",
             "|---|" + "---|" * (len(curves) + 2)]
    for name in STEP_NAMES:
        last_two = _growth(curves[-2], curves[-1], name) if len(curves) > 2 else "-"
        lines.append(f"| {_WHAT[name]} | " + " | ".join(_cell(c.get(name)) for c in curves)
                     + f" | {_growth(curves[0], curves[-1], name) if len(curves) > 1 else '-'} | {last_two} |")
    lines += ["", "Memory of the reader and its workers (RSS, and RssAnon: a process's own heap, where a copied "
              "side table would show; torch's import alone is ~700 MB RSS, ~290 MB of it anonymous). The reader "
              "before any pixel, each worker after the first batch (its RSS also counts the cache pages it "
              "touched: page cache, shared):", "", "| | " + " | ".join(f"N = {c['n']:,}" for c in curves) + " |",
              "|---|" + "---|" * len(curves)]
    for label, key in (("reader after open, RSS", ("open", "rss_open")),
                       ("reader, RSS added by open", ("open", "rss_added")),
                       ("spawn worker, cache, RSS", ("first_batch_spawn", "cache", "worker_rss_max")),
                       ("spawn worker, cache, RssAnon", ("first_batch_spawn", "cache", "worker_anon_max")),
                       ("spawn worker, plain dataset, RssAnon", ("first_batch_spawn", "plain", "worker_anon_max")),
                       ("fork worker, cache, RSS", ("first_batch_fork", "cache", "worker_rss_max")),
                       ("fork worker, cache, RssAnon", ("first_batch_fork", "cache", "worker_anon_max")),
                       ("fork worker, plain dataset, RssAnon", ("first_batch_fork", "plain", "worker_anon_max"))):
        vals = []
        for c in curves:
            v = get_path(c, *key)
            vals.append(f"{v / MB:,.0f} MB" if isinstance(v, (int, float)) else "-")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    lines += ["", "## Whole-count checks", ""]
    if res.get("tree_read"):
        t = res["tree_read"]
        lines.append(f"- **tree read once before the builds** (so every build, joblib, resumed and Dask, starts "
                     f"from a warm page cache; this is the cold read): {t['files']:,} files, "
                     f"{t['bytes'] / MB:,.0f} MB in {t['seconds']:.1f} s ({t['files'] / t['seconds']:,.0f} files/s)")
    for check in ("kill", "val", "dask"):
        if res.get(check):
            shown = {k: v for k, v in res[check].items() if k not in ("output", "workers")}
            lines.append(f"- **{check}**: " + ", ".join(f"{k}={_short(v)}" for k, v in shown.items()))
    lines += ["", "## Targets", "", "| target | measured | limit | |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['limit']} | {'PASS' if t['passed'] else '**FAIL**'} |"
              for t in targets]
    lines += ["", "Figures: `scale.png`. Regenerate: `make bench-scale` (or `python -m bench.scale --n ...`)."]
    path.write_text("\n".join(lines) + "\n")


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    if isinstance(v, int) and v > 10 * MB:
        return f"{v / MB:,.0f} MB"
    return str(v)[:200]


def write_png(path: Path, res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = res["curves"]
    cols = 4
    rows = math.ceil((len(STEP_NAMES) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows))
    flat = list(axes.flat)
    for ax, name in zip(flat, STEP_NAMES, strict=False):
        pts = [(c["n"], c[name]["seconds"]) for c in curves if "seconds" in c.get(name, {})]
        if pts:
            ns, ts = zip(*pts, strict=True)
            ax.loglog(ns, ts, "o-", label="measured")
            ax.loglog(ns, [ts[0] * n / ns[0] for n in ns], "--", color="grey", label="linear from smallest N")
        ax.set_title(_WHAT[name].replace("`", ""), fontsize=8)
        ax.set_xlabel("N (files)", fontsize=7)
        ax.set_ylabel("seconds", fontsize=7)
        ax.tick_params(labelsize=7)
    ax = flat[len(STEP_NAMES)]
    for label, key in (("build parent RSS", ("build", "rss_self_peak")), ("build tree PSS", ("build", "tree_pss_peak")),
                       ("reader RSS", ("open", "rss_open")),
                       ("spawn worker RssAnon", ("first_batch_spawn", "cache", "worker_anon_max"))):
        pts = []
        for c in curves:
            v = get_path(c, *key)
            if isinstance(v, (int, float)):
                pts.append((c["n"], v / MB))
        if pts:
            ax.loglog(*zip(*pts, strict=True), "o-", label=label)
    ax.set_title("memory (MB)", fontsize=8)
    ax.legend(fontsize=6)
    flat[0].legend(fontsize=6)
    for ax in flat[len(STEP_NAMES) + 1:]:
        ax.axis("off")
    fig.suptitle(f"cachebuild at the ImageNet shape ({res['run']}, {res['git_commit'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
