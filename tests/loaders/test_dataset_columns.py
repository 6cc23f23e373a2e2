"""Columns in the loaders: ``DatasetOptions(columns=)`` carried with every sample and batch (DataLoader with
and without ``collate_batch``, with and without workers, Lightning), ``labels=`` a relabelled or soft column,
MixUp/CutMix on soft labels, and ``cachebuild train --labels``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cachebuild.errors import CacheCorruptError
from cachebuild.storage.columns import add_column
from loaders.collate import collate_batch
from loaders.dataset import CachedImageDataset, DatasetOptions
from loaders.transforms import CutMix, MixUp, MixUpCutMix
from tests.loaders_fixtures import make_cache

N = 40


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_cache(tmp_path_factory.mktemp("cols") / "c", n=N, shard_size=16, boxes=True)[0]
    files = root.parent
    rng = np.random.default_rng(1)
    soft = rng.random((N, 5)).astype(np.float32)
    np.save(files / "soft.npy", soft / soft.sum(1, keepdims=True))
    np.save(files / "relabel.npy", (np.arange(N) + 1) % 5)
    np.save(files / "score.npy", np.arange(N, dtype=np.float64) / 4)
    np.save(files / "bad.npy", np.arange(N) + 10)
    for name in ("soft", "relabel", "score", "bad"):
        add_column(root, name, files / f"{name}.npy")
    return root


def _want(cache: Path, name: str) -> np.ndarray:
    return np.load(cache.parent / f"{name}.npy")


def test_columns_come_with_samples_and_every_loaders_batches(cache: Path) -> None:
    ds = CachedImageDataset(cache, DatasetOptions(columns=["score", "soft"], return_boxes=True))
    _img, label, box, score, soft = ds[7]
    assert float(score) == 7 / 4 and torch.equal(soft, torch.from_numpy(_want(cache, "soft")[7]))
    assert label == int(np.load(cache / "labels.npy")[7]) and box.shape == (4,)
    loaders = {
        "workers": DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate_batch),
        "default_collate": DataLoader(ds, batch_size=8, num_workers=0),
        "main_process": DataLoader(ds, batch_size=8, num_workers=0, collate_fn=collate_batch),
    }
    for name, dl in loaders.items():
        seen = []
        for images, labels, boxes, scores, softs in dl:
            seen += (scores * 4).long().tolist()
            idx = (scores * 4).long().numpy()
            assert softs.shape == (len(idx), 5) and softs.dtype == torch.float32, name
            np.testing.assert_array_equal(softs.numpy(), _want(cache, "soft")[idx])
            np.testing.assert_array_equal(labels.numpy(), np.load(cache / "labels.npy")[idx])
            assert images.shape[0] == boxes.shape[0] == len(idx)
        assert sorted(seen) == list(range(N)), name


def test_a_column_as_the_labels_relabelled_or_soft(cache: Path) -> None:
    relabel = CachedImageDataset(cache, DatasetOptions(labels="relabel"))
    np.testing.assert_array_equal(relabel.labels, (np.arange(N) + 1) % 5)
    assert relabel[3][1] == 4
    soft = CachedImageDataset(cache, DatasetOptions(labels="soft"))
    _x, y = next(iter(DataLoader(soft, batch_size=6, num_workers=1, collate_fn=collate_batch)))
    assert y.shape == (6, 5) and torch.allclose(y, torch.from_numpy(_want(cache, "soft")[:6]))
    with pytest.raises(ValueError, match=r"labels in \[10, 49\], the cache has 5 classes"):
        CachedImageDataset(cache, DatasetOptions(labels="bad"))
    with pytest.raises(ValueError, match="soft labels"):
        CachedImageDataset(cache, DatasetOptions(labels="score"))
    with pytest.raises(CacheCorruptError, match=r"has no column 'nope'.*cachebuild columns add"):
        CachedImageDataset(cache, DatasetOptions(columns=["nope"]))
    with pytest.raises(ValueError, match="twice"):
        DatasetOptions(columns=["soft", "soft"])


@pytest.mark.parametrize("mix", [MixUp, CutMix, MixUpCutMix])
def test_soft_labels_mix_as_the_one_hot_rows_they_stand_for(mix: type) -> None:
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    labels = torch.tensor([0, 3, 1, 4, 2, 2])
    kw = {"label_smoothing": 0.1}
    a = mix(num_classes=5, generator=torch.Generator().manual_seed(3), **kw)
    b = mix(num_classes=5, generator=torch.Generator().manual_seed(3), **kw)
    xa, ta = a(images, labels)
    xb, tb = b(images, torch.nn.functional.one_hot(labels, 5).float())
    assert torch.equal(xa, xb) and torch.allclose(ta, tb)
    off, on = 0.1 / 5, 0.9 + 0.1 / 5
    lam = (ta[0, 0] - off) / (on - off)  # sample 0 (class 0) with its partner 5 (class 2)
    soft = torch.rand(6, 5)
    soft /= soft.sum(1, keepdim=True)
    _, t = mix(num_classes=5, generator=torch.Generator().manual_seed(3), **kw)(images, soft)
    smoothed = soft * 0.9 + off
    assert torch.allclose(t, lam * smoothed + (1 - lam) * smoothed.roll(1, 0), atol=1e-6)
    assert torch.allclose(t.sum(1), torch.ones(6))
    with pytest.raises(ValueError, match=r"soft labels must be float \[6, 5\]"):
        a(images, torch.rand(6, 4))


def test_lightning_keeps_columns_after_the_boxes_are_used(cache: Path) -> None:
    pytest.importorskip("lightning")
    from loaders.lightning import CacheDataModule

    dm = CacheDataModule(cache, batch_size=4, num_workers=0, return_boxes=True,
                         val_transform=lambda x, boxes: x.float() * (boxes[:, 2:3, None, None] > 0),
                         dataset_options=DatasetOptions(columns=["score"]))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert len(batch) == 4  # images, labels, boxes, score
    dm.trainer = None
    x, _y, score = dm.on_after_batch_transfer(batch, 0)  # no trainer: the val transform takes the boxes
    assert x.shape[1] == 3 and x.dtype == torch.float32 and score.dtype == torch.float64
    assert torch.equal(score, batch[3])


def test_train_on_soft_labels_with_mixup_and_cutmix(cache: Path, tmp_path: Path) -> None:
    from loaders.train import TrainConfig, fit
    from loaders.train.data import _open_caches

    cfg = TrainConfig(train=str(cache), val=str(cache), out=str(tmp_path), model="linear", epochs=1, batch_size=8,
                      workers=0, device="cpu", amp="off", labels="soft", mixup=0.4, cutmix=1.0,
                      label_smoothing=0.1, augment="none")
    train_ds, val_ds = _open_caches(cfg)
    assert train_ds.labels.shape == (N, 5) and val_ds.labels.shape == (N, 5)  # the val cache has it too
    fit(cfg, echo=lambda _msg: None)
    import json

    last = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert np.isfinite(last.get("val_loss", last.get("loss", np.nan)))


@pytest.mark.parametrize(("column", "said"), [("bad", "Error: --labels bad: column 'bad' holds labels in [10, 49], "
                                                       "the cache has 5 classes; relabel within [0, 4]"),
                                              ("score", "Error: --labels score: column 'score' is float64[40]"),
                                              ("missing", "has no column 'missing'")])
def test_train_labels_that_cannot_be_labels_are_one_line(cache: Path, tmp_path: Path, column: str, said: str) -> None:
    from click.testing import CliRunner

    from loaders.train.cli import train

    r = CliRunner().invoke(train, [str(cache), "--labels", column, "--out", str(tmp_path / "run"), "--model",
                                   "linear", "--device", "cpu", "--workers", "0", "--amp", "off"])
    assert r.exit_code == 1 and r.exc_info is not None and r.exc_info[0] is SystemExit, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and said in lines[0], r.output
    assert not (tmp_path / "run").exists()
