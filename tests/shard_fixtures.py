"""The train images of ``imagenet_tree`` (real photos, ImageNet's quirks, broken files) written again as
timm-style WebDataset shards and as Hugging Face Parquet files, and the folder-tree cache they must match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.sources.folder import find_classes, folder_plan, list_class_folder
from cachebuild.storage.cache import open_cache
from support.parquet_layout import write_hf_parquet
from support.wds_layout import PackedImage, pack_files, write_wds

__all__ = ["CacheView", "cache_view", "folder_cache", "hf_set", "wds_set"]

SIZE = 32


def _tree_images(root: Path) -> list[PackedImage]:
    """Every readable image file of a class-folder tree, in ImageFolder's order, with its label."""
    keys, labels = list_class_folder(root, find_classes(root))
    return pack_files(root, keys, labels.tolist())


@pytest.fixture(scope="session")
def wds_set(imagenet_tree: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """10 samples a shard, shuffled, quirks and broken samples included, the last shard cut."""
    images = _tree_images(imagenet_tree["train_dir"])
    out = write_wds(images, tmp_path_factory.mktemp("wds") / "in1k-wds", per_shard=10, quirks=True, broken=True,
                    class_names=imagenet_tree["words"])
    out["images"] = images
    return out


@pytest.fixture(scope="session")
def hf_set(imagenet_tree: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3 files of uneven row groups, an extra column, a row without bytes and a row without label."""
    images = _tree_images(imagenet_tree["train_dir"])
    out = write_hf_parquet(images, tmp_path_factory.mktemp("hf") / "imagenet-1k", imagenet_tree["wnids"], n_files=3,
                           rows_per_group=5, quirks=True, broken=True)
    out["images"] = images
    return out


class CacheView:
    """A built cache as {image source name: (pixels, label)}, plus its failures by provenance."""

    def __init__(self, path: Path, name_of: dict[str, str]) -> None:
        c = open_cache(path)
        self.manifest = c.manifest
        self.paths = c.paths()
        pixels = c.gather(np.arange(len(c)))
        labels = c.labels.tolist()
        self.by_name = {name_of[p]: (pixels[i], labels[i]) for i, p in enumerate(self.paths)}
        self.failures = {f.path: f.reason for f in c.manifest.failures}


def cache_view(path: Path, name_of: dict[str, str]) -> CacheView:
    return CacheView(path, name_of)


@pytest.fixture(scope="session")
def folder_cache(imagenet_tree: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> CacheView:
    """The class-folder tree's own cache at the size the shard tests build."""
    out = tmp_path_factory.mktemp("folder-cache") / "train"
    build(folder_plan(imagenet_tree["train_dir"]), out, BuildOptions(size=SIZE, jobs=1))
    return cache_view(out, {p: Path(p).name for p in open_cache(out).paths()})
