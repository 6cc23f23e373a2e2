"""One arm of the ThreadLoader decode A/B: epochs of a compact (JPEG) cache through ThreadLoader's 2 threads, with
the code of the checkout named by $TREE.

    TREE=/path/to/checkout [RAW=1] python ab_jpeg.py    # prints img/s

A 2,048-sample synthetic 224 px jpeg cache (made once in /tmp/abjpeg-cache), batch 256; RandomResizedCrop(224)
+ flip + ImageNet normalize in the threads, or with RAW=1 whole uint8 samples; the median of 3 epochs after
the first. Run the two trees in alternating processes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ["TREE"])

from bench.scripts.worker_crop import _synthetic_cache
from loaders import transforms as T
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.sampler import CacheSampler
from loaders.thread_loader import ThreadLoader
from loaders.worker_crop import RandomResizedCrop

CACHE = Path("/tmp/abjpeg-cache")
if not (CACHE / "manifest.json").exists():
    _synthetic_cache(CACHE, 2048, 224, storage="jpeg")
opts: dict[str, Any] = {"in_memory": False}
if not os.environ.get("RAW"):
    opts.update(crop=RandomResizedCrop(224), flip=True, normalize=(T.IMAGENET_MEAN, T.IMAGENET_STD))
ds = CachedImageDataset(CACHE, DatasetOptions(**opts))
loader = ThreadLoader(ds, 256, sampler=CacheSampler(ds, seed=0), num_threads=2)
rates = []
for _ in range(4):
    t0 = time.perf_counter()
    n = sum(len(b[0]) for b in loader)
    rates.append(n / (time.perf_counter() - t0))
print(round(statistics.median(rates[1:])))
