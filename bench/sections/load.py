"""Load section: shuffled epochs of batches delivered to the training loop, raw and augmented.

Two groups run one after the other. "raw": fixed-size uint8 batches (what a cache stores; JPEG
pipelines decode + resize + centre-crop). "augmented": the standard training augmentation
(RandomResizedCrop + flip + normalize), each contender its own usual way (per sample in the workers
for JPEG pipelines and the naive cache; on the whole batch for cachebuild, here on the CPU, in the main
process: its transforms are made for the GPU; and per sample in cachebuild's DataLoader workers, the
normalize on the batch or fused there too). Within a
group our contenders run interleaved epoch by epoch (the machine's speed drifts); each has one warm-up
epoch (worker start-up, page faults, lazy imports), left out; the others give median and min-max.
Peers run in their venvs after ours, with the same epochs. Every cache is in the page cache (warm).
Limits: a bare memmap gather of the same bytes (1 thread), and bare JPEG decoding with the same workers,
run as epochs in the raw group's interleaving like any contender. Each timed epoch starts with the
harness's heap collected and frozen (see ``_heap_frozen``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from bench import peers
from bench.children import ChildError, run_child
from bench.stats import ratio, summary

__all__ = ["COPY_BOUND", "run_load"]

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
Epoch = Callable[[], Iterable[Any]]
# Rows bound by memory copies, measured again without GLIBC_TUNABLES when the run has it (bench.sections.load_child)
COPY_BOUND = ("cachebuild_npy_dataloader",)


class NaiveNpy(Dataset):
    """The naive cache as people write it: ``np.load`` the saved array, index it per sample."""

    def __init__(self, folder: Path, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.path = folder / "images.npy"
        self.labels = np.load(folder / "labels.npy")
        self.transform = transform
        self.images: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.images is None:
            self.images = np.load(self.path, mmap_mode="r")
        x = torch.from_numpy(np.array(self.images[i]))  # a copy: the map is read-only
        if self.transform is not None:
            x = self.transform(x.permute(2, 0, 1))
        return x, int(self.labels[i])


class JpegBytes(Dataset):
    """Bare decode of the JPEGs (the limit of JPEG pipelines): cv2.imdecode, nothing else."""

    def __init__(self, files: list[tuple[str, int]]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[int, int]:
        import cv2

        with open(self.files[i][0], "rb") as f:
            img = cv2.imdecode(np.frombuffer(f.read(), np.uint8), cv2.IMREAD_COLOR)
        if img is None:
            raise ValueError(f"{self.files[i][0]}: cv2.imdecode could not decode it")
        return img.shape[0], self.files[i][1]


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The harness's own heap out of a timed epoch: collected before the clock, then frozen so that a full
    collection inside the epoch scans only what the contender allocates (a full scan of this process's heap
    takes ~170 ms, more than a 5000-sample epoch of a fast loader). Every contender and limit alike."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _count(make: Epoch) -> tuple[int, float]:
    seen = 0
    with _heap_frozen():
        t0 = time.perf_counter()
        for batch in make():
            seen += len(batch[0])
        return seen, time.perf_counter() - t0


def _interleaved(contenders: dict[str, Epoch], n: int, epochs: int, log: Callable[[str], None]) -> dict[str, list]:
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for e in range(epochs + 1):
        for key, make in contenders.items():
            seen, dt = _count(make)
            if seen != n:
                raise RuntimeError(f"{key}: an epoch delivered {seen} samples, expected {n}")
            if e:  # epoch 0 is the warm-up
                rates[key].append(seen / dt)
        if e:
            log(f"  epoch {e}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()))
    return rates


def _loaders(cfg: dict[str, Any], src: Path, outputs: dict[str, Path], aug: bool) -> dict[str, tuple[str, Epoch]]:
    import torchvision
    import torchvision.transforms as T
    from torchvision.transforms import v2

    from loaders import transforms as CT
    from loaders.dataset import CachedImageDataset, collate_batch
    from loaders.device import device_loader
    from loaders.sampler import CacheSampler

    s, b, w = cfg["size"], cfg["batch"], cfg["workers"]
    kw: dict[str, Any] = {"num_workers": w, "persistent_workers": w > 0}
    out: dict[str, tuple[str, Epoch]] = {}

    def plain(ds: Dataset, **extra: Any) -> Epoch:
        dl = DataLoader(ds, batch_size=b, shuffle=True, **kw, **extra)
        return lambda: dl

    if aug:
        tf1 = T.Compose([T.RandomResizedCrop(s), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    else:
        tf1 = T.Compose([T.Resize(s), T.CenterCrop(s), T.PILToTensor()])
    out["imagefolder_pil"] = ("1. ImageFolder + PIL " + ("RandomResizedCrop + flip + ToTensor + Normalize" if aug
                              else "Resize + CenterCrop"), plain(torchvision.datasets.ImageFolder(str(src), tf1)))
    fixed = torchvision.datasets.ImageFolder(str(src), T.Compose([T.Resize((s, s)), T.PILToTensor()]))
    scripted_dl = plain(fixed)
    if aug:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated from torch 2.14: the classic recipe
            scripted = torch.jit.script(torch.nn.Sequential(
                T.RandomHorizontalFlip(), T.ConvertImageDtype(torch.float32), T.Normalize(MEAN, STD)))

        def scripted_epoch() -> Iterable[Any]:
            return ((scripted(x), y) for x, y in scripted_dl())
        out["scriptable"] = ("2. seed-style: PIL Resize((S, S)) in workers, scripted v1 flip + ConvertImageDtype + "
                             "Normalize on the batch", scripted_epoch)
    else:
        out["scriptable"] = ("2. seed-style: PIL Resize((S, S)) + PILToTensor in workers", scripted_dl)
    if "naive_npy" in outputs:
        per_sample = v2.Compose([v2.RandomResizedCrop(s, antialias=True), v2.RandomHorizontalFlip(),
                                 v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]) if aug else None
        out["naive_npy"] = ("3. naive npy cache: np.load(mmap) + per-sample __getitem__, default collate" +
                            (", torchvision v2 augmentation per sample" if aug else ""),
                            plain(NaiveNpy(outputs["naive_npy"], per_sample)))
    for storage in ("npy", "zarr", "jpeg"):
        key = f"cachebuild_{storage}"
        if key not in outputs or (aug and storage == "zarr"):
            continue  # augmented: npy and jpeg, as the same transform on zarr's batches adds time, not information
        ds = CachedImageDataset(outputs[key])
        sampler = CacheSampler(ds, shuffle=True, seed=0)
        epoch_no = [0]
        tf = CT.imagenet_train(s) if aug else None

        def via(loader: Any, tf: Any = tf, sampler: Any = sampler, epoch_no: list = epoch_no) -> Epoch:
            def epoch() -> Iterable[Any]:
                epoch_no[0] += 1
                sampler.set_epoch(epoch_no[0])
                batches = device_loader(loader, "cpu")
                return batches if tf is None else ((tf(x), y) for x, y in batches)
            return epoch

        what = ", imagenet_train() on the batch (CPU, eager)" if aug else ""
        dl = DataLoader(ds, batch_size=b, sampler=sampler, collate_fn=collate_batch, **kw)
        out[f"{key}_dataloader"] = (f"4. cachebuild {storage}: DataLoader + collate_batch, {w} workers{what}", via(dl))
        if storage == "npy" and not aug:
            dl_plain = DataLoader(ds, batch_size=b, sampler=sampler, **kw)
            out[f"{key}_dataloader_plain"] = (f"4. cachebuild {storage}: plain DataLoader (no collate_fn), {w} workers"
                                              f"{what}", via(dl_plain))
        if aug:
            out.update(_crop_in_workers(key, storage, outputs[key], cfg, via))
    return out


def _crop_in_workers(key: str, storage: str, cache: Path, cfg: dict[str, Any],
                     via: Callable[..., Epoch]) -> dict[str, tuple[str, Epoch]]:
    """The augmented load with RandomResizedCrop + flip per sample in the DataLoader's workers, straight
    from the stored sample into the batch (``CachedImageDataset(crop=..., flip=True)``), then Normalize on the
    batch in the main process; and the same with the normalize fused in the workers too (``normalize=``:
    float32 batches out of the workers, FFCV's place for all of this work, what the peers' rows deliver)."""
    from loaders import transforms as CT
    from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
    from loaders.sampler import CacheSampler
    from loaders.worker_crop import RandomResizedCrop

    s, b, w = cfg["size"], cfg["batch"], cfg["workers"]
    norm = CT.Normalize(CT.IMAGENET_MEAN, CT.IMAGENET_STD)
    ds = CachedImageDataset(cache, DatasetOptions(crop=RandomResizedCrop(s), flip=True, seed=0))
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    what = ", RandomResizedCrop + flip in the workers (crop=), Normalize on the batch"
    dl = DataLoader(ds, batch_size=b, sampler=sampler, collate_fn=collate_batch, num_workers=w,
                    persistent_workers=w > 0)
    fds = CachedImageDataset(cache, DatasetOptions(crop=RandomResizedCrop(s), flip=True, seed=0,
                                                   normalize=(CT.IMAGENET_MEAN, CT.IMAGENET_STD)))
    fsampler = CacheSampler(fds, shuffle=True, seed=0)
    fdl = DataLoader(fds, batch_size=b, sampler=fsampler, collate_fn=collate_batch, num_workers=w,
                     persistent_workers=w > 0)
    fused = ", RandomResizedCrop + flip + Normalize in the workers (crop=, normalize=), float32 out"
    return {f"{key}_crop_in_workers": (f"4. cachebuild {storage}: DataLoader + collate_batch, {w} workers" + what,
                                       via(dl, norm, sampler, [0])),
            f"{key}_fused_in_workers": (f"4. cachebuild {storage}: DataLoader + collate_batch, {w} workers" + fused,
                                        via(fdl, None, fsampler, [0]))}


def _bare_gather(path: Path, batch: int) -> Epoch:
    """numpy fancy index of the memmapped shards at each batch's sorted indices, one thread: the limit.
    An epoch like the contenders', so it runs interleaved with them (the machine's state between epochs
    is then the same for the limit as for what is divided by it)."""
    from cachebuild.storage.cache import open_cache

    reader = open_cache(path)
    starts = reader.images.file_bounds()
    n = reader.manifest.count
    # plain numpy memory maps of the npy shards: the limit owes nothing to cachebuild's reader
    shards = [np.load(path / s.file, mmap_mode="r") for s in reader.manifest.shards]
    rng = np.random.default_rng(0)

    def epoch() -> Iterable[Any]:
        order = rng.permutation(n)
        for i in range(0, n, batch):
            idx = np.sort(order[i : i + batch])
            shard_of = np.searchsorted(starts, idx, side="right") - 1
            for k in np.unique(shard_of):
                shards[k][idx[shard_of == k] - starts[k]]  # the copy, dropped at once as a loop over it would
            yield (idx,)
    return epoch


def _limits(cfg: dict[str, Any], files: list[tuple[str, int]],
            outputs: dict[str, Path]) -> dict[str, tuple[str, Epoch]]:
    """The load limits, as epochs run in the raw group's interleaving."""
    out: dict[str, tuple[str, Epoch]] = {}
    if "cachebuild_npy" in outputs:
        out["limit_bare_gather"] = ("limit: bare memmap gather, 1 thread (numpy fancy index)",
                                    _bare_gather(outputs["cachebuild_npy"], cfg["batch"]))
    dl = DataLoader(JpegBytes(files), batch_size=cfg["batch"], shuffle=True, num_workers=cfg["workers"],
                    collate_fn=lambda b: (b,), persistent_workers=cfg["workers"] > 0)
    out["limit_bare_decode"] = (f"limit: bare cv2.imdecode of the JPEGs, {cfg['workers']} workers", lambda: dl)
    return out


GLIBC_DEFAULT = "_glibc_default"


def _glibc_default_rows(cfg: dict[str, Any], src: Path, cache: Path, rows: dict[str, Any],
                        log: Callable[[str], None]) -> None:
    """The copy-bound rows and their limit again in a child without GLIBC_TUNABLES: what a job gets without it."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    cmd = [sys.executable, "-m", "bench.sections.load_child", "--src", str(src), "--cache", str(cache),
           *[x for k in ("size", "batch", "workers", "epochs") for x in (f"--{k}", str(cfg[k]))]]
    ans, _ = run_child(cmd, timeout=cfg["child_timeout"], env=env, cwd=str(Path(__file__).resolve().parents[2]))
    for key, r in ans.items():
        label = rows[key]["label"] if key in rows else key
        rows[key + GLIBC_DEFAULT] = {"label": f"{label}, glibc's default copy threshold (a process without "
                                              "GLIBC_TUNABLES)", "img_s": summary(r, 1)}
    log("  without GLIBC_TUNABLES: " + ", ".join(f"{k} {v['img_s']['median']:.0f}" for k, v in rows.items()
                                                 if k.endswith(GLIBC_DEFAULT)))


def run_load(cfg: dict[str, Any], src: Path, files: list[tuple[str, int]], outputs: dict[str, Path],
             log: Callable[[str], None], files_json: Path | None = None) -> dict[str, Any]:
    n, epochs = len(files), cfg["epochs"]
    sample_bytes = cfg["size"] ** 2 * 3
    for cache in outputs.values():  # every cache in the page cache
        for f in cache.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(16 << 20):
                        pass
    result: dict[str, Any] = {"images": n, "batch": cfg["batch"], "workers": cfg["workers"], "epochs": epochs,
                              "warmup_epochs": 1, "page_cache": "warm", "groups": {}}
    skipped: dict[str, str] = {}
    peer_loads = peers.load_contenders(cfg, outputs, skipped, files_json)
    peer_epochs: dict[str, dict[str, list[float]]] = {}  # key -> group -> epochs, both from one child
    for group in ("raw", "augmented"):
        aug = group == "augmented"
        log(f"load: {group}")
        loaders = _loaders(cfg, src, outputs, aug)
        if not aug:
            loaders.update(_limits(cfg, files, outputs))
        rates = _interleaved({k: v[1] for k, v in loaders.items()}, n, epochs, log)
        rows: dict[str, dict[str, Any]] = {k: {"label": loaders[k][0], "img_s": summary(v, 1)}
                                           for k, v in rates.items()}
        del loaders
        gc.collect()
        if not aug and os.environ.get("GLIBC_TUNABLES") and "cachebuild_npy" in outputs:
            _glibc_default_rows(cfg, src, outputs["cachebuild_npy"], rows, log)
        for p in peer_loads:
            if not aug:  # runs the peer's raw and augmented loaders, after our raw group
                try:
                    ans, _ = run_child(p["command"](epochs + 1), timeout=cfg["child_timeout"])
                    peer_epochs[p["key"]] = ans["groups"]
                except ChildError as e:
                    skipped[p["key"]] = str(e).splitlines()[0]
                    log(f"  {p['key']}: FAILED {e}")
            if p["key"] in peer_epochs:
                rows[p["key"]] = {"label": p["label"], "img_s": summary(peer_epochs[p["key"]][group][1:], 1)}
                log(f"  {p['key']}: {rows[p['key']]['img_s']['median']:.0f} img/s")
        base = rows.get("imagefolder_pil", {}).get("img_s")
        gather = rows.get("limit_bare_gather", {}).get("img_s")
        default_gather = rows.get(f"limit_bare_gather{GLIBC_DEFAULT}", {}).get("img_s")
        for key, r in rows.items():
            r["x_imagefolder"] = ratio(r["img_s"], base)
            r["gb_s"] = round(r["img_s"]["median"] * sample_bytes / 1e9, 2) if not aug else None
            limit = default_gather if key.endswith(GLIBC_DEFAULT) else gather  # each against its own process's
            if limit is not None:
                r["x_bare_gather"] = ratio(r["img_s"], limit)
        result["groups"][group] = rows
    result["skipped"] = skipped
    return result
