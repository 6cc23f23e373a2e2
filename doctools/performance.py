"""The benchmark's sections of docs/performance.md (performance, "ImageNet on paper", peers), each written from
one results folder's ``results.json``, so that the page holds nothing the folder does not. ``python -m
doctools.blocks`` rewrites every generated block of the docs from the folder its marker names; this module's
command writes chosen blocks from a folder given by hand:

    python -m doctools.performance bench/results/<run> docs/performance.md --blocks performance,imagenet

Each section sits between ``<!-- bench:NAME:begin [SOURCE] -->`` and ``<!-- bench:NAME:end -->`` markers and
is replaced whole. Arithmetic on measured figures is shown with its inputs; estimates say so.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from bench.stats import format_ratio as _x
from bench.stats import format_summary as _mmm
from doctools.summary import machine_line

__all__ = ["BLOCKS", "IMAGENET_TRAIN", "imagenet_section", "peers_section", "performance_section",
           "update_readme"]

IMAGENET_TRAIN = 1_281_167  # ILSVRC2012 training images
IMAGENET_VAL = 50_000
IMAGENET_MEAN_HW = (387, 469)  # the commonly quoted mean resolution of ILSVRC2012 (height, width)
IMAGENET_MEAN_KB = 108.0  # ~138 GB of training JPEGs / 1,281,167 files
SIZES = (64, 96, 128, 160, 224, 256)
RAM_GB = (64, 128, 256, 512)


def _rel(folder: Path, readme: Path) -> str:
    return os.path.relpath(folder.resolve(), readme.resolve().parent)


def _cores(lo: float, hi: float) -> str:
    """Whole cores for a range of core-hours: "3-7 cores", or "1 core" when both ends round up alike."""
    a, b = math.ceil(lo), math.ceil(hi)
    return f"{a} core" + ("" if a == 1 else "s") if a == b else f"{a}-{b} cores"


def _context(res: dict[str, Any], where: str) -> str:
    m, run = res["machine"], res["run"]
    v = m["versions"]
    load = m["load_average_at_start"][0]
    cache_mb = res["config"]["n"] * res["config"]["size"] ** 2 * 3 / 1e6
    if run["profile"] != "full":
        prov = (f" This is a `{run['profile']}` run (small set, short epochs; each cache is {cache_mb:,.0f} MB, small "
                "enough for a CPU's last-level cache, so ratios to the bare gather are pessimistic for the loaders): "
                "provisional, to be replaced by a full `make bench` on a quiet machine.")
    elif load > 1:
        prov = (" Other work ran on the machine meanwhile: provisional figures, to be replaced by a run on a quiet "
                "machine.")
    else:
        prov = ""
    return (f"Figures from [`{where}/`]({where}/results.md) (`{run['command']}`, {run['started'][:10]}): "
            f"{machine_line(m)}, OpenCV {v['opencv']}, zarr {v['zarr']}; load average at the start "
            f"{load} ({'other work ran in this VM' if load > 1 else 'nothing else ran in this VM'}; a VM does not "
            "see its host's load, so compare ratios within a run, not digits across runs)."
            + (f" Run with `GLIBC_TUNABLES={m['glibc_tunables']}` (see "
               "[Memory copies on virtual machines](#memory-copies-on-virtual-machines)); the rows marked \"glibc's "
               "default\" in `results.md` were measured without it." if m.get("glibc_tunables") else "")
            + f"{prov} Every figure is a median with its min-max; warm-ups left out; page cache warm. `results.md` "
            "there holds every table and how each was measured.")


def performance_section(res: dict[str, Any], where: str) -> str:
    lines = [_context(res, where), "", "| goal (ratio in one run) | target | measured | met |", "|---|---:|---:|---|"]
    for g in res.get("goals", []):
        met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
        lines.append(f"| {g['goal']} | {g['target']}x | {_x(g['measured'])} | {met} |")
    b = res.get("build")
    if b:
        h, w = b["source_mean_hw"]
        lines += ["", f"**Build**: {b['images']} real-photo JPEGs (mean {w}x{h}, "
                  f"{b['source_mean_kb']} kB) -> {b['size']} px, {b['jobs']} build processes, {b['rounds']} rounds.",
                  "", f"![build]({where}/build.png)", "",
                  "| contender | img/s | x bare decode | on disk | peak memory (PSS) |", "|---|---:|---:|---:|---:|"]
        for r in b["contenders"].values():
            disk = "-" if r["bytes_on_disk"] is None else f"{r['bytes_on_disk'] / 1e6:,.0f} MB"
            lines.append(f"| {r['label']} | {_mmm(r['img_s'])} | {_x(r.get('x_bare_decode', {}).get('median'))} | "
                         f"{disk} | {r['peak_pss_mb']['median']:,.0f} MB |")
    ld = res.get("load")
    if ld:
        lines += ["", f"**Load**: shuffled epochs of {ld['images']} samples, batch {ld['batch']}, {ld['workers']} "
                  "workers; raw uint8 batches, and with the standard augmentation.", "",
                  f"![load]({where}/load.png)", "",
                  "| contender | raw img/s | x ImageFolder | x bare gather | augmented img/s | x ImageFolder |",
                  "|---|---:|---:|---:|---:|---:|"]
        raw, aug = ld["groups"].get("raw", {}), ld["groups"].get("augmented", {})
        for key, r in raw.items():
            a = aug.get(key)
            lines.append(f"| {r['label']} | {_mmm(r['img_s'])} | {_x(r['x_imagefolder'])} | "
                         f"{_x(r.get('x_bare_gather'))} | {_mmm(a['img_s']) if a else '-'} | "
                         f"{_x(a['x_imagefolder']) if a else '-'} |")
    tr = res.get("train")
    if tr:
        lines += ["", f"**Training** ({tr['model']}, {tr['crop']} px, batch {tr['batch']}, {tr['device']}): where a "
                  "step's time goes.", "", f"![step time]({where}/step_time.png)", "",
                  "| contender | epoch s | x ImageFolder | data wait |", "|---|---:|---:|---:|"]
        for r in tr["contenders"].values():
            lines.append(f"| {r['label']} | {_mmm(r['epoch_s'], '{:.2f}')} | {_x(r['x_imagefolder'])} | "
                         f"{_mmm(r['data_wait_share'], '{:.1%}')} |")
    gpu = res.get("gpu", {})
    lines += ["", f"GPU: {'not measured: ' + gpu['skipped'] if 'skipped' in gpu else 'see results.md'}. "
              "Peers: " + "; ".join(f"{k} {p['status']}" for k, p in res.get("peers", {}).items()) +
              " (their settings are in results.md)."]
    return "\n".join(lines)


def imagenet_section(res: dict[str, Any], where: str) -> str:
    b = res["build"]
    s = b["size"]
    lines = [f"Arithmetic for ILSVRC2012 ({IMAGENET_TRAIN:,} training images; val adds {IMAGENET_VAL:,}, 3.9%), "
             f"with the measured inputs from [`{where}/`]({where}/results.md). **Exact**: sizes of raw caches "
             "(S x S x 3 bytes a sample). **Estimate**: anything scaled from the sample photos to ImageNet's.", "",
             "| --size | bytes a sample | raw cache (npy, or zarr uncompressed) | fits the page cache of |",
             "|---:|---:|---:|---|"]
    for size in SIZES:
        per = size * size * 3
        total = per * IMAGENET_TRAIN
        fits = [f"{r} GB" for r in RAM_GB if total <= 0.8 * r * 1e9]
        lines.append(f"| {size} | {per:,} | {total / 1e9:,.1f} GB | "
                     f"{', '.join(fits) + ' nodes' if fits else f'none up to {RAM_GB[-1]} GB'} |")
    lines += ["", "(\"Fits\": the cache is at most 80% of the node's RAM, leaving the rest to the processes: a rule of "
              "thumb, not a measurement.)", "",
              f"Storage kinds at {s} px, bytes on disk per image **measured** on the {b['images']} sample photos, "
              "scaled to ImageNet (**estimate**: compressed and JPEG sizes depend on the photos):", "",
              "| storage | bytes on disk per image (measured) | ImageNet train (estimate) |", "|---|---:|---:|"]
    for r in b["contenders"].values():
        if r["bytes_on_disk"]:
            per = r["bytes_on_disk"] / r["images"]
            lines.append(f"| {r['label']} | {per:,.0f} | {per * IMAGENET_TRAIN / 1e9:,.1f} GB |")
    lines.append(f"| the source JPEGs themselves | {b['source_mean_kb'] * 1e3:,.0f} | (ImageNet's own: ~138 GB) |")
    ours = b["contenders"].get("cachebuild_npy")
    if ours:
        rate = ours["img_s"]["median"] / b["jobs"]
        h, w = b["source_mean_hw"]
        by_pixels = IMAGENET_MEAN_HW[0] * IMAGENET_MEAN_HW[1] / (h * w)
        by_bytes = IMAGENET_MEAN_KB / b["source_mean_kb"]
        lo, hi = sorted((by_pixels, by_bytes))
        core_lo, core_hi = (IMAGENET_TRAIN * f / rate / 3600 for f in (lo, hi))
        write_mb_s = s * s * 3 * IMAGENET_TRAIN / 3600 / 1e6
        lines += ["", " ".join([
            f"Build time: cachebuild measured {ours['img_s']['median']:,.0f} img/s on {b['jobs']} processes,",
            f"**{rate:,.0f} img/s per process** (one core each) on the sample photos ({w}x{h} px,",
            f"{b['source_mean_kb']} kB mean). ImageNet's mean image is ~{IMAGENET_MEAN_HW[1]}x{IMAGENET_MEAN_HW[0]}",
            f"px and ~{IMAGENET_MEAN_KB:.0f} kB: {by_pixels:.2f}x the pixels and {by_bytes:.2f}x the bytes. Decoding",
            "dominates and its cost grows with both, so scaling by each gives the range: **estimate",
            f"{core_lo:,.1f}-{core_hi:,.1f} core-hours** for the training set at {s} px",
            f"({IMAGENET_TRAIN:,} x {lo:.2f}..{hi:.2f} / {rate:,.0f} / 3600), and",
            f"**{_cores(core_lo, core_hi)} for a one-hour build** on a Dask cluster",
            "(`--dask-scheduler`; estimate: assumes linear scaling",
            f"and storage that keeps up: writing the cache in an hour is {write_mb_s:,.0f} MB/s, reading",
            "ImageNet's ~138 GB of JPEGs ~38 MB/s)."])]
    per_gpu = None
    gpu = res.get("gpu", {}).get("resnet50", {}).get("contenders", {}).get("cachebuild_dataloader")
    if gpu:
        per_gpu = gpu["img_s"]["median"]
        src = f"measured: resnet50 bf16 batch 256 fed by the cache on {res['gpu']['device']}"
    rates = [per_gpu] if per_gpu else [1000, 3000]
    if not per_gpu:
        src = "img/s per GPU **assumed** (no GPU figure in this run): 1,000 and 3,000"
    lines += ["", "Read bandwidth a node needs (G GPUs x img/s per GPU x bytes a sample, raw cache at "
              f"{s} px; {src}):",
              "", "| img/s per GPU | 1 GPU | 4 GPUs | 8 GPUs |", "|---:|---:|---:|---:|"]
    for r in rates:
        lines.append(f"| {r:,.0f} | " + " | ".join(f"{g * r * s * s * 3 / 1e9:,.2f} GB/s" for g in (1, 4, 8)) + " |")
    raw = res.get("load", {}).get("groups", {}).get("raw", {})
    dl = raw.get("cachebuild_npy_dataloader")
    if dl and dl.get("gb_s"):
        lines += ["", f"For scale: the DataLoader path moved **{dl['gb_s']:.2f} GB/s** from the page cache on this "
                  f"machine's {res['load']['workers']} workers (measured); from a disk or network it is bounded by its "
                  "read bandwidth instead, which is when the cache should fit the page cache or be compact."]
    return "\n".join(lines)


def peers_section(res: dict[str, Any], where: str) -> str:
    """The peers side by side: each peer's version and settings, and every ratio cachebuild / peer of the run."""
    from bench.compare import peer_lines

    lines = [_context(res, where), "", "| peer | version | status | settings |", "|---|---|---|---|"]
    for name, p in res.get("peers", {}).items():
        status = re.sub(r" at /\S+", "", p["status"])  # no local paths in the README
        lines.append(f"| {name} | {p.get('version') or '-'} | {status} | {p['settings']} |")
    lines += ["", "Each peer contender against cachebuild in this run (for loads, cachebuild's fastest loader of "
              "that table; same files, batch, and worker or thread count; build ratios within each round both ran, "
              "then the median):", "", *peer_lines(res)]
    return "\n".join(lines)


BLOCKS = {"performance": performance_section, "imagenet": imagenet_section, "peers": peers_section}


def _between_markers(pattern: re.Pattern[str], body: str, text: str) -> str:
    """``text`` with what ``pattern``'s two marker groups enclose replaced by ``body``."""
    return pattern.sub(lambda m: f"{m.group(1)}{body}\n{m.group(2)}", text)


def update_readme(run_dir: Path, readme: Path, blocks: tuple[str, ...] = ("performance", "imagenet")) -> None:
    res = json.loads((run_dir / "results.json").read_text())
    where = _rel(run_dir, readme)
    text = readme.read_text()
    for name in blocks:
        body = BLOCKS[name](res, where)
        pattern = re.compile(rf"(<!-- bench:{name}:begin[^>]*-->\n).*?(<!-- bench:{name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{readme} has no <!-- bench:{name}:begin --> ... end markers")
        text = _between_markers(pattern, body, text)
    readme.write_text(text)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m doctools.performance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("readme", type=Path, nargs="?", default=Path("docs/performance.md"))
    ap.add_argument("--blocks", default="performance,imagenet", help=f"comma-separated, of {', '.join(BLOCKS)}")
    a = ap.parse_args(sys.argv[1:])
    update_readme(a.run, a.readme, tuple(b.strip() for b in a.blocks.split(",") if b.strip()))
