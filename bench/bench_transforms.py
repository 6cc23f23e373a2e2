"""Device transform throughput: images/s of a 224 training batch, contenders side by side.

Input: a uint8 batch (N, 3, S, S) as the loader delivers it (channels_last view of an NHWC buffer),
S = --input-size (default 256, the usual cache size; 224 also makes sense for a 224 cache).

Contenders (same input, same process, interleaved rounds, median of rounds):
  v1_flip_norm        torchvision v1 scripted RandomHorizontalFlip + ConvertImageDtype + Normalize
                      on the batch: does LESS work (one coin per batch, no crop, no resize)
  rrc_eager           imagenet_train preset: per-sample RandomResizedCrop + flip + Normalize
  rrc_scripted        the same, torch.jit.script
  rrc_compiled        the same, torch.compile (optional: reported as failed if it cannot compile)
  rrc_batched_eager   the preset with method="batched" (the one-kernel path used on GPUs)

Example: python bench/bench_transforms.py --device cpu --batch 256 --size 224 --iters 5 --json out.json
"""

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loaders.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Compose,
    Normalize,
    RandomResizedCrop,
    imagenet_train,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _v1_chain() -> torch.nn.Module:
    import torchvision.transforms as T

    return torch.nn.Sequential(
        T.RandomHorizontalFlip(),
        T.ConvertImageDtype(torch.float),
        T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    )


def _build(args: argparse.Namespace) -> dict[str, Callable[[Tensor], Tensor]]:
    contenders: dict[str, Callable[[Tensor], Tensor]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript deprecation warnings (torch >= 2.14)
        contenders["v1_flip_norm"] = torch.jit.script(_v1_chain())
        contenders["rrc_eager"] = imagenet_train(args.size)
        contenders["rrc_scripted"] = torch.jit.script(imagenet_train(args.size))
    if not args.no_compile:
        contenders["rrc_compiled"] = torch.compile(imagenet_train(args.size))
    contenders["rrc_batched_eager"] = Compose(
        [
            RandomResizedCrop(args.size, flip_p=0.5, method="batched"),
            Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    return contenders


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224, help="output size")
    p.add_argument("--input-size", type=int, default=256, help="cached image size S of the uint8 input")
    p.add_argument("--iters", type=int, default=5, help="timed rounds per contender")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave default)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    nhwc = torch.randint(0, 256, (args.batch, args.input_size, args.input_size, 3), dtype=torch.uint8)
    images = nhwc.to(device).permute(0, 3, 1, 2)  # channels_last NCHW view, as the loader delivers

    contenders = _build(args)
    errors: dict[str, str] = {}
    for name in list(contenders):  # warm up (compiles); drop contenders that fail
        try:
            for _ in range(args.warmup):
                contenders[name](images)
            _sync(device)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            del contenders[name]

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.iters):  # interleave rounds so that machine noise hits everyone alike
        for name, fn in contenders.items():
            _sync(device)
            t0 = time.perf_counter()
            fn(images)
            _sync(device)
            times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["v1_flip_norm"]) if "v1_flip_norm" in times else None
    rows = []
    print(
        f"device={device} batch={args.batch} input={args.input_size}x{args.input_size} uint8 "
        f"-> {args.size}x{args.size} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    print(f"{'contender':20s} {'ms/batch':>10s} {'img/s':>10s} {'vs v1':>8s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = base / med if base else float("nan")
        rows.append({"name": name, "ms_per_batch": med * 1e3, "images_per_s": args.batch / med, "vs_v1": ratio})
        print(f"{name:20s} {med * 1e3:10.1f} {args.batch / med:10.0f} {ratio:8.2f}x")
    for name, err in errors.items():
        print(f"{name:20s} FAILED: {err}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "batch": args.batch,
                    "input_size": args.input_size,
                    "size": args.size,
                    "iters": args.iters,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                    "results": rows,
                    "errors": errors,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
