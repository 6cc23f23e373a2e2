"""Shared fixtures: real-photo datasets written in the real ImageNet and CIFAR layouts (made once); loopback
HTTP and S3 servers (tests/servers.py). Every test runs under the loopback AWS environment (``aws_session_env``,
autouse: tests/servers.py says why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachebuild.samples.imagenet_layout import write_imagenet
from tests.fault_proxy import fault_proxy  # noqa: F401  (a fault-injecting proxy in front of them)
from tests.repo import COLLECTED_MODULES
from tests.servers import _aws_home, _http_loop, aws_session_env, http_server, s3, s3_server  # noqa: F401
from tests.shard_fixtures import folder_cache, hf_set, wds_set  # noqa: F401  (the tree as tar / Parquet shards)


@pytest.fixture(scope="session")
def imagenet_tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small ILSVRC2012 tree: train in class folders (with ImageNet's quirks and broken files), val in
    class folders. About 60 real-photo JPEGs of ImageNet-like sizes, some large, some small."""
    root = tmp_path_factory.mktemp("imagenet")
    return write_imagenet(root, n_classes=4, train_per_class=12, val_per_class=3, val_layout="folders",
                          seed=1, quirks=True, broken=True)


@pytest.fixture(scope="session")
def imagenet_clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same without broken files, for tests that compare pixels with torchvision."""
    root = tmp_path_factory.mktemp("imagenet_clean")
    return write_imagenet(root, n_classes=5, train_per_class=10, val_per_class=2, val_layout="folders", seed=2)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Every test module this session collected, before ``-m`` deselects anything (tests/test_code_shape.py
    compares them with the test files on disk)."""
    modules = {Path(node.path) for node in report.result if isinstance(node, pytest.Module)}
    if modules:
        config = report.result[0].config
        config.stash.setdefault(COLLECTED_MODULES, set()).update(modules)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The one place GPU tests skip: a ``gpu``-marked test without CUDA is skipped, not failed."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


def tree_root(info: dict[str, Any]) -> Path:
    return Path(info["root"])
