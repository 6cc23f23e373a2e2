"""NVIDIA DALI as a contender, its CPU pipeline (C++ threads, no Python per sample): from the JPEG files
(``--files``: decoded every epoch, DALI has no cache writer) or from a cachebuild npy cache (``--data``).
Run by the DALI venv's python (bench.peers); see bench.peers.SETTINGS for the settings and why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MEAN, STD, files, load_groups, parse, time_epochs


def _augment(fn, types, images, size: int, decoded: bool):
    """DALI's ResNet-50 training recipe on the CPU: random-area crop (fused into the decoder for JPEGs),
    resize, then one fused crop + mirror + normalize to float CHW."""
    if not decoded:
        images = fn.random_resized_crop(images, size=(size, size))
    else:
        images = fn.resize(images, resize_x=size, resize_y=size)
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mirror=fn.random.coin_flip(),
                                    mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD])


def _jpeg_pipeline(a, aug: bool):
    from nvidia.dali import fn, pipeline_def, types

    items = files(a.files)

    @pipeline_def(batch_size=a.batch, num_threads=a.workers, device_id=None, seed=0, prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(files=[p for p, _ in items], labels=[k for _, k in items],
                                        random_shuffle=True, name="reader")
        if aug:
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
            return _augment(fn, types, images, a.size, decoded=True), labels
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=a.size)
        return fn.crop(images, crop=(a.size, a.size)), labels  # centre crop: uint8 HWC, what a cache stores

    return pipe(), len(items)


class _CacheBatches:
    """A cachebuild npy cache read without the project: the manifest's shards memory-mapped, one shuffled
    batch gathered per call (sorted indices within the batch, as the cache's own sampler does)."""

    def __init__(self, folder: Path, batch: int) -> None:
        import numpy as np

        m = json.loads((folder / "manifest.json").read_text())
        self.shards = [np.load(folder / s["file"], mmap_mode="r") for s in m["shards"]]
        self.starts = np.array([s["start"] for s in m["shards"]])
        self.labels = np.load(folder / "labels.npy")
        self.n, self.batch = int(m["count"]), batch
        self.order = np.arange(self.n)

    def __call__(self, info):
        import numpy as np

        if info.iteration == 0:  # a new epoch: a new order
            self.order = np.random.default_rng(info.epoch_idx).permutation(self.n)
        idx = np.sort(self.order[info.iteration * self.batch : (info.iteration + 1) * self.batch])
        if not len(idx):
            raise StopIteration
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        images = [self.shards[k][i - self.starts[k]] for k, i in zip(shard, idx, strict=True)]
        return images, [self.labels[idx].astype(np.int32)[j : j + 1] for j in range(len(idx))]


def _cache_pipeline(a, aug: bool):
    from nvidia.dali import fn, pipeline_def, types

    source = _CacheBatches(a.data, a.batch)

    @pipeline_def(batch_size=a.batch, num_threads=a.workers, device_id=None, seed=0, prefetch_queue_depth=2)
    def pipe():
        images, labels = fn.external_source(source=source, num_outputs=2, batch=True, batch_info=True,
                                            layout=["HWC", ""], dtype=[types.UINT8, types.INT32])
        return (_augment(fn, types, images, a.size, decoded=False) if aug else images), labels

    return pipe(), source.n


def _epochs(a, aug: bool) -> list[float]:
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    pipe, n = _cache_pipeline(a, aug) if a.mode == "cache" else _jpeg_pipeline(a, aug)
    # the file reader knows the epoch's length; the cache source ends it with StopIteration (the last batch short)
    kw = {"reader_name": "reader"} if a.mode != "cache" else {}
    it = DALIGenericIterator(pipe, ["data", "label"], last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True,
                             **kw)
    return time_epochs(lambda: ((d[0]["data"], d[0]["label"]) for d in it), a.epochs, n)


if __name__ == "__main__":
    args = parse()
    if args.what == "build":
        raise SystemExit("DALI has no cache writer: it decodes the JPEGs every epoch")
    load_groups(args, lambda aug: _epochs(args, aug))
