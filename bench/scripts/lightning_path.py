"""Lightning's path vs our own DataLoader path on the same cache: img/s of the data path, as a ratio.

    python -m bench.scripts.lightning_path [--n 2048] [--size 128] [--batch 128] [--workers 2] [--rounds 3] [--out F]

Both paths read the same cache with the same sampler, workers and device transform (Normalize to float),
and run the same trivial step (a mean), so what is timed is the data path and the loop around it:

* ours: ``DataLoader(collate_fn=collate_batch)`` -> ``device_loader`` -> transform -> step;
* lightning: ``CacheDataModule`` -> ``lightning.Trainer.fit`` (its fetcher, batch transfer and hooks) ->
  ``on_after_batch_transfer`` -> transform -> ``training_step``.

Each run trains four epochs and times the last three (workers warm, persistent). The runs alternate
(ours, lightning, ours, ...) because the machine is shared; the ratio of medians is the figure, and the
main process's CPU time per image (where the Lightning loop's own work would show; the workers do the
same work in both) is the figure that the machine's load does not move much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cachebuild.storage.cache import write_cache
from loaders import CachedImageDataset, CacheSampler, collate_batch, device_loader
from loaders.transforms import IMAGENET_MEAN, IMAGENET_STD, Compose, Normalize

EPOCHS = 4  # per run; the last three are timed


def _cache(root: Path, n: int, size: int) -> Path:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    labels = np.arange(n) % 10
    write_cache(root, images, labels, [f"c{k}" for k in range(10)], storage="npy", shard_size=512, replace=True)
    return root


def _norm() -> Compose:
    return Compose([Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def ours(cache: Path, batch: int, workers: int) -> tuple[float, float]:
    ds = CachedImageDataset(cache)
    ds.ring_slots = 4 + 3
    sampler = CacheSampler(ds, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                                     collate_fn=collate_batch, persistent_workers=workers > 0,
                                     prefetch_factor=4 if workers else None,
                                     generator=torch.Generator().manual_seed(0))
    loader, tf = device_loader(dl, "cpu"), _norm()
    seen, spent, cpu, acc = 0, 0.0, 0.0, 0.0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        t0, c0, n = time.perf_counter(), time.process_time(), 0
        for x, y in loader:
            acc += float(tf(x).mean())
            n += len(y)
            sampler.advance(len(y))
        if epoch > 0:  # the first epoch starts the workers
            seen, spent, cpu = seen + n, spent + time.perf_counter() - t0, cpu + time.process_time() - c0
    return seen / spent, cpu / seen * 1e6  # ms per 1000 images


def lightning(cache: Path, batch: int, workers: int) -> tuple[float, float]:
    import lightning.pytorch as pl

    from loaders.lightning import CacheDataModule

    class Step(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.acc, self.n, self.t0, self.c0, self.seen, self.spent, self.cpu_s = 0.0, 0, 0.0, 0.0, 0, 0.0, 0.0

        def training_step(self, b: Any, i: int) -> None:
            self.acc += float(b[0].mean())
            self.n += len(b[1])

        def on_train_epoch_start(self) -> None:
            self.n, self.t0, self.c0 = 0, time.perf_counter(), time.process_time()

        def on_train_epoch_end(self) -> None:
            if self.current_epoch > 0:  # the first epoch starts the workers
                self.seen, self.spent = self.seen + self.n, self.spent + time.perf_counter() - self.t0
                self.cpu_s += time.process_time() - self.c0

        def configure_optimizers(self) -> Any:
            return None

    dm = CacheDataModule(cache, batch_size=batch, num_workers=workers, train_transform=_norm(), seed=0)
    model = Step()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, dm)
    return model.seen / model.spent, model.cpu_s / model.seen * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    runs: dict[str, list[float]] = {"ours": [], "lightning": []}
    cpu: dict[str, list[float]] = {"ours": [], "lightning": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = _cache(Path(tmp) / "cache", a.n, a.size)
        for r in range(a.rounds):
            for name, fn in (("ours", ours), ("lightning", lightning)) if r % 2 == 0 else (
                    ("lightning", lightning), ("ours", ours)):
                rate, cpu_ms = fn(cache, a.batch, a.workers)
                runs[name].append(rate)
                cpu[name].append(cpu_ms)
                print(f"round {r} {name:9s} {rate:8.0f} img/s  main-process CPU {cpu_ms:.3f} ms per 1000 img",
                      flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    pairs = [lt / o for lt, o in zip(runs["lightning"], runs["ours"], strict=True)]
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    result = {"config": vars(a) | {"out": str(a.out) if a.out else None}, "img_per_s": runs, "median": med,
              "ratio_of_medians": med["lightning"] / med["ours"], "ratio_per_round": pairs,
              "median_of_round_ratios": statistics.median(pairs),
              "main_cpu_ms_per_1000_img": cpu, "main_cpu_median": cpu_med}
    print(f"lightning / ours img/s: {result['ratio_of_medians']:.3f} (median of rounds "
          f"{result['median_of_round_ratios']:.3f}; per round: {', '.join(f'{x:.3f}' for x in pairs)})")
    print(f"main-process CPU ms per 1000 img (medians): ours {cpu_med['ours']:.1f}, "
          f"lightning {cpu_med['lightning']:.1f}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
