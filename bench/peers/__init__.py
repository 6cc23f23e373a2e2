"""Peers: FFCV, LitData, WebDataset, NVIDIA DALI, SPDL, MosaicML Streaming and datago, each in its own virtual
environment (``make bench-peers`` makes
``bench/.venvs/<peer>``; ``BENCH_VENVS`` points elsewhere). Each peer is one script here that imports
nothing from this project and is run by its venv's python in a child process, on the same files, with
the same image size, batch size and worker count. A peer whose venv is absent is skipped with the
reason printed and recorded. Settings are each peer's documented fast ones (``SETTINGS`` says which).
Peers with a cache writer (``BUILDS``) build and then load what they built; DALI, SPDL and datago have none
and decode the JPEGs every epoch (``LOADS``), and DALI also reads the cachebuild npy cache.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["DISTRIBUTIONS", "PEERS", "SETTINGS", "build_contenders", "load_contenders", "peer_python",
           "peer_version"]

HERE = Path(__file__).resolve().parent
PEERS = ("ffcv", "litdata", "webdataset", "dali", "spdl", "streaming", "datago")
# peer -> the distribution whose version the results name
DISTRIBUTIONS = {"ffcv": "ffcv", "litdata": "litdata", "webdataset": "webdataset", "dali": "nvidia-dali-cuda120",
                 "spdl": "spdl", "streaming": "mosaicml-streaming", "datago": "datago"}

SETTINGS = {
    "ffcv": ("FFCV 1.0.2: DatasetWriter(num_workers=jobs) from an indexed dataset of uint8 (size, size, 3) arrays "
             "(PIL Resize(size) + CenterCrop(size): the pixels every cache holds), RGBImageField(write_mode='raw' "
             "or 'jpg' with jpeg_quality=90, max_resolution=size); Loader(order=RANDOM, os_cache=True, num_workers, "
             "batch_size, drop_last=False); raw: SimpleRGBImageDecoder + ToTensor (uint8 NHWC; its fastest decoder, "
             "for same-size images); "
             "augmented: RandomResizedCropRGBImageDecoder((size, size)) + RandomHorizontalFlip + "
             "NormalizeImage(float32) + ToTensor + ToTorchImage (its ImageNet train pipeline on the CPU: "
             "NormalizeImage before ToTensor, as 1.0.2 hangs in Loader() with it after ToTorchImage there)"),
    "litdata": ("LitData: optimize(fn, inputs, chunk_bytes='64MB', num_workers=jobs) storing uint8 (size, size, 3) "
                "arrays (PIL Resize(size) + CenterCrop(size)) and int labels; StreamingDataset(shuffle=True) + "
                "StreamingDataLoader(batch_size, num_workers); augmented: per-sample torchvision v2 "
                "RandomResizedCrop + flip + normalize in the workers"),
    "webdataset": ("WebDataset: tar shards of .npy uint8 (size, size, 3) + .cls written by `jobs` processes "
                   "(ShardWriter, >= 8 shards per worker); WebDataset(shardshuffle=True).shuffle(1000).decode()"
                   ".to_tuple('npy', 'cls').batched(batch) in WebLoader(batch_size=None, num_workers); augmented: "
                   "per-sample torchvision v2 RandomResizedCrop + flip + normalize before batching"),
    "dali": ("NVIDIA DALI (nvidia-dali-cuda120), CPU pipeline (device_id=None), num_threads = the worker count, "
             "prefetch_queue_depth=2, DALIGenericIterator(last_batch_policy=PARTIAL); no cache writer: it decodes "
             "every epoch. From the JPEGs: fn.readers.file(random_shuffle=True) -> raw: fn.decoders.image(RGB) + "
             "fn.resize(resize_shorter=size) + fn.crop(size, size) (uint8 HWC); augmented: its ResNet-50 recipe, "
             "fn.decoders.image_random_crop (the crop fused into the decode) + fn.resize(size, size) + "
             "fn.crop_mirror_normalize(mirror=fn.random.coin_flip(), float CHW). From the cachebuild npy cache: "
             "fn.external_source(batch=True) gathering each shuffled batch from the memory-mapped shards "
             "(fn.readers.numpy reads one array per file, and a cachebuild shard holds many samples); augmented: "
             "fn.random_resized_crop + fn.crop_mirror_normalize(mirror=coin_flip)"),
    "spdl": ("SPDL: PipelineBuilder().add_source(shuffled files).pipe(decode, concurrency=workers)"
             ".aggregate(batch).pipe(collate).add_sink(3).build(num_threads=workers); decode = "
             "spdl.io.load_image (FFmpeg) with the resize in its filter graph: raw: scale to the short side + "
             "crop (centre); augmented: a RandomResizedCrop (area 0.08-1, aspect 3/4-4/3, clamped to the image) + "
             "random hflip in the filter graph, then float + normalize on the batch in torch; no cache writer"),
    "streaming": ("MosaicML Streaming: MDSWriter(columns image 'ndarray:uint8:S,S,3' + label 'int', "
                  "compression=None, size_limit='64mb'), one writer per build process then merge_index (its "
                  "parallel recipe), uint8 (size, size, 3) arrays (PIL Resize(size) + CenterCrop(size)); "
                  "StreamingDataset(shuffle=True, batch_size) + StreamingDataLoader(batch_size, num_workers, "
                  "persistent_workers=True); "
                  "augmented: per-sample torchvision v2 RandomResizedCrop + flip + normalize in the workers; from "
                  "a URL: StreamingDataset(remote='s3://...', local=a fresh folder) on the loopback S3 server"),
    "datago": ("datago: DatagoClient, source_type 'file' over the JPEG folder (random_sampling=True, "
               "samples_buffer_size = 4 batches), DATAGO_MAX_TASKS = the worker count, one start() per epoch; raw: "
               "image_config crop_and_resize into the single 1:1 bucket of default_image_size=size; augmented: "
               "full-size images, torchvision v2 RandomResizedCrop + flip + normalize per sample in the Python "
               "thread (datago has no augmentation); batches stacked in Python; no cache writer"),
}

# (peer, mode) -> label: what each peer builds and then loads
BUILDS = {("ffcv", "raw"): "FFCV .beton, raw", ("ffcv", "jpg"): "FFCV .beton, JPEG q90",
          ("litdata", "raw"): "LitData optimize, raw uint8", ("webdataset", "raw"): "WebDataset tar shards, .npy",
          ("streaming", "raw"): "Streaming MDSWriter, raw uint8"}
# (peer, mode) -> (label, what it reads: "files" = the JPEGs, else the build output of that key): no build of
# their own
LOADS = {("dali", "jpeg"): ("DALI CPU pipeline from the JPEGs", "files"),
         ("dali", "cache"): ("DALI external_source from the cachebuild npy cache", "cachebuild_npy"),
         ("spdl", "jpeg"): ("SPDL thread pipeline from the JPEGs (FFmpeg decode)", "files"),
         ("datago", "jpeg"): ("datago file source from the JPEGs (Rust decode)", "files")}


def venv_root() -> Path:
    return Path(os.environ.get("BENCH_VENVS", HERE.parent / ".venvs"))


def peer_python(name: str) -> tuple[str | None, str]:
    """(python of the peer's venv, "") or (None, why it is skipped)."""
    py = venv_root() / name / "bin" / "python"
    if py.exists():
        return str(py), ""
    return None, f"no venv at {py.parent.parent} (make bench-peers makes it)"


def peer_version(name: str) -> str | None:
    """The installed version of the peer's distribution in its venv (None without a venv)."""
    py, _ = peer_python(name)
    if py is None:
        return None
    code = f"from importlib.metadata import version; print(version({DISTRIBUTIONS[name]!r}))"
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or None


def _wanted(cfg: dict[str, Any], name: str, skipped: dict[str, str]) -> str | None:
    if not cfg.get("peers", True):
        skipped[name] = "peers not requested (--no-peers)"
        return None
    py, why = peer_python(name)
    if py is None:
        skipped[name] = why
    return py


def build_contenders(cfg: dict[str, Any], files_json: Path, skipped: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for name in PEERS:
        py = _wanted(cfg, name, skipped)
        if py is None:
            continue
        for (peer, mode), label in BUILDS.items():
            if peer != name:
                continue
            def command(dest: Path, py: str = py, peer: str = peer, mode: str = mode) -> list[str]:
                return [py, str(HERE / f"{peer}_peer.py"), "build", "--files", str(files_json), "--out", str(dest),
                        "--size", str(cfg["size"]), "--workers", str(cfg["jobs"]), "--mode", mode]
            procs = f"{cfg['jobs']} process" + ("es" if cfg["jobs"] != 1 else "")
            out.append({"key": f"{peer}_{mode}", "label": f"{label}, {procs}", "command": command})
    return out


def load_contenders(cfg: dict[str, Any], outputs: dict[str, Path], skipped: dict[str, str],
                    files_json: Path | None = None) -> list[dict[str, Any]]:
    """Load contenders for every peer build that exists, and the peers without a build (on ``files_json``,
    the JPEG list, or a build output): key, label, command(epochs) (its answer holds ``groups``: the epochs
    of the raw and the augmented loader)."""
    out = []
    w = cfg["workers"]
    for (peer, mode), (label, source) in LOADS.items():
        py = _wanted(cfg, peer, skipped)
        if py is None:
            continue
        if (source == "files" and files_json is None) or (source != "files" and source not in outputs):
            skipped[f"{peer}_{mode}"] = f"its input ({source}) was not built"
            continue
        where = ["--files", str(files_json)] if source == "files" else ["--data", str(outputs[source])]

        def load_only(epochs: int, py: str = py, peer: str = peer, mode: str = mode,
                      where: list[str] = where) -> list[str]:
            return [py, str(HERE / f"{peer}_peer.py"), "load", *where, "--mode", mode, "--size", str(cfg["size"]),
                    "--batch", str(cfg["batch"]), "--workers", str(w), "--epochs", str(epochs), "--aug", "0,1"]
        out.append({"key": f"{peer}_{mode}", "label": f"{label}, {w} threads", "command": load_only})
    for (peer, mode), label in BUILDS.items():
        key = f"{peer}_{mode}"
        if key not in outputs:
            if peer not in skipped:
                skipped[peer] = "its build failed or did not run"
            continue
        py, _ = peer_python(peer)
        if py is None:
            continue

        def command(epochs: int, py: str = py, peer: str = peer, data: Path = outputs[key]) -> list[str]:
            # both groups, raw then augmented, in one process (the library's imports paid once)
            return [py, str(HERE / f"{peer}_peer.py"), "load", "--data", str(data), "--size", str(cfg["size"]),
                    "--batch", str(cfg["batch"]), "--workers", str(cfg["workers"]), "--epochs", str(epochs),
                    "--aug", "0,1"]
        out.append({"key": key, "label": f"{label} loader, {cfg['workers']} workers", "command": command})
    return out
