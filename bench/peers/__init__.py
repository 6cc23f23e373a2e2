"""Peers: FFCV, LitData and WebDataset, each in its own virtual environment (``make bench-peers`` makes
``bench/.venvs/<peer>``; ``BENCH_VENVS`` points elsewhere). Each peer is one script here that imports
nothing from this project and is run by its venv's python in a child process, on the same files, with
the same image size, batch size and worker count. A peer whose venv is absent is skipped with the
reason printed and recorded. Settings are each peer's documented fast ones (``SETTINGS`` says which).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["PEERS", "SETTINGS", "build_contenders", "load_contenders", "peer_python"]

HERE = Path(__file__).resolve().parent
PEERS = ("ffcv", "litdata", "webdataset")

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
}

# (peer, mode) -> label: what each peer builds and then loads
BUILDS = {("ffcv", "raw"): "FFCV .beton, raw", ("ffcv", "jpg"): "FFCV .beton, JPEG q90",
          ("litdata", "raw"): "LitData optimize, raw uint8", ("webdataset", "raw"): "WebDataset tar shards, .npy"}


def venv_root() -> Path:
    return Path(os.environ.get("BENCH_VENVS", HERE.parent / ".venvs"))


def peer_python(name: str) -> tuple[str | None, str]:
    """(python of the peer's venv, "") or (None, why it is skipped)."""
    py = venv_root() / name / "bin" / "python"
    if py.exists():
        return str(py), ""
    return None, f"no venv at {py.parent.parent} (make bench-peers makes it)"


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


def load_contenders(cfg: dict[str, Any], outputs: dict[str, Path], skipped: dict[str, str]) -> list[dict[str, Any]]:
    """Load contenders for every peer build that exists: key, label, command(epochs) (its answer holds
    ``groups``: the epochs of the raw and the augmented loader)."""
    out = []
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
