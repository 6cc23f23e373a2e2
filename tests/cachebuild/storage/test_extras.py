"""Optional packages stay optional: zarr (the ``zarr`` extra) is imported only by the zarr storage kind, fsspec
(the ``remote`` extra) only when a URL is opened; without them, a zarr build, a zarr cache or a URL is a
one-line error that names the extra, and everything else works. Each case runs in a child whose
``sys.modules[name] = None`` makes ``import name`` fail as it does where the package is not installed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from cachebuild.storage.cache import write_cache
from tests.repo import REPO

_CHILD = """
import sys
for name in {missing!r}:
    sys.modules[name] = None  # import name: ImportError, as without the package
from click.testing import CliRunner
from cachebuild.cli import main
r = CliRunner().invoke(main, {args!r})
print(r.exit_code)
print(r.output.strip())
print(sorted(m for m in sys.modules if m.split(".")[0] in ("zarr", "fsspec", "aiohttp", "s3fs")
             and sys.modules[m] is not None))
"""


def _cli_without(missing: tuple[str, ...], *args: str) -> tuple[int, list[str], str]:
    code = _CHILD.format(missing=missing, args=list(args))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    return int(lines[0]), lines[1:-1], lines[-1]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("extras")
    images = np.random.default_rng(0).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    for storage in ("npy", "zarr"):
        write_cache(root / storage, images, np.arange(6) % 2, ["a", "b"], storage=storage, shard_size=4)
    return root


def test_a_zarr_build_without_zarr_is_one_line_naming_the_extra(imagenet_tree, tmp_path):
    code, output, _ = _cli_without(("zarr",), "folder", str(imagenet_tree["train_dir"]), "--size", "16", "--format",
                                   "zarr", "--out", str(tmp_path / "out"), "--jobs", "1")
    assert code != 0 and len(output) == 1, output
    assert "pip install 'cachebuild[zarr]'" in output[0] and "zarr" in output[0]
    assert not (tmp_path / "out").exists()


def test_a_zarr_cache_without_zarr_is_one_line_naming_the_extra_and_npy_caches_read(caches):
    code, output, _ = _cli_without(("zarr",), "verify", str(caches / "zarr"))
    assert code != 0 and len(output) == 1, output
    assert "pip install 'cachebuild[zarr]'" in output[0]
    code, output, imported = _cli_without(("zarr",), "verify", str(caches / "npy"))
    assert code == 0 and output[-1].endswith("ok (6 samples in 2 shard(s) verified)"), output
    assert imported == "[]"  # an npy cache imports neither zarr nor the remote layer's packages


def test_a_url_without_fsspec_is_one_line_naming_the_remote_extra(caches):
    code, output, _ = _cli_without(("fsspec",), "info", "https://127.0.0.1:9/caches/c")
    assert code != 0 and len(output) == 1, output
    assert "https:// URLs" in output[0] and "pip install 'cachebuild[remote]'" in output[0]
    code, output, _ = _cli_without(("fsspec",), "info", str(caches / "npy"))
    assert code == 0 and "6 samples" in "\n".join(output)


def test_an_s3_url_without_its_filesystem_is_one_line_naming_the_remote_extra():
    code, output, _ = _cli_without(("s3fs",), "info", "s3://bucket/caches/c")
    assert code != 0 and len(output) == 1, output
    assert "s3:// URLs" in output[0] and "pip install 'cachebuild[remote]'" in output[0]
