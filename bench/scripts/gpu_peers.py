"""On a GPU: NVIDIA DALI's nvJPEG decode + GPU augmentation against cachebuild's compact (JPEG) cache read
with ``device_loader(decode="cuda")`` and the device transforms, on the same files, batch and worker count.

    python bench/scripts/gpu_peers.py --n 2000 --json out.json     # on a machine with CUDA (.ci/gpu-checks runs it)

Contenders, each a shuffled epoch of uint8 JPEGs -> float NCHW 224 px batches on the GPU, RandomResizedCrop +
flip + normalize:
  dali      fn.readers.file(random_shuffle) -> fn.decoders.image_random_crop(device="mixed": nvJPEG, the crop
            fused into the decode) -> fn.resize + fn.crop_mirror_normalize on the GPU; num_threads = workers
  cachebuild  CachedImageDataset(compact cache) + DataLoader(workers, pin_memory) -> device_loader(decode="cuda")
            (nvJPEG, TorchCodec's decode_jpeg on the batch) -> loaders.transforms.imagenet_train on the GPU
The first epoch of each is a warm-up (left out). Without CUDA, or without DALI in this python, the script
says what it skipped in its JSON and exits 0: the step is wired on every machine and measures where it can.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _rates(make_epoch: Any, epochs: int, n: int, sync: Any) -> list[float]:
    out = []
    for _ in range(epochs + 1):
        seen, t0 = 0, time.perf_counter()
        for x, _ in make_epoch():
            seen += len(x)
        sync()
        if seen != n:
            raise RuntimeError(f"an epoch delivered {seen} samples, expected {n}")
        out.append(seen / (time.perf_counter() - t0))
    return out[1:]


def _dali(files: list[tuple[str, int]], a: argparse.Namespace, sync: Any) -> list[float]:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @pipeline_def(batch_size=a.batch, num_threads=a.workers, device_id=0, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(files=[p for p, _ in files], labels=[k for _, k in files],
                                        random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=a.size, resize_y=a.size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mirror=fn.random.coin_flip(), mean=[m * 255 for m in MEAN],
                                          std=[s * 255 for s in STD])
        return images, labels

    it = DALIGenericIterator(pipe(), ["data", "label"], reader_name="reader",
                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
    return _rates(lambda: ((d[0]["data"], d[0]["label"]) for d in it), a.epochs, len(files), sync)


def _cachebuild(cache: Path, a: argparse.Namespace, sync: Any) -> list[float]:
    from torch.utils.data import DataLoader

    from loaders import transforms as CT
    from loaders.dataset import CachedImageDataset, collate_batch
    from loaders.device import device_loader
    from loaders.sampler import CacheSampler

    ds = CachedImageDataset(cache)
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers, collate_fn=collate_batch,
                    pin_memory=True, persistent_workers=True)
    tf = CT.imagenet_train(a.size)
    epoch = [0]

    def make() -> Any:
        epoch[0] += 1
        sampler.set_epoch(epoch[0])
        return ((tf(x), y) for x, y in device_loader(dl, "cuda", decode="cuda"))
    return _rates(make, a.epochs, len(ds), sync)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    import torch

    res: dict[str, Any] = {"n": a.n, "size": a.size, "batch": a.batch, "workers": a.workers, "epochs": a.epochs}
    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device on this machine"
    else:
        from cachebuild.builder.pipeline import BuildOptions, build
        from cachebuild.samples.imagenet_layout import write_imagenet
        from cachebuild.sources.folder import folder_plan

        res["device"] = torch.cuda.get_device_name(0)
        tmp = Path(tempfile.mkdtemp(prefix="gpu-peers-"))
        info = write_imagenet(tmp / "src", n_classes=10, train_per_class=max(1, a.n // 10), val_per_class=0)
        plan = folder_plan(Path(info["train_dir"]), dataset="bench", split="train")
        classes = sorted(d for d in Path(info["train_dir"]).iterdir() if d.is_dir())
        files = sorted((str(f), k) for k, d in enumerate(classes) for f in d.iterdir() if f.is_file())
        cache = build(plan, tmp / "jpg", BuildOptions(size=a.size, jobs=a.workers, progress=False, storage="jpeg"))
        sync = torch.cuda.synchronize
        rows = res["contenders"] = {}
        rows["cachebuild_compact_cuda"] = {"label": "cachebuild compact cache: device_loader(decode='cuda') + "
                                           "imagenet_train() on the GPU", "img_s": _cachebuild(cache.path, a, sync)}
        try:
            import nvidia.dali  # noqa: F401
        except ImportError as e:
            res["dali_skipped"] = f"nvidia.dali is not importable in this python ({e})"
        else:
            rows["dali_nvjpeg"] = {"label": "DALI: decoders.image_random_crop(device='mixed', nvJPEG) + GPU "
                                   "resize + crop_mirror_normalize", "img_s": _dali(files, a, sync)}
        for r in rows.values():
            r["median_img_s"] = round(statistics.median(r["img_s"]), 1)
        if len(rows) == 2:
            res["x_dali"] = round(rows["cachebuild_compact_cuda"]["median_img_s"] / rows["dali_nvjpeg"]["median_img_s"],
                                  3)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
