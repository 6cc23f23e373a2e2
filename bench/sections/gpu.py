"""GPU section (only where CUDA is available; otherwise recorded as skipped with the reason).

The same measurements on the device: device transforms eager and compiled with bf16 output;
host-to-device bandwidth of a uint8 batch from pinned and from pageable memory; and resnet50 at batch
256 with bf16 autocast fed by each contender of the train section, with its data-wait share.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.sections.train import run_train
from bench.sections.transforms import run_transforms
from bench.stats import summary

__all__ = ["h2d_bandwidth", "run_gpu"]


def h2d_bandwidth(shape: tuple[int, ...] = (256, 224, 224, 3), repeats: int = 10) -> dict[str, Any]:
    """GB/s of ``tensor.to("cuda")`` for one uint8 batch, pinned (non_blocking) and pageable."""
    dev = torch.device("cuda")
    out: dict[str, Any] = {"batch_shape": list(shape), "mb": round(torch.Size(shape).numel() / 1e6, 1)}
    for kind in ("pinned", "pageable"):
        host = torch.randint(0, 256, shape, dtype=torch.uint8)
        if kind == "pinned":
            host = host.pin_memory()
        host.to(dev, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            host.to(dev, non_blocking=kind == "pinned")
            torch.cuda.synchronize()
            rates.append(host.numel() / (time.perf_counter() - t0) / 1e9)
        out[f"{kind}_gb_s"] = summary(rates, 2)
    return out


def run_gpu(cfg: dict[str, Any], src: Path, outputs: dict[str, Path], log: Callable[[str], None]) -> dict[str, Any]:
    if not cfg.get("gpu", True):
        return {"skipped": "GPU section not requested (--no-gpu)"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    dev = torch.device("cuda")
    log(f"gpu: {torch.cuda.get_device_name(dev)}")
    crop = min(224, cfg["size"])
    gcfg = {**cfg, "tf_batch": 256, "tf_size": crop, "batch": 256, "workers": cfg["gpu_workers"]}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(dev)}
    result["transforms_bf16"] = run_transforms(gcfg, log, device=dev, dtype=torch.bfloat16, compile_=True)
    result["h2d"] = h2d_bandwidth((256, cfg["size"], cfg["size"], 3))
    log(f"  h2d pinned {result['h2d']['pinned_gb_s']['median']} GB/s, "
        f"pageable {result['h2d']['pageable_gb_s']['median']} GB/s")
    torch.backends.cudnn.benchmark = True
    result["resnet50"] = run_train(gcfg, src, outputs, log, device=dev, model_name="resnet50", crop=crop,
                                   amp=torch.bfloat16, n=cfg["n"])
    return result
