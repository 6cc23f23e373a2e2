"""results.md (the tables) and the PNG charts, from the results dict alone (so they can be redrawn
from any results.json: ``python -m bench.report bench/results/<run>``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.stats import format_ratio as _x
from bench.stats import format_summary as _mmm

__all__ = ["CHARTS", "goals", "write_charts", "write_markdown"]

CHARTS = ("build.png", "load.png", "step_time.png", "training_curves.png")
PARTS = (("data_wait", "data wait"), ("h2d", "host-to-device"), ("transforms", "transforms"),
         ("fwd_bwd", "forward + backward + step"))


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:,.0f} MB"


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's performance goals as ratios measured in this run: what, target, measured, met."""
    out: list[dict[str, Any]] = []

    def add(what: str, target: float, value: float | None) -> None:
        out.append({"goal": what, "target": target, "measured": value,
                    "met": None if value is None else bool(value >= target)})

    steady = res.get("build", {}).get("steady_state")
    if steady is not None:  # what a user waits for at ImageNet's count: whole processes, start-up left out
        add(f"build: cachebuild npy / bare decode, same --jobs, steady state ({steady['images']:,} photos: the "
            "difference of two whole-process runs)", 0.75, steady["x_bare_decode"]["median"])
    else:  # results written before the steady-state rows: the timed part
        row = res.get("build", {}).get("contenders", {}).get("cachebuild_npy", {})
        add("build: cachebuild npy / bare decode, same --jobs", 0.75, row.get("x_bare_decode", {}).get("median"))
    raw = res.get("load", {}).get("groups", {}).get("raw", {})
    med = {k: v["img_s"]["median"] for k, v in raw.items()}

    def r(a: str, c: str) -> float | None:
        return round(med[a] / med[c], 3) if a in med and c in med and med[c] else None

    add("load: plain DataLoader (no collate_fn) / DataLoader + collate_batch", 0.8,
        r("cachebuild_npy_dataloader_plain", "cachebuild_npy_dataloader"))
    add("load: DataLoader + collate_batch / ImageFolder + PIL", 40.0, r("cachebuild_npy_dataloader", "imagefolder_pil"))
    add("load: DataLoader + collate_batch / FFCV raw Loader", 1.0, r("cachebuild_npy_dataloader", "ffcv_raw"))
    # A floor, not a ceiling: the DataLoader's workers each gather into shared memory, so it stays near the copy
    # limit; its ratio moves with the machine's memory traffic from run to run (docs/performance.md).
    add("load: DataLoader + collate_batch / bare memmap gather (1 thread)", 0.6,
        r("cachebuild_npy_dataloader", "limit_bare_gather"))
    if "limit_bare_gather_glibc_default" in med:
        add("load: the same, both in a process without GLIBC_TUNABLES (glibc's default copy threshold)", 0.6,
            r("cachebuild_npy_dataloader_glibc_default", "limit_bare_gather_glibc_default"))
    return out


def _flat(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested JSON as (dotted key, value) rows; lists of objects are numbered."""
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        d = {str(i): x for i, x in enumerate(d)}
    if not isinstance(d, dict):
        return [(prefix.rstrip("."), d)]
    rows: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict) or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            rows += _flat(v, f"{prefix}{k}.")
        else:
            rows.append((f"{prefix}{k}", v))
    return rows


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"  # dB keep a decimal
    if isinstance(v, list):
        return ", ".join(_value(x) for x in v[:8]) + (" ..." if len(v) > 8 else "")
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _extra_sections(res: dict[str, Any]) -> list[str]:
    """The script sections (bench/sections/extras.py): each figure its script wrote, as it named it."""
    from bench.sections.extras import EXTRA_SECTIONS

    lines: list[str] = []
    for section in EXTRA_SECTIONS:
        ex = res.get(section)
        if not ex:
            continue
        lines += [f"## {ex['title']}", "", f"`{ex['command']}` ({ex['seconds']:.0f} s; the script's docstring says "
                  "how each figure is measured)", ""]
        if "failed" in ex:
            lines += [f"Not measured: {ex['failed']}", ""]
            continue
        lines += ["| figure | value |", "|---|---:|"]
        lines += [f"| {k} | {_value(v)} |" for k, v in _flat(ex["figures"])]
        lines.append("")
    return lines


def write_markdown(res: dict[str, Any], folder: Path) -> Path:
    lines = [*_head(res), *_goal_table(res), *_build_table(res), *_load_tables(res), *_transform_tables(res),
             *_train_tables(res), *_gpu_lines(res), *_extra_sections(res), *_remote_table(res), *_peer_tables(res)]
    path = folder / "results.md"
    path.write_text("\n".join(lines))
    return path


def _head(res: dict[str, Any]) -> list[str]:
    m, run = res["machine"], res["run"]
    gpu = m["gpu"]["name"] if m.get("gpu") else "none"
    v = m["versions"]
    return [
        f"# Benchmark results: {run['started'][:10]} on {m['host']}",
        "",
        f"`{run['command']}` (profile **{run['profile']}**, {run['seconds']:.0f} s). Machine: {m['cpu']}, "
        f"{m['cores_usable']} usable cores, {m['ram_gb']} GiB RAM, GPU: {gpu}; {m['os']}; Python {m['python']}, "
        f"torch {v['torch']}, torchvision {v['torchvision']}, OpenCV {v['opencv']}, zarr {v['zarr']}, "
        f"numpy {v['numpy']}. Load average at start: {m['load_average_at_start']}.",
        "",
        "How these were measured:",
        *[f"- {note}" for note in run["notes"]],
        "",
    ]


def _goal_table(res: dict[str, Any]) -> list[str]:
    lines = ["## Goals", "", "| goal | target | measured | met |", "|---|---:|---:|---|"]
    for g in res.get("goals", []):
        met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
        lines.append(f"| {g['goal']} | {g['target']}x | {_x(g['measured'])} | {met} |")
    lines.append("")
    return lines


def _build_table(res: dict[str, Any]) -> list[str]:
    if "build" not in res:
        return []
    b = res["build"]
    lines = [f"## Build: {b['images']} JPEGs ({b['source_mb']} MB) -> {b['size']}x{b['size']}, {b['rounds']} rounds",
             "", "![build](build.png)", "",
             "| contender | img/s, median (min-max) | x bare decode | MB/s written | on disk "
             "| peak memory, PSS (RSS) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in b["contenders"].values():
        lines.append(f"| {r['label']} | {_mmm(r['img_s'])} | {_x(r.get('x_bare_decode', {}).get('median'))} | "
                     f"{r['mb_s']['median']:,.0f} | {_mb(r['bytes_on_disk'])} | "
                     f"{r['peak_pss_mb']['median']:,.0f} MB "
                     f"({r['peak_rss_mb']['median']:,.0f}) |")
    steady = b.get("steady_state")
    if steady is not None:
        for who, key in (("bare cv2.imdecode (the limit)", "bare_img_s"),
                         ("`cachebuild imagenet`", "cachebuild_img_s")):
            x = _x(steady["x_bare_decode"]["median"]) if key == "cachebuild_img_s" else "-"
            lines.append(f"| {who}, steady state: {steady['images']:,} photos between the two whole-process runs "
                         f"| {_mmm(steady[key])} | {x} | | | |")
    for k, why in {**b.get("skipped", {}), **b.get("failed", {})}.items():
        lines.append(f"| {k}: not measured ({why}) | | | | | |")
    lines.append("")
    return lines


def _load_tables(res: dict[str, Any]) -> list[str]:
    if "load" not in res:
        return []
    ld = res["load"]
    lines = [f"## Load: shuffled epochs of {ld['images']} samples, batch {ld['batch']}, {ld['workers']} workers",
             "", "![load](load.png)", ""]
    for group, rows in ld["groups"].items():
        lines += [f"### {group}", "",
                  "| contender | img/s, median (min-max) | GB/s | x ImageFolder | x bare gather |",
                  "|---|---:|---:|---:|---:|"]
        for r in rows.values():
            gb = "-" if r.get("gb_s") is None else f"{r['gb_s']:.2f}"
            lines.append(f"| {r['label']} | {_mmm(r['img_s'])} | {gb} | {_x(r['x_imagefolder'])} | "
                         f"{_x(r.get('x_bare_gather'))} |")
        lines.append("")
    for k, why in ld.get("skipped", {}).items():
        lines.append(f"- {k}: not measured ({why})")
    lines.append("")
    return lines


def _transform_tables(res: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for title, tf in (("Device transforms (CPU)", res.get("transforms")),
                      ("Device transforms (CUDA, bf16 output)", res.get("gpu", {}).get("transforms_bf16"))):
        if not tf:
            continue
        lines += [f"## {title}: batch {tf['batch']}, uint8 {tf['input']}px -> {tf['output']}px, "
                  f"{tf['threads']} threads", "", "| contender | img/s, median (min-max) | x v1 scripted |",
                  "|---|---:|---:|"]
        for r in tf["contenders"].values():
            lines.append(f"| {r['label']} | {_mmm(r['img_s'])} | {_x(r['x_v1_scripted'])} |")
        for k, why in tf.get("failed", {}).items():
            lines.append(f"| {k}: failed ({why}) | | |")
        lines.append("")
    return lines


def _train_tables(res: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for title, tr, chart in (("Training (CPU)", res.get("train"), "step_time.png"),
                             ("Training on CUDA", res.get("gpu", {}).get("resnet50"), "step_time_gpu.png")):
        if not tr:
            continue
        lines += [f"## {title}: {tr['model']}, {tr['crop']} px crops, batch {tr['batch']}, {tr['workers']} workers, "
                  f"{tr['images']} images, {tr['epochs']} epochs, amp {tr['amp']}", "", f"![step time]({chart})", "",
                  "| contender | epoch s | img/s | x ImageFolder | data wait "
                  "| ms/step: wait / h2d / transforms / fwd+bwd |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in tr["contenders"].values():
            ms = " / ".join(f"{r['step_ms'][k]:.1f}" for k, _ in PARTS)
            lines.append(f"| {r['label']} | {_mmm(r['epoch_s'], '{:.2f}')} | {_mmm(r['img_s'])} | "
                         f"{_x(r['x_imagefolder'])} | {_mmm(r['data_wait_share'], '{:.1%}')} | {ms} |")
        lines.append("")
    if res.get("train"):
        lines += ["![training curves](training_curves.png)", ""]
    return lines


def _gpu_lines(res: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    gpu_res = res.get("gpu", {})
    if "h2d" in gpu_res:
        h = gpu_res["h2d"]
        lines += [f"Host-to-device, one {h['mb']} MB uint8 batch: pinned {_mmm(h['pinned_gb_s'], '{:.1f}')} GB/s, "
                  f"pageable {_mmm(h['pageable_gb_s'], '{:.1f}')} GB/s.", ""]
    if "skipped" in gpu_res:
        lines += [f"## GPU: not measured ({gpu_res['skipped']})", ""]
    return lines


def _remote_table(res: dict[str, Any]) -> list[str]:
    remote = res.get("load", {}).get("remote")
    if not remote:
        return []
    lines = [f"## Load from URLs (loopback moto S3 and aiohttp HTTP servers): batch {remote['batch']}, "
             f"{remote['workers']} workers, {remote['epochs']} epochs", "",
             "Epoch 1 fetches every byte (cold); the others read the local folder each filled (warm). Workers "
             "persistent for both: the cold epoch includes their start-up.", "",
             "| contender | cold epoch img/s | warm epochs img/s, median (min-max) |", "|---|---:|---:|"]
    for r in remote["rows"].values():
        lines.append(f"| {r['label']} | {r['cold_img_s']:,.0f} | {_mmm(r['warm_img_s'])} |")
    for k, why in remote.get("skipped", {}).items():
        lines.append(f"| {k}: not measured ({why}) | | |")
    lines.append("")
    return lines


def _peer_tables(res: dict[str, Any]) -> list[str]:
    from bench.compare import peer_lines

    lines = ["## Peers side by side", "", "Each peer contender against cachebuild in the same run (for loads, "
             "cachebuild's fastest loader of that table), same files, batch and worker or thread count; build ratios "
             "within each round both ran, then the median.", "",
             *peer_lines(res), ""]
    lines += ["## Peers", "", "| peer | version | status | settings |", "|---|---|---|---|"]
    for name, p in res.get("peers", {}).items():
        lines.append(f"| {name} | {p.get('version') or '-'} | {p['status']} | {p['settings']} |")
    lines.append("")
    return lines


def _bars(ax: Any, labels: list[str], stats: list[dict[str, Any]], color: str) -> None:
    import numpy as np

    y = np.arange(len(labels))
    med = np.array([s["median"] for s in stats])
    err = np.array([[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]])
    ax.barh(y, med, xerr=err, color=color, capsize=3)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    for yi, v, s in zip(y, med, stats, strict=True):  # the figure right of its whisker
        ax.text(s["max"], yi, f"  {v:,.0f}", va="center", fontsize=7)


def _short(label: str, n: int = 60) -> str:
    return label if len(label) <= n else label[: n - 1] + "…"


def write_charts(res: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sub = f"{res['machine']['cpu']}, {res['machine']['cores_usable']} cores; {res['run']['profile']} profile; " \
          "median of runs, whiskers min-max"

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(folder / name)

    if res.get("build", {}).get("contenders"):
        rows = res["build"]["contenders"]
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.4))
        _bars(ax, [_short(r["label"]) for r in rows.values()], [r["img_s"] for r in rows.values()], "#4c72b0")
        ax.set_xlabel("images / s")
        ax.set_title(f"Build: JPEG -> cache ({sub})", fontsize=8)
        save(fig, "build.png")
    if res.get("load", {}).get("groups"):
        groups = res["load"]["groups"]
        fig, axes = plt.subplots(len(groups), 1, figsize=(9, 0.4 * sum(len(g) for g in groups.values()) + 2.5))
        for ax, (group, rows), color in zip(list(axes), groups.items(), ("#55a868", "#c44e52"), strict=False):
            _bars(ax, [_short(r["label"]) for r in rows.values()], [r["img_s"] for r in rows.values()], color)
            ax.set_xscale("log")
            ax.set_xlabel("images / s (log scale)")
            ax.set_title(f"Load, {group}: shuffled epochs, batch {res['load']['batch']}", fontsize=8)
        fig.suptitle(sub, fontsize=7)
        save(fig, "load.png")
    for key, name in (("train", "step_time.png"), ("gpu", "step_time_gpu.png")):
        tr = res.get(key) if key == "train" else res.get("gpu", {}).get("resnet50")
        if not tr or not tr.get("contenders"):
            continue
        rows = tr["contenders"]
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.6))
        left = [0.0] * len(rows)
        labels = [_short(r["label"], 55) for r in rows.values()]
        for (part, title), color in zip(PARTS, ("#c44e52", "#8172b2", "#ccb974", "#4c72b0"), strict=True):
            vals = [r["step_ms"][part] for r in rows.values()]
            ax.barh(labels, vals, left=left, color=color, label=title)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("ms per training step")
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"Where a step's time goes: {tr['model']}, batch {tr['batch']}, {tr['device']}", fontsize=8)
        save(fig, name)
    if res.get("train", {}).get("contenders"):
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in res["train"]["contenders"].values():
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=_short(r["label"], 50), lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=6)
        ax.set_title(f"Training curves: {res['train']['model']}, same init and files per contender", fontsize=8)
        save(fig, "training_curves.png")
    return written


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    results = json.loads((run_dir / "results.json").read_text())
    write_charts(results, run_dir)
    print(write_markdown(results, run_dir))
