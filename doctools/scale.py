"""The ``scale`` generated block (docs/performance.md, "ImageNet at full count"): each step's time and memory
at the smallest and the largest N of a ``make bench-scale`` run, its whole-count checks and its targets, from
``scale.json``."""

from __future__ import annotations

from typing import Any

from doctools.summary import machine_line

__all__ = ["scale_section"]

MB = 2**20
# (step key, what the row says, how its figure is written)
_ROWS = (
    ("plan", "plan: list, label, stat every file, digest", "s"),
    ("build", "build `cachebuild imagenet --split train`", "rate"),
    ("status", "`status`, unchanged tree", "s"),
    ("status_touched", "`status` after touching 10 files", "s"),
    ("verify", "`verify` (every checksum)", "s"),
    ("verify_quick", "`verify --quick`", "s"),
    ("info", "`info`", "s"),
    ("ls", "`ls` of the output folder", "s"),
    ("open", "`CachedImageDataset(...)` open", "s"),
    ("first_batch_spawn", "first batch, `DataLoader(num_workers=2)`, spawn", "batch"),
    ("first_batch_fork", "first batch, `DataLoader(num_workers=2)`, fork", "batch"),
    ("epoch", "one shuffled epoch, 2 fork workers", "rate"),
    ("sampler", "`CacheSampler` set_epoch + iteration, 8 ranks", "s"),
    ("pull", "`pull` from a loopback HTTP server", "mb"),
)


def _cell(step: dict[str, Any] | None, how: str) -> str:
    if not step or "seconds" not in step:
        return "failed" if step else "-"
    t = f"{step['seconds']:.2f} s"
    if how == "rate" and step.get("img_per_s"):
        t += f", {step['img_per_s']:,.0f} img/s"
    elif how == "mb" and step.get("mb_per_s"):
        t += f", {step['mb_per_s']:,.0f} MB/s"
    elif how == "batch" and "plain" in step:
        t += f" (plain dataset {step['plain']['seconds']:.2f} s)"
    return f"{t}; {step['rss_self_peak'] / MB:,.0f} MB"


def scale_section(res: dict[str, Any], where: str) -> str:
    curves = res["curves"]
    lo, hi = curves[0], curves[-1]
    cfg = res["config"]
    lines = [f"From [`{where}/`]({where}/scale.md) (`make bench-scale`: `--size {cfg['size']} --jobs {cfg['jobs']}`, "
             f"{res['run'][:10]}; {machine_line(res['machine'])}; load average {res['load_before'].split()[0]} "
             "at the start). "
             "The generated tree has ImageNet's shape (1,000 class folders, 1,281,167 train files, 50,000 flat val "
             "with the devkit) made of 40-80 px photo crops, so decoding is cheap and the per-file costs show; "
             "every step runs in its own process. Each cell: the step's time, then the peak RSS of its process "
             "(a build's parent; the reader).", "",
             f"| step | N = {lo['n']:,} | N = {hi['n']:,} |", "|---|---:|---:|"]
    for key, what, how in _ROWS:
        lines.append(f"| {what} | {_cell(lo.get(key), how)} | {_cell(hi.get(key), how)} |")
    checks = []
    op = hi.get("open") or {}
    spawn = hi.get("first_batch_spawn") or {}
    if "rss_added" in op and "cache" in spawn:
        w, p = spawn["cache"]["worker_anon_max"], spawn["plain"]["worker_anon_max"]
        checks.append(f"memory at N = {hi['n']:,}: opening the dataset adds {op['rss_added'] / MB:,.0f} MB to the "
                      f"reader (torch's import is most of its RSS); a spawn worker's own heap (RssAnon) "
                      f"{w / MB:,.0f} MB, against {p / MB:,.0f} MB for a plain in-memory dataset's worker")
    tr = res.get("tree_read")
    if tr:
        checks.append(f"the tree's cold read, once before the builds (so each build starts from the same page "
                      f"cache): {tr['files']:,} files in {tr['seconds']:.0f} s")
    kill = res.get("kill") or {}
    if "blocks_total" in kill:
        checks.append(f"the full build SIGKILLed with {kill['blocks_recorded_at_kill']} of {kill['blocks_total']} "
                      f"blocks recorded, then rerun ({kill['seconds']:.0f} s, planning "
                      f"included): {kill['blocks_redone']} redone, checksums equal to the "
                      f"uninterrupted build: {kill.get('checksums_equal')}, `status` after: {kill.get('status_after')}")
    val = res.get("val") or {}
    if "count" in val:
        checks.append(f"the flat val: {val['count']:,} images in {val['seconds']:.1f} s, the same "
                      f"{val['classes']:,} classes in the same order: {val.get('same_classes')}")
    dask = res.get("dask") or {}
    if dask.get("img_per_s"):
        beside = dask.get("joblib_img_per_s")
        checks.append(f"the same build on a 2-worker Dask `LocalCluster`: {dask['img_per_s']:,.0f} img/s"
                      + (f" against {beside:,.0f} img/s for the joblib builds just before and after it" if beside
                         else "") + f", checksums equal: {dask.get('checksums_equal')}")
    lines += ["", *(f"- {c}" for c in checks)]
    targets = res.get("targets", [])
    failed = [t for t in targets if not t["passed"]]
    lines += ["", f"Targets (`bench/scale/targets.py`): {len(targets) - len(failed)} of {len(targets)} met"
              + ("." if not failed else ": not met: " + "; ".join(f"{t['target']} ({t['measured']})"
                                                                 for t in failed) + ".")]
    return "\n".join(lines)
