"""loaders.lightning.CacheDataModule under a real lightning.Trainer on CPU: one process, and two (DDP on
gloo, 127.0.0.1): every sample of an epoch seen once across ranks, in our sampler's order, device
transforms and MixUp in ``on_after_batch_transfer``, and resume mid-epoch from a Lightning checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from loaders.dataset import DatasetOptions
from loaders.lightning import CacheDataModule, DistributedCacheSampler
from loaders.sampler import CacheSampler
from loaders.transforms import Compose, MixUpCutMix, Normalize
from tests.lightning_run import fit
from tests.loaders_fixtures import make_cache
from tests.repo import REPO

# lightning 2.6 on torch 2.14: its pytree use warns of a torch deprecation, nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("lightning")
    train, _, _ = make_cache(base / "train", n=50)
    val, _, _ = make_cache(base / "val", n=13)
    return train, val


def _flat(seen: list) -> list[int]:
    return [i for _, batch in seen for i in batch]


def test_sampler_is_kept_by_lightning_and_matches_cache_sampler() -> None:
    s = DistributedCacheSampler(range(50), seed=3, num_replicas=2, rank=1)
    assert isinstance(s, DistributedSampler) and isinstance(s, CacheSampler)
    ref = CacheSampler(range(50), seed=3, num_replicas=2, rank=1)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        ref.set_epoch(epoch)
        assert list(s) == list(ref) and len(s) == 25
    s.set_position(10)
    assert len(s) == 25 and len(list(s)) == 15  # len is the whole epoch; iter what is left


def test_one_process_epochs_follow_the_sampler_order(caches: tuple[Path, Path]) -> None:
    train, val = caches
    dm = CacheDataModule(train, val, batch_size=8, num_workers=0, seed=3)
    model = fit(dm, epochs=2)
    assert [e for e, _ in model.seen] == [0] * 7 + [1] * 7
    ref = CacheSampler(range(50), seed=3)
    for epoch in (0, 1):
        got = [i for e, b in model.seen if e == epoch for i in b]
        assert got == ref.rank_indices(epoch).tolist()  # the epoch Lightning set, our order
    assert Counter(model.val_seen) == Counter(list(range(13)) * 2)  # one val pass per epoch, every sample


def test_device_transforms_and_mix_run_after_transfer(caches: tuple[Path, Path]) -> None:
    train, val = caches
    norm = Compose([Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
    g = torch.Generator().manual_seed(0)
    dm = CacheDataModule(train, val, batch_size=8, num_workers=1, train_transform=norm,
                         val_transform=Compose([Normalize((0.5,) * 3, (0.5,) * 3)]),
                         mix=MixUpCutMix(5, generator=g), seed=1)
    assert dm.num_classes == 5
    model = fit(dm, epochs=1)
    assert len(model.batches) == 7
    for x_dtype, x_shape, y_dtype, y_shape in model.batches:
        assert x_dtype == torch.float32 and x_shape[1:] == (3, 8, 6)  # NCHW, normalised
        assert y_dtype == torch.float32 and y_shape == (x_shape[0], 5)  # soft targets
    assert model.batches[-1][1][0] == 2  # the short last batch (50 = 6 * 8 + 2)
    assert model.seen == []  # no uint8 batch reached the step


def test_resume_mid_epoch_continues_with_the_rest(caches: tuple[Path, Path], tmp_path: Path) -> None:
    train, val = caches
    full = fit(CacheDataModule(train, val, batch_size=8, num_workers=0, seed=5), tmp_path / "a", save_every=3)
    ckpt = tmp_path / "a" / "step=3.ckpt"
    assert ckpt.exists()
    state = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["epoch"] == 0 and state["position"] == 24  # 3 batches of 8 consumed
    resumed = fit(CacheDataModule(train, val, batch_size=8, num_workers=0, seed=5), ckpt=str(ckpt))
    assert _flat(resumed.seen) == _flat(full.seen)[24:]
    assert [e for e, _ in resumed.seen] == [0] * 4 + [1] * 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp(cache: Path, out: Path, *extra: str) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-W", "ignore", str(REPO / "tests" / "lightning_run.py"), str(cache), str(out),
           "--devices", "2", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_ddp_two_ranks_every_sample_once_and_resume(caches: tuple[Path, Path], tmp_path: Path) -> None:
    """Two processes on gloo, twice (a run and its resume): ~130 s on this shared 2-core box, hence slow."""
    train, val = caches
    runs = _ddp(train, tmp_path / "a", "--val", str(val), "--save-every", "3")
    assert all(r["world"] == 2 for r in runs)
    for epoch in (0, 1):
        per_rank = [[i for e, b in r["seen"] if e == epoch for i in b] for r in runs]
        assert len(per_rank[0]) == len(per_rank[1]) == 25  # no DistributedSampler on top of ours
        assert Counter(per_rank[0] + per_rank[1]) == Counter(range(50))  # every sample exactly once
        ref = [CacheSampler(range(50), seed=3, num_replicas=2, rank=r).rank_indices(epoch).tolist() for r in (0, 1)]
        assert per_rank == ref
    # val: 13 samples over 2 ranks, padded to 14 (sample 0 twice), once per epoch
    assert Counter(runs[0]["val"] + runs[1]["val"]) == Counter(list(range(13)) * 2 + [0, 0])
    ckpt = tmp_path / "a" / "step=3.ckpt"
    resumed = _ddp(train, tmp_path / "b", "--val", str(val), "--ckpt", str(ckpt))
    for r in (0, 1):
        assert _flat(resumed[r]["seen"]) == _flat(runs[r]["seen"])[12:]  # 3 steps of 4 per rank done


def test_after_transfer_is_a_view_without_a_transform(caches: tuple[Path, Path]) -> None:
    dm = CacheDataModule(caches[0], batch_size=4, num_workers=0)
    x, y = torch.zeros(4, 8, 6, 3, dtype=torch.uint8), torch.arange(4)
    out, labels = dm.on_after_batch_transfer((x, y), 0)
    assert out.data_ptr() == x.data_ptr() and out.shape == (4, 3, 8, 6)  # NCHW view: the module adds no copy
    assert out.is_contiguous(memory_format=torch.channels_last) and labels is y


def test_no_val_cache_means_no_val_loop(caches: tuple[Path, Path]) -> None:
    dm = CacheDataModule(caches[0], batch_size=16, num_workers=0)
    with pytest.warns(UserWarning, match="no `val_dataloader`. Skipping val loop"):
        model = fit(dm, epochs=1)
    assert model.val_seen == [] and len(_flat(model.seen)) == 50
    from lightning.pytorch.utilities.model_helpers import is_overridden

    again = pickle.loads(pickle.dumps(CacheDataModule(caches[0], num_workers=0)))  # as ddp_spawn sends it
    assert not is_overridden("val_dataloader", again)
    assert is_overridden("val_dataloader", pickle.loads(pickle.dumps(CacheDataModule(*caches, num_workers=0))))


def test_bad_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cache folder, a cache URL or a CachedImageDataset"):
        CacheDataModule(np.zeros(3)).setup()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        CacheDataModule(tmp_path, batch_size=0)


def test_dataset_options_open_both_caches(caches: tuple[Path, Path]) -> None:
    options = DatasetOptions(in_memory=True, ring_slots=2)
    dm = CacheDataModule(*caches, num_workers=0, return_boxes=True, dataset_options=options)
    dm.setup()
    assert dm.train_ds is not None and dm.val_ds is not None
    for ds in (dm.train_ds, dm.val_ds):  # the module's return_boxes joins the options given
        assert ds.in_memory and ds.return_boxes and ds.ring_slots == 2
    assert not options.return_boxes  # the caller's value is left as it was
