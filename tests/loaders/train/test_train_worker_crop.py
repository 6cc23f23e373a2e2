"""``cachebuild train --augment-in workers`` and ``--progressive``: crops in the loader's workers at a size
chosen per epoch, the device normalizing only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cachebuild.errors import OptionError
from cachebuild.storage.cache import write_cache
from loaders.train.cli import train
from loaders.train.config import TrainConfig, TrainSetupError
from loaders.train.data import build_data
from loaders.train.distributed import DistInfo
from tests.train_fixtures import CLASSES, _colour_images

CPU = DistInfo(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def colour(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("colour")
    tr, ytr = _colour_images(96, seed=0)
    va, yva = _colour_images(40, seed=1)
    write_cache(root / "train", tr, ytr, CLASSES, shard_size=40)
    write_cache(root / "val", va, yva, CLASSES, split="val")
    return {"train": root / "train", "val": root / "val"}


def test_it_learns_with_crops_in_the_workers_and_a_progressive_schedule(colour: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(train, [str(colour["train"]), "--val", str(colour["val"]), "--out", str(out),
                                     "--model", "tiny_cnn", "--epochs", "3", "--batch-size", "16", "--lr", "0.05",
                                     "--workers", "1", "--device", "cpu", "--amp", "off", "--augment", "imagenet",
                                     "--augment-in", "workers", "--progressive", "16:32:0:2"])
    assert res.exit_code == 0, res.output
    assert "progressive resizing: 16 px until epoch 0, 32 px from epoch 2" in res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_top1"] > 0.5, summary  # chance is 0.25
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["augment_in"] == "workers" and cfg["progressive"] == "16:32:0:2"


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_come_at_the_scheduled_size_and_only_get_normalized(colour: dict[str, Path], tmp_path: Path,
                                                                   workers: int) -> None:
    cfg = TrainConfig(train=str(colour["train"]), val=str(colour["val"]), out=str(tmp_path), model="linear",
                      batch_size=16, workers=workers, device="cpu", augment="imagenet",
                      augment_in="workers", progressive="16:24:0:1", epochs=2)
    data = build_data(cfg, CPU)
    sizes = []
    for epoch in range(2):
        data.sampler.set_epoch(epoch)
        batch = next(iter(data.loader))
        assert len(batch) == 2  # no boxes: every output pixel is inside the picture
        sizes.append(tuple(batch[0].shape[1:3]))
        x = data.train_tf(batch[0].permute(0, 3, 1, 2))
        assert batch[0].dtype == torch.float32 and x is not None and torch.equal(x, batch[0].permute(0, 3, 1, 2))
        # on a CPU the workers normalized too (the transform left is the identity): each value is a uint8 level
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        levels = (batch[0] * std + mean) * 255
        torch.testing.assert_close(levels, levels.round().clamp(0, 255), atol=1e-3, rtol=0)
        assert float(levels.std()) > 10  # pictures, not a constant
    assert sizes == [(16, 16), (24, 24)]
    assert data.val_loader is not None
    assert next(iter(data.val_loader))[0].shape[1:] == (32, 32, 3)  # eval at --crop (the cache's size)


def test_a_pad_cache_crops_inside_its_boxes_in_the_workers(tmp_path: Path) -> None:
    n, side = 24, 40
    images = np.zeros((n, side, side, 3), np.uint8)
    images[:, 10:30] = 200  # letterboxed: black bars above and below
    boxes = np.tile(np.array([10, 0, 30, side], np.int32), (n, 1))
    write_cache(tmp_path / "pad", images, np.arange(n) % 3, ["a", "b", "c"], boxes=boxes, fit="pad")
    cfg = TrainConfig(train=str(tmp_path / "pad"), out=str(tmp_path / "run"), model="linear", batch_size=8,
                      workers=2, device="cpu", augment="imagenet", augment_in="workers", crop=24)
    data = build_data(cfg, CPU)
    seen = 0
    for x, _ in data.loader:
        want = (200 / 255 - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
        assert x.shape[1:] == (24, 24, 3)  # normalized in the workers (a CPU run): no pixel of the bars
        torch.testing.assert_close(x, want.expand_as(x), atol=1e-5, rtol=0)
        seen += len(x)
    assert seen == n


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"progressive": "16:32"}, "add --augment-in workers"),
        ({"progressive": "16-32", "augment_in": "workers"}, "LOW:HIGH"),
        ({"progressive": "32:16", "augment_in": "workers"}, "LOW <= HIGH"),
        ({"augment_in": "gpu"}, "augment_in"),
    ],
)
def test_bad_settings_are_option_errors(tmp_path: Path, kw: dict[str, str], needle: str) -> None:
    with pytest.raises(OptionError, match=needle):
        TrainConfig(train="c", out=str(tmp_path), **kw)  # type: ignore[arg-type]


def test_cifar_preset_is_refused_in_the_workers(colour: dict[str, Path], tmp_path: Path) -> None:
    cfg = TrainConfig(train=str(colour["train"]), out=str(tmp_path), augment="cifar", augment_in="workers")
    with pytest.raises(TrainSetupError, match="--augment-in device"):
        build_data(cfg, CPU)
    res = CliRunner().invoke(train, [str(colour["train"]), "--out", str(tmp_path / "r"), "--progressive", "16:32"])
    assert res.exit_code == 2 and "--augment-in workers" in res.output


def test_the_new_options_take_their_choices_and_defaults_from_train_config() -> None:
    import click

    from loaders.train import config

    params = {p.name: p for p in train.params}
    assert isinstance(params["augment_in"].type, click.Choice)
    assert tuple(params["augment_in"].type.choices) == config.AUGMENT_IN
    assert params["augment_in"].default == "device" and params["progressive"].default is None
