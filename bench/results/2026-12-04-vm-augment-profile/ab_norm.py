import sys, time, statistics, json, tempfile, os
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, os.environ["TREE"])
from bench.scripts.worker_crop import _synthetic_cache
from loaders import transforms as T
from loaders.collate import collate_batch
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.sampler import CacheSampler
from loaders.thread_loader import ThreadLoader
from loaders.worker_crop import RandomResizedCrop
cache = Path("/tmp/abnorm-cache")
if not (cache / "manifest.json").exists():
    _synthetic_cache(cache, 2048, 224)
ds = CachedImageDataset(cache, DatasetOptions(crop=RandomResizedCrop(224), flip=True, in_memory=False, normalize=(T.IMAGENET_MEAN, T.IMAGENET_STD)))
dl = torch.utils.data.DataLoader(ds, batch_size=256, sampler=CacheSampler(ds, seed=0), num_workers=2, collate_fn=collate_batch, persistent_workers=True, prefetch_factor=4)
tl = ThreadLoader(ds, 256, sampler=CacheSampler(ds, seed=0), num_threads=2) if "num_threads" in ThreadLoader.__init__.__code__.co_varnames else ThreadLoader(ds, 256, sampler=CacheSampler(ds, seed=0))
out = {}
for name, L in (("dataloader", dl), ("threadloader", tl)):
    r = []
    for e in range(4):
        t0 = time.perf_counter(); n = sum(len(b[0]) for b in L); r.append(n / (time.perf_counter() - t0))
    out[name] = round(statistics.median(r[1:]))
print(json.dumps(out))
