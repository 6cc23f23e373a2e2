"""Compact (jpeg) caches: size, quality, decoder choice and read speed, contenders side by side in one run.

    python bench/scripts/compact.py                         # 4,000 real-photo samples at 224, CPU
    python bench/scripts/compact.py --n 2000 --json out.json [--ffcv-python PATH] [--cuda]

What it reports (ratios taken within one run, per round where there are rounds, medians):
  size        bytes of the jpeg cache's shards / the raw (npy) cache's shards, same build  (issue: <= 1/10)
  quality     PSNR of every sample against the raw cache of the same build (issue: median >= 39 dB)
  exactness   served pixels == simplejpeg / cv2 decodes of the stored bytes (issue: equal)
  decoders    one process decoding every stored JPEG: simplejpeg (into the batch) vs cv2.imdecode
  load        shuffled epochs, batch 256: DataLoader with 2 workers decoding on read (collate_batch) vs a
              bare decode loop of the same bytes in 2 processes (memory-mapped shards, simplejpeg into a
              reused batch buffer, no checks) (issue: >= 0.8x); the raw cache's DataLoader for context
  ffcv        FFCV's Loader on a .beton of the same samples as JPEG q90 (bench/scripts/ffcv_jpeg_contender.py in FFCV's
              own venv: --ffcv-python, $FFCV_PYTHON, or $BENCH_VENVS/ffcv, default bench/.venvs/ffcv)
              (issue: DataLoader >= 3x FFCV)
  cuda        with --cuda and a GPU: nvJPEG batched decode img/s of the stored samples (issue: >= 20,000 on an
              H200), and the --decode-device cuda build vs the 2-process CPU build of the same files (>= 5x)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import simplejpeg
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cachebuild.builder.pipeline import BuildOptions, build  # noqa: E402
from cachebuild.sources.folder import folder_plan  # noqa: E402
from cachebuild.storage.cache import open_cache  # noqa: E402
from cachebuild.storage.kinds.jpeg import JpegImages  # noqa: E402
from loaders.dataset import CachedImageDataset, collate_batch  # noqa: E402
from loaders.encoded import EncodedImages  # noqa: E402
from loaders.sampler import CacheSampler  # noqa: E402

__all__ = ["main"]

BATCH = 256


def _stored_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("images-*"))


def _psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    mse = ((a.astype(np.float32) - b.astype(np.float32)) ** 2).reshape(len(a), -1).mean(axis=1)
    return 10 * np.log10(255.0**2 / np.maximum(mse, 1e-12))


def _jpeg_images(ds: CachedImageDataset) -> JpegImages:
    """The dataset's store, a compact cache's (what this script measures)."""
    images = ds._images
    if not isinstance(images, JpegImages):
        raise TypeError(f"expected a compact (jpeg) cache, got a {type(images).__name__} store")
    return images


def _cv2_decode(data: np.ndarray) -> np.ndarray:
    decoded = cv2.imdecode(np.asarray(data), cv2.IMREAD_COLOR_RGB)
    if decoded is None:
        raise ValueError("cv2.imdecode could not decode a stored JPEG payload")
    return decoded


def _payloads(ds: CachedImageDataset) -> list[np.ndarray]:
    return _jpeg_images(ds).files.read(np.arange(len(ds)))


# ---------------------------------------------------------------- bare decode loop, N processes

_BARE: dict[str, Any] = {}


def _bare_init(files: Any, shape: tuple[int, ...]) -> None:
    _BARE["files"], _BARE["shape"] = files, shape


def _bare_decode(idx: np.ndarray) -> int:
    """Decode samples ``idx`` batch by batch into one reused buffer: reads through the same memory maps."""
    files, shape = _BARE["files"], _BARE["shape"]
    out = np.empty((BATCH, *shape), np.uint8)
    for lo in range(0, len(idx), BATCH):
        part = idx[lo : lo + BATCH]
        for j, data in enumerate(files.read(part)):
            simplejpeg.decode_jpeg(data, "RGB", buffer=out[j])
    return len(idx)


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _epoch(loader: Any) -> int:
    seen = 0
    for x, _y in loader:
        seen += len(x)
    return seen


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--subsampling", default="420")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--src", type=Path, default=None, help="a class-folder tree of JPEGs (default: made here)")
    p.add_argument("--ffcv-python", default=None)
    p.add_argument("--no-ffcv", action="store_true", help="leave FFCV out even when its venv is there")
    p.add_argument("--cuda", action="store_true", help="also the nvJPEG decode and the GPU build")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _parse(argv)
    res: dict[str, Any] = {"n": a.n, "size": a.size, "quality": a.quality, "subsampling": a.subsampling,
                           "workers": a.workers, "batch": BATCH, "cpus": len(os.sched_getaffinity(0)),
                           "versions": {"torch": torch.__version__, "opencv": cv2.__version__,
                                        "simplejpeg": simplejpeg.__version__, "numpy": np.__version__}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-compact-"))
    try:
        src = a.src
        if src is None:
            from cachebuild.samples.imagenet_layout import write_imagenet

            info = write_imagenet(tmp / "src", n_classes=10, train_per_class=max(1, a.n // 10), val_per_class=0)
            src = Path(info["train_dir"])
        plan = folder_plan(src, dataset="bench", split="train")
        res["files"] = len(plan)
        raw, jpg = _builds(a, plan, tmp, res)
        ds = CachedImageDataset(jpg.path)
        ref = open_cache(raw.path)
        payloads = _payloads(ds)
        _quality(ds, ref, payloads, res)
        _decoders(ds, payloads, a.rounds, res)
        _load(ds, raw.path, a, res)
        _ffcv(a, ref, len(ds), tmp, res)
        if a.cuda:
            res["cuda"] = _cuda(a, plan, ds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    return res


def _builds(a: argparse.Namespace, plan: Any, tmp: Path, res: dict[str, Any]) -> tuple[Any, Any]:
    """Builds: raw and jpeg, same plan, same processes; their sizes."""
    jobs = a.workers
    raw = build(plan, tmp / "raw", BuildOptions(size=a.size, jobs=jobs, progress=False))
    jpg = build(plan, tmp / "jpg", BuildOptions(size=a.size, jobs=jobs, progress=False, storage="jpeg",
                                                quality=a.quality, subsampling=a.subsampling))
    res["build_img_s"] = {"raw": round(raw.images_per_second), "jpeg": round(jpg.images_per_second)}
    raw_bytes, jpg_bytes = _stored_bytes(raw.path), _stored_bytes(jpg.path)
    res["size"] = {"raw_bytes": raw_bytes, "jpeg_bytes": jpg_bytes, "jpeg_over_raw": jpg_bytes / raw_bytes,
                   "kib_per_sample": jpg_bytes / jpg.count / 1024}
    print(f"size: raw {raw_bytes / 1e6:.1f} MB, jpeg {jpg_bytes / 1e6:.1f} MB = 1/{raw_bytes / jpg_bytes:.1f} "
          f"({jpg_bytes / jpg.count / 1024:.1f} KiB a sample); builds (2 processes, incl. start-up): raw "
          f"{res['build_img_s']['raw']} img/s, jpeg {res['build_img_s']['jpeg']} img/s", flush=True)
    return raw, jpg


def _quality(ds: CachedImageDataset, ref: Any, payloads: list[np.ndarray], res: dict[str, Any]) -> None:
    """Quality against the raw cache of the same build, and exactness against plain decodes of the stored bytes."""
    n = len(ds)
    psnr, exact, exact_cv2 = [], True, True
    for lo in range(0, n, 512):
        idx = np.arange(lo, min(n, lo + 512))
        got = ds.gather(idx)
        psnr.append(_psnr(got, ref.gather(idx)))
        for k, i in enumerate(idx.tolist()):
            exact &= np.array_equal(got[k], simplejpeg.decode_jpeg(payloads[i]))
            if i % 10 == 0:
                exact_cv2 &= np.array_equal(got[k], _cv2_decode(payloads[i]))
    ps = np.concatenate(psnr)
    res["psnr_db"] = {"median": float(np.median(ps)), "p5": float(np.percentile(ps, 5)), "min": float(ps.min())}
    res["served_equals_plain_decode"] = {"simplejpeg": bool(exact), "cv2_every_10th": bool(exact_cv2)}
    print(f"quality: PSNR vs raw median {np.median(ps):.2f} dB (p5 {np.percentile(ps, 5):.1f}); served == "
          f"simplejpeg decode: {exact}, == cv2 decode: {exact_cv2}", flush=True)


def _decoders(ds: CachedImageDataset, payloads: list[np.ndarray], rounds: int, res: dict[str, Any]) -> None:
    """Decoders, one process, interleaved rounds: simplejpeg into the batch vs cv2.imdecode."""
    n = len(ds)
    out = np.empty((BATCH, *ds.shape), np.uint8)
    sj, cv = [], []
    for _ in range(rounds):
        def sj_loop() -> None:
            for k, d in enumerate(payloads):
                simplejpeg.decode_jpeg(d, "RGB", buffer=out[k % BATCH])

        def cv_loop() -> None:
            for k, d in enumerate(payloads):
                out[k % BATCH] = _cv2_decode(d)

        sj.append(n / _time(sj_loop))
        cv.append(n / _time(cv_loop))
    res["decoders_1_process_img_s"] = {"simplejpeg": round(statistics.median(sj)),
                                       "cv2.imdecode": round(statistics.median(cv)),
                                       "ratio": statistics.median(s / c for s, c in zip(sj, cv, strict=True))}
    print(f"decoders (1 process): simplejpeg {statistics.median(sj):.0f} img/s, cv2.imdecode "
          f"{statistics.median(cv):.0f} img/s", flush=True)


def _load(ds: CachedImageDataset, raw_path: Path, a: argparse.Namespace, res: dict[str, Any]) -> None:
    """Load: DataLoader vs the bare decode loop in as many processes, and the raw cache's DataLoader."""
    n = len(ds)
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=a.workers,
                                     collate_fn=collate_batch, persistent_workers=True, prefetch_factor=2)
    raw_ds = CachedImageDataset(raw_path)
    raw_sampler = CacheSampler(raw_ds, shuffle=True, seed=0)
    raw_dl = torch.utils.data.DataLoader(raw_ds, batch_size=BATCH, sampler=raw_sampler, num_workers=a.workers,
                                         collate_fn=collate_batch, persistent_workers=True)
    ctx = multiprocessing.get_context("fork")
    pool = ctx.Pool(a.workers, initializer=_bare_init, initargs=(_jpeg_images(ds).files, ds.shape))
    pool.map(int, range(a.workers))  # started before any timing
    _epoch(dl)  # warm: workers started, page cache holds the shards
    _epoch(raw_dl)
    rows: dict[str, list[float]] = {"bare decode": [], "DataLoader": [], "raw DataLoader": []}
    for r in range(a.rounds):
        perm = np.random.default_rng(r).permutation(n)
        parts = np.array_split(perm, a.workers)
        rows["bare decode"].append(n / _time(lambda parts=parts: pool.map(_bare_decode, parts)))
        sampler.set_epoch(r + 1)
        rows["DataLoader"].append(n / _time(lambda: _epoch(dl)))
        raw_sampler.set_epoch(r + 1)
        rows["raw DataLoader"].append(n / _time(lambda: _epoch(raw_dl)))
        print(f"  round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rows.items()), flush=True)
    pool.close()
    pool.join()
    res["load_img_s"] = {k: round(statistics.median(v)) for k, v in rows.items()}
    res["load_rounds"] = {k: [round(x) for x in v] for k, v in rows.items()}
    ratio = statistics.median(d / b for d, b in zip(rows["DataLoader"], rows["bare decode"], strict=True))
    res["dataloader_over_bare_decode"] = ratio
    print(f"load ({a.workers} processes, batch {BATCH}): DataLoader {res['load_img_s']['DataLoader']} img/s = "
          f"{ratio:.2f}x the bare decode loop ({res['load_img_s']['bare decode']} img/s); raw cache DataLoader "
          f"{res['load_img_s']['raw DataLoader']}",
          flush=True)


def _ffcv(a: argparse.Namespace, ref: Any, n: int, tmp: Path, res: dict[str, Any]) -> None:
    """FFCV's JPEG field on the same samples, in FFCV's own venv (skipped, with the reason, without one)."""
    ffcv_py = a.ffcv_python or os.environ.get("FFCV_PYTHON") or str(
        Path(os.environ.get("BENCH_VENVS", ROOT / "bench" / ".venvs")) / "ffcv" / "bin" / "python")
    if a.no_ffcv:
        res["ffcv_jpeg"] = {"skipped": "peers not requested (--no-ffcv)"}
        return
    if not Path(ffcv_py).exists():
        res["ffcv_jpeg"] = {"skipped": f"no FFCV python at {ffcv_py} (--ffcv-python, $FFCV_PYTHON)"}
        print(f"ffcv: skipped, no FFCV python at {ffcv_py}", flush=True)
        return
    np.save(tmp / "images.npy", ref.gather(np.arange(n)))
    np.save(tmp / "labels.npy", ref.labels)
    r = subprocess.run([ffcv_py, str(ROOT / "bench" / "scripts" / "ffcv_jpeg_contender.py"), "--images",
                        str(tmp / "images.npy"), "--labels", str(tmp / "labels.npy"), "--quality",
                        str(a.quality), "--workers", str(a.workers), "--batch", str(BATCH),
                        "--json", str(tmp / "ffcv.json")], capture_output=True, text=True)
    if r.returncode == 0:
        ff = json.loads((tmp / "ffcv.json").read_text())
        res["ffcv_jpeg"] = ff
        res["dataloader_over_ffcv_jpeg"] = res["load_img_s"]["DataLoader"] / ff["img_s"]
        print(f"ffcv: Loader, JPEG q{a.quality} field, {a.workers} workers: {ff['img_s']:.0f} img/s "
              f"(epochs {ff['epochs']}); DataLoader / FFCV = {res['dataloader_over_ffcv_jpeg']:.2f}x; "
              f"beton {ff['beton_bytes'] / 1e6:.1f} MB", flush=True)
    else:
        res["ffcv_jpeg"] = {"failed": r.stderr[-2000:]}
        print(f"ffcv: failed: {r.stderr[-500:]}", flush=True)


def _cuda(a: argparse.Namespace, plan: Any, ds: CachedImageDataset, tmp: Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        print("cuda: skipped, no CUDA device", flush=True)
        return {"skipped": "no CUDA device"}
    from loaders.cuda_decode import decode_on_cuda

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    dev = torch.device("cuda")
    n = len(ds)
    rates = {}
    for batch in (256, 1024):
        batches = []
        for lo in range(0, n - batch + 1, batch):
            data, offsets = ds._images.read_encoded(np.arange(lo, lo + batch))
            enc = EncodedImages(torch.from_numpy(data), torch.from_numpy(offsets), ds.shape)
            batches.append(enc.pin_memory().payloads())  # what device_loader(decode="cuda") sends
        if not batches:
            continue
        decode_on_cuda(batches[0], ds.shape, dev)  # warm: nvJPEG handles, allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        seen = 0
        for _ in range(3):
            for b in batches:
                decode_on_cuda(b, ds.shape, dev)
                seen += len(b)
        torch.cuda.synchronize()
        rates[f"batch {batch}"] = round(seen / (time.perf_counter() - t0))
    out["nvjpeg_decode_img_s"] = rates
    print(f"cuda: nvJPEG batched decode of {ds.shape[0]} px samples: {rates} img/s", flush=True)
    cpu = build(plan, tmp / "cpu-build", BuildOptions(size=a.size, jobs=2, progress=False))
    gpu = build(plan, tmp / "gpu-build", BuildOptions(size=a.size, progress=False, decode_device="cuda"))
    out["build_img_s"] = {"cpu_2_processes": round(cpu.images_per_second), "gpu": round(gpu.images_per_second),
                          "gpu_over_cpu": gpu.images_per_second / cpu.images_per_second}
    print(f"cuda: build, CPU 2 processes {cpu.images_per_second:.0f} img/s, --decode-device cuda "
          f"{gpu.images_per_second:.0f} img/s = {gpu.images_per_second / cpu.images_per_second:.1f}x", flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
