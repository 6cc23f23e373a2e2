"""One arm of the normalize A/B: epochs to float batches of the tree named by $TREE (a checkout).

    TREE=/path/to/checkout python ab_norm.py    # prints {"dataloader": img/s, "threadloader": img/s}

A 2,048-sample synthetic 224 px npy cache (made once in /tmp/abnorm-cache), batch 256, RandomResizedCrop(224)
+ flip + ImageNet normalize in 2 DataLoader workers and in ThreadLoader's 2 threads; the median of 3 epochs
after the first. Run the two trees in alternating processes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.environ["TREE"])

from bench.scripts.worker_crop import _synthetic_cache
from loaders import transforms as T
from loaders.collate import collate_batch
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.sampler import CacheSampler
from loaders.thread_loader import ThreadLoader
from loaders.worker_crop import RandomResizedCrop

CACHE = Path("/tmp/abnorm-cache")
if not (CACHE / "manifest.json").exists():
    _synthetic_cache(CACHE, 2048, 224)
ds = CachedImageDataset(CACHE, DatasetOptions(crop=RandomResizedCrop(224), flip=True, in_memory=False,
                                              normalize=(T.IMAGENET_MEAN, T.IMAGENET_STD)))
loaders: dict[str, Any] = {
    "dataloader": torch.utils.data.DataLoader(ds, batch_size=256, sampler=CacheSampler(ds, seed=0), num_workers=2,
                                              collate_fn=collate_batch, persistent_workers=True, prefetch_factor=4),
    "threadloader": ThreadLoader(ds, 256, sampler=CacheSampler(ds, seed=0), num_threads=2),
}
out = {}
for name, loader in loaders.items():
    rates = []
    for _ in range(4):
        t0 = time.perf_counter()
        n = sum(len(b[0]) for b in loader)
        rates.append(n / (time.perf_counter() - t0))
    out[name] = round(statistics.median(rates[1:]))
print(json.dumps(out))
