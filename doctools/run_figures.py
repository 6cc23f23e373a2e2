"""Generated blocks that quote single figures of a full run in prose pages (written from
``bench/results/@quiet-full``, the newest quiet full run, so a newer quiet run rewrites them): the compact
caches' table of docs/performance.md and the augmented loaders against the peers' in docs/training.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["augment_section", "compact_section"]


def _head(res: dict[str, Any], where: str) -> str:
    load = res.get("machine", {}).get("load_average_at_start") or ["?"]
    return (f"From [`{where}/`]({where}/results.md) (`{res['run']['command']}`, {res['run']['started'][:10]}, "
            f"load average {load[0]} at the start)")


def compact_section(res: dict[str, Any], where: str) -> str:
    """The ``compact`` section of a run: size, quality, build, decode and load of a compact (JPEG) cache."""
    c = res.get("compact", {}).get("figures")
    if not c:
        return f"{_head(res, where)}: no `compact` section in this run."
    w, load, dec, size = c["workers"], c["load_img_s"], c["decoders_1_process_img_s"], c["size"]
    lines = [f"{_head(res, where)}, its `compact` section (`bench/scripts/compact.py`, {c['n']:,} samples at "
             f"{res['config'].get('size', 224)} px, {c['cpus']} cores):", "", "| what | measured |", "|---|---|",
             f"| size | {size['kib_per_sample']:.1f} KiB a sample, {size['jpeg_over_raw']:.3f} of the raw cache |",
             f"| quality | median PSNR {c['psnr_db']['median']:.1f} dB against the raw cache (5th percentile "
             f"{c['psnr_db']['p5']:.1f} dB) |",
             f"| build, {w} processes | {c['build_img_s']['jpeg']:,} img/s |",
             f"| decode, one process | simplejpeg {dec['simplejpeg']:,} img/s, `cv2.imdecode` "
             f"{dec['cv2.imdecode']:,} img/s |",
             f"| shuffled DataLoader epoch, {w} workers decoding on read | {load['DataLoader']:,} img/s, "
             f"{c['dataloader_over_bare_decode']:.2f}x a bare {w}-process decode loop of the same bytes |"]
    ffcv = c.get("ffcv_jpeg")
    if ffcv and c.get("dataloader_over_ffcv_jpeg"):
        lines.append(f"| FFCV `Loader` on a JPEG q90 `.beton` of the same samples | {ffcv['img_s']:,.0f} img/s "
                     f"(cachebuild / FFCV: {c['dataloader_over_ffcv_jpeg']:.2f}x) |")
    return "\n".join(lines)


_OURS = ("cachebuild_npy_fused_in_workers", "cachebuild_jpeg_fused_in_workers", "cachebuild_npy_crop_in_workers",
         "cachebuild_jpeg_crop_in_workers", "cachebuild_npy_dataloader")
_PEERS = ("ffcv_raw", "ffcv_jpg", "dali_cache")


def augment_section(res: dict[str, Any], where: str) -> str:
    """The augmented loads (RandomResizedCrop + flip + normalize to float batches) of the crop in the DataLoader's
    workers, and the batch path, against FFCV's and DALI's augmented loaders, in one run."""
    rows = res.get("load", {}).get("groups", {}).get("augmented", {})
    ours = [k for k in _OURS if k in rows]
    peers = [k for k in _PEERS if k in rows]
    cfg = res.get("config", {})
    lines = [f"{_head(res, where)}: {res.get('load', {}).get('images', cfg.get('n'))} photos at {cfg.get('size')} px, "
             f"batch {cfg.get('batch')}, {cfg.get('workers')} workers, normalized float batches on the CPU.",
             ""]
    if not ours or not peers:
        return "\n".join([*lines, "No augmented rows of both cachebuild and FFCV or DALI in this run."])
    heads = [f"x {rows[p]['label'].rsplit(',', 1)[0]} ({rows[p]['img_s']['median']:,.0f} img/s)" for p in peers]
    lines += ["| cachebuild | img/s | " + " | ".join(heads) + " |", "|---|---:|" + "---:|" * len(peers)]
    for k in ours:
        rate = rows[k]["img_s"]["median"]
        lines.append(f"| {rows[k]['label'].removeprefix('4. ')} | {rate:,.0f} | " +
                     " | ".join(f"{rate / rows[p]['img_s']['median']:.2f}x" for p in peers) + " |")
    return "\n".join(lines)
