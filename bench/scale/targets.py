"""The issue's targets, checked on a run's results: each a (name, measured, limit, passed) row.

The limits are the ones set for the full count (1,281,167) on a 2-core box; a run whose largest N is smaller
checks the same absolute limits at its largest N (looser there), and the growth ones between its N.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_targets", "get_path"]

GB, MB = 1e9, 2**20


def get_path(d: dict[str, Any], *path: str) -> Any:
    """``d[path[0]][path[1]]...``, or None where a step or a field is missing (a failed or skipped step)."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _row(rows: list[dict[str, Any]], name: str, measured: Any, limit: str, passed: bool | None) -> None:
    rows.append({"target": name, "measured": measured, "limit": limit,
                 "passed": bool(passed) if passed is not None else False})


def _rate_row(rows: list[dict[str, Any]], lo: dict[str, Any], hi: dict[str, Any]) -> None:
    r_lo, r_hi = get_path(lo, "build", "img_per_s"), get_path(hi, "build", "img_per_s")
    ratio = r_hi / r_lo if r_lo and r_hi else None
    # beside the wall-clock rates: CPU per image of the build's processes, what other sessions' load barely moves
    c_lo, c_hi = get_path(lo, "build", "cpu_us_per_img"), get_path(hi, "build", "cpu_us_per_img")
    cpu = f"; CPU {c_hi:,.0f} vs {c_lo:,.0f} us/img" if c_lo and c_hi else ""
    _row(rows, f"build img/s at N={hi['n']:,} >= 0.9x at N={lo['n']:,}",
         None if ratio is None else f"{ratio:.2f}x ({r_hi:,.0f} vs {r_lo:,.0f} img/s{cpu})", ">= 0.90x",
         ratio is not None and ratio >= 0.9)


def _curve_targets(rows: list[dict[str, Any]], curves: list[dict[str, Any]]) -> None:
    lo, hi = curves[0], curves[-1]
    n = f"N={hi['n']:,}"
    _rate_row(rows, lo, hi)
    if len(curves) > 2:  # the smallest build is mostly its worker pool's start-up: the middle N as well
        _rate_row(rows, curves[-2], hi)
    for step in ("plan", "status"):
        t = get_path(hi, step, "seconds")
        _row(rows, f"{step} at {n} <= 60 s", None if t is None else f"{t:.1f} s", "<= 60 s", t is not None and t <= 60)
    rss = get_path(hi, "build", "rss_self_peak")
    _row(rows, f"build's parent RSS at {n} <= 1.5 GB", None if rss is None else f"{rss / MB:,.0f} MB", "<= 1.5 GB",
         rss is not None and rss <= 1.5 * GB)
    # torch's import alone is ~700 MB RSS here (286 MB of it anonymous): the limits are on what the reader and
    # each worker add to a process that has imported torch and loaders, as the plain dataset's workers have.
    reader = get_path(hi, "open", "rss_added")
    _row(rows, f"reader RSS added by open (before any pixel) at {n} <= 300 MB",
         None if reader is None else
         f"{reader / MB:,.0f} MB (process {(get_path(hi, 'open', 'rss_open') or 0) / MB:,.0f} MB)",
         "<= 300 MB", reader is not None and reader <= 300 * MB)
    for ctx in ("spawn", "fork"):
        w, p = (get_path(hi, f"first_batch_{ctx}", k, "worker_anon_max") for k in ("cache", "plain"))
        extra = None if w is None or p is None else (w - p) / MB
        _row(rows, f"each {ctx} DataLoader worker's own memory (RssAnon) over a plain dataset's worker "
                   f"at {n} <= 300 MB",
             None if extra is None else f"{extra:+,.0f} MB ({w / MB:,.0f} vs {p / MB:,.0f} MB)", "<= 300 MB",
             extra is not None and extra <= 300)
        # Growth is taken over the plain dataset's worker at each N: a forked worker's RssAnon also counts the
        # parent's heap, which grows with N by the DataLoader's own shuffle (RandomSampler's list of N ints,
        # ~40 bytes each, kept by the allocator across rounds): the same in both, not a copy of ours.
        w_lo, p_lo = (get_path(lo, f"first_batch_{ctx}", k, "worker_anon_max") for k in ("cache", "plain"))
        grow = None if None in (w, p, w_lo, p_lo) else ((w - p) - (w_lo - p_lo)) / MB
        plain_grow = 0.0 if p is None or p_lo is None else (p - p_lo) / MB
        _row(rows, f"{ctx} worker RssAnon over a plain dataset's worker, growth N={lo['n']:,} -> {n} "
                   "(nothing proportional to N in a worker)",
             None if grow is None else f"{grow:+,.0f} MB (plain worker itself {plain_grow:+,.0f} MB)",
             "<= 32 MB", grow is not None and grow <= 32)
    t = get_path(hi, "open", "seconds")
    _row(rows, f"CachedImageDataset open at {n} <= 1 s", None if t is None else f"{t:.2f} s", "<= 1 s",
         t is not None and t <= 1)
    d = get_path(hi, "first_batch_spawn", "over_plain")
    _row(rows, f"spawn first batch at {n} within 2 s of a plain dataset's", None if d is None else f"{d:+.2f} s",
         "<= 2 s", d is not None and d <= 2)
    errors = [f"{k} (N={res['n']:,})" for res in (lo, hi) for k, v in res.items()
              if isinstance(v, dict) and "error" in v]
    _row(rows, "every step ran and checked out", ", ".join(errors) or "all", "no errors", not errors)


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    curves = results.get("curves", [])
    if curves:
        _curve_targets(rows, curves)
    kill = results.get("kill")
    if kill:
        redone = kill.get("blocks_redone")
        _row(rows, "killed at ~70% and resumed: blocks redone <= one per worker",
             None if redone is None else f"{redone} (killed with {kill.get('blocks_recorded_at_kill')} of "
             f"{kill.get('blocks_total')} recorded)", f"<= {results['config']['jobs']}",
             redone is not None and redone <= results["config"]["jobs"] and "error" not in kill)
        _row(rows, "resumed build's checksums equal the uninterrupted build's", kill.get("checksums_equal"), "equal",
             kill.get("checksums_equal"))
        _row(rows, "status after the resume", kill.get("status_after"), "up to date",
             kill.get("status_after") == "up to date")
    val = results.get("val")
    if val:
        _row(rows, "flat val (devkit ground truth): same classes, same order as train",
             f"{val.get('count')} images, {val.get('classes')} classes, same order: {val.get('same_classes')}",
             "50,000 and the same classes", val.get("same_classes") and "error" not in val)
    dask = results.get("dask")
    if dask and curves:
        joblib_rate = dask.get("joblib_img_per_s") or get_path(curves[-1], "build", "img_per_s")
        ratio = dask["img_per_s"] / joblib_rate if dask.get("img_per_s") and joblib_rate else None
        _row(rows, "Dask LocalCluster build: same checksums", dask.get("checksums_equal"), "equal",
             dask.get("checksums_equal") and "error" not in dask)
        _row(rows, "Dask build img/s >= 0.8x joblib's (the joblib builds before and after it)",
             None if ratio is None else f"{ratio:.2f}x", ">= 0.80x",
             ratio is not None and ratio >= 0.8)
    update = results.get("update")
    if update:
        ratio = update.get("ratio")
        _row(rows, "--update of 10 touched files <= 5% of the full build's time",
             None if ratio is None else f"{100 * ratio:.1f}% ({update['seconds']:.1f} s; {update.get('decoded')} "
             f"decoded, {update.get('reused'):,} reused)", "<= 5%",
             ratio is not None and ratio <= 0.05 and "error" not in update)
    return rows
