"""BuildOptions and TrainConfig refuse every impossible value when they are made, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from cachebuild.builder.pipeline import BuildOptions
from cachebuild.errors import CacheBuildError, OptionError
from loaders.train.run.fit import TrainConfig

BAD_BUILD = [
    ("fit", "letterbox"),  # built a cache no reader could open
    ("interpolation", "bicubic"),  # gave linear's output while the manifest said bicubic
    ("storage", "npz"),  # decoded everything, then failed
    ("compression", "lz4"),
    ("on_error", "ignore"),
    ("size", 0),
    ("size", 100_000),
    ("size", 32.0),
    ("size", True),
    ("jobs", 0),
    ("jobs", "4"),
    ("block_size", 0),
    ("chunk_size", -1),
    ("max_pixels", 0),
    ("reduced_decode", "yes"),
    ("force", 1),
    ("progress", "auto"),
]


@pytest.mark.parametrize(("field", "value"), BAD_BUILD, ids=[f"{f}={v!r}" for f, v in BAD_BUILD])
def test_build_options_refuse_bad_values(field: str, value: object) -> None:
    with pytest.raises(OptionError, match=f"^{field} must be") as err:
        BuildOptions(**{"size": 32, field: value})
    assert isinstance(err.value, CacheBuildError) and isinstance(err.value, ValueError)


def test_build_options_accept_every_documented_value() -> None:
    for fit in ("crop", "squash", "pad"):
        for interpolation in ("antialias", "area", "linear"):
            BuildOptions(size=8, fit=fit, interpolation=interpolation)
    for compression in ("none", "zstd", "blosc"):
        BuildOptions(size=8, storage="zarr", compression=compression, chunk_size=4, block_size=8)
    BuildOptions(size=8, jobs=-1, on_error="fail", progress=None, force=True, reduced_decode=False)
    BuildOptions(size=8, jobs=-2)  # joblib: all cores but one


def test_compression_is_for_the_kinds_that_compress() -> None:
    """The storage kind's own check (its backend's build_params), raised at construction."""
    with pytest.raises(OptionError, match="compression='zstd' does not apply to npy shards"):
        BuildOptions(size=32, compression="zstd")
    assert BuildOptions(size=32, storage="zarr", compression="zstd").compression == "zstd"


def test_build_options_are_frozen() -> None:
    opts = BuildOptions(size=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.fit = "letterbox"  # type: ignore[misc]


BAD_TRAIN = [
    ("model", "resnet5000"),
    ("epochs", 0),
    ("batch_size", -1),
    ("accum", 0),
    ("amp", "fp8"),
    ("lr", 0),
    ("lr", float("nan")),
    ("optimizer", "lion"),
    ("momentum", 1.5),
    ("weight_decay", -1e-4),
    ("warmup_epochs", -1),
    ("label_smoothing", 1.0),
    ("clip_grad", 0),
    ("augment", "autoaugment"),
    ("crop", 4),
    ("workers", -1),
    ("loader", "ffcv"),
    ("loader", "threads"),
    ("loader", "dataloader"),
    ("in_memory", "maybe"),
    ("device", "tpu"),
    ("seed", 1.5),
    ("compile", "yes"),
    ("log_every", -1),
    ("ckpt_every", -2),
    ("progress", 1),
    ("stop_after_steps", 0),
    ("train", ""),
    ("val", 3),
]


@pytest.mark.parametrize(("field", "value"), BAD_TRAIN, ids=[f"{f}={v!r}" for f, v in BAD_TRAIN])
def test_train_config_refuses_bad_values(field: str, value: object, tmp_path) -> None:
    kw = {"train": str(tmp_path / "c"), "out": str(tmp_path / "run"), field: value}
    with pytest.raises(OptionError, match=f"^{field}"):
        TrainConfig(**kw)


def test_train_config_defaults_and_frozen(tmp_path) -> None:
    cfg = TrainConfig(train=str(tmp_path), out=str(tmp_path / "run"), device="cuda:1", clip_grad=1, crop=224)
    assert dataclasses.asdict(cfg)["clip_grad"] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = -1  # type: ignore[misc]
