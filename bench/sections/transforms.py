"""Device-transform section: img/s of the training augmentation applied to one uint8 batch.

Input: a uint8 (B, 3, S, S) channels_last batch as the loader delivers it (S = the cache size), on the
CPU here and on CUDA in the GPU section. Contenders, interleaved round by round (three warm-up calls
left out: they compile, and TorchScript profiles its first two): torchvision v1 flip +
ConvertImageDtype + Normalize scripted on the batch (less work: one flip for the whole batch, no crop),
and cachebuild's imagenet_train() preset (per-sample RandomResizedCrop + flip + normalize) eager,
TorchScript'd and torch.compile'd.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bench.stats import ratio, summary

__all__ = ["run_transforms"]


def _contenders(size: int, dtype: torch.dtype, device: torch.device, compile_: bool) -> dict[str, tuple[str, Any]]:
    import torchvision.transforms as T

    from loaders.transforms import IMAGENET_MEAN, IMAGENET_STD, imagenet_train

    out: dict[str, tuple[str, Any]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript deprecation (torch >= 2.14)
        out["v1_scripted"] = ("torchvision v1 flip + ConvertImageDtype + Normalize, scripted (one flip per batch, "
                              "no crop)", torch.jit.script(torch.nn.Sequential(
                                  T.RandomHorizontalFlip(), T.ConvertImageDtype(torch.float32),
                                  T.Normalize(IMAGENET_MEAN, IMAGENET_STD)).to(device)))
        out["eager"] = ("cachebuild imagenet_train(): per-sample RandomResizedCrop + flip + normalize, eager",
                        imagenet_train(size, dtype=dtype).to(device))
        if device.type == "cpu":
            out["scripted"] = ("the same, torch.jit.script", torch.jit.script(imagenet_train(size, dtype=dtype)))
    if compile_:
        out["compiled"] = ("the same, torch.compile", torch.compile(imagenet_train(size, dtype=dtype).to(device)))
    return out


def run_transforms(cfg: dict[str, Any], log: Callable[[str], None], device: torch.device | None = None,
                   dtype: torch.dtype = torch.float32, compile_: bool | None = None) -> dict[str, Any]:
    device = device or torch.device("cpu")
    compile_ = cfg["compile"] if compile_ is None else compile_
    b, s_in, s = cfg["tf_batch"], cfg["size"], cfg["tf_size"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, s_in, s_in, 3), dtype=torch.uint8, generator=g).to(device).permute(0, 3, 1, 2)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    contenders = _contenders(s, dtype, device, compile_)
    failed: dict[str, str] = {}
    for key in list(contenders):  # warm-up (compiles); a contender that cannot run is reported
        try:
            for _ in range(3):  # TorchScript's profiling executor optimises after its first two calls
                contenders[key][1](x)
            sync()
        except Exception as e:  # torch.compile raises many kinds: report it, do not stop the run
            failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            del contenders[key]
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(cfg["rounds"]):
        for key, (_, fn) in contenders.items():
            sync()
            t0 = time.perf_counter()
            fn(x)
            sync()
            rates[key].append(b / (time.perf_counter() - t0))
    rows: dict[str, dict[str, Any]] = {k: {"label": contenders[k][0], "img_s": summary(v, 1)}
                                       for k, v in rates.items()}
    for r in rows.values():
        r["x_v1_scripted"] = ratio(r["img_s"], rows.get("v1_scripted", {}).get("img_s"))
    log("  transforms " + ", ".join(f"{k} {r['img_s']['median']:.0f} img/s" for k, r in rows.items()))
    return {"device": str(device), "batch": b, "input": s_in, "output": s, "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "rounds": cfg["rounds"], "warmup_rounds": 1, "contenders": rows,
            "failed": failed}
