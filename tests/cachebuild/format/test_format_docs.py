"""The "reading a cache without cachebuild" snippets of docs/FORMAT.md, run as written on real caches."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.compact_fixtures import jpeg_index_cache
from tests.legacy_caches import legacy_copy
from tests.loaders_fixtures import make_cache
from tests.repo import REPO

FORMAT_MD = REPO / "docs" / "FORMAT.md"


def _snippets() -> dict[str, str]:
    text = FORMAT_MD.read_text(encoding="utf-8")
    section = text.split("## Reading a cache without cachebuild", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return {b.splitlines()[0].lstrip("# ").split(":")[0]: b for b in blocks}


def test_the_doc_has_the_five_readers_and_the_checksums():
    assert sorted(_snippets()) == ["checksums", "jpeg", "numpy", "tensorstore", "xarray", "zarr-python"]


@pytest.mark.parametrize("name", ["v4-npy", "v4-zarr", "v2-zarr", "v3-npy-columns"])
def test_the_checksum_snippet_checks_every_file_of_every_version(tmp_path, name):
    if name.startswith("v4"):
        cache = make_cache(tmp_path / name, n=30, storage=name[3:], shard_size=8)[0]
    else:
        cache = legacy_copy(name, tmp_path / name)
    snippet = compile(_snippets()["checksums"], "FORMAT.md:checksums", "exec")
    exec(snippet, {"cache": str(cache)})
    victim = sorted(p for p in cache.rglob("*") if p.is_file() and p.name not in ("manifest.json", "files.json"))[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(AssertionError):  # it finds a flipped bit, as `cachebuild verify` does
        exec(snippet, {"cache": str(cache)})


@pytest.mark.parametrize("reader", ["numpy", "zarr-python", "tensorstore", "xarray", "jpeg"])
def test_snippet_reads_the_cache_as_written(tmp_path, reader):
    npy, images, labels = make_cache(tmp_path / "npy", n=30, storage="npy", shard_size=8)
    zarr_cache, _, _ = make_cache(tmp_path / "zarr", n=30, storage="zarr", shard_size=8)
    jpeg_cache, _, _ = jpeg_index_cache(tmp_path / "jpeg", n=30, shard_size=8)
    scope = {"cache": str(npy), "zarr_cache": str(zarr_cache), "jpeg_cache": str(jpeg_cache)}
    exec(compile(_snippets()[reader], f"FORMAT.md:{reader}", "exec"), scope)
    if reader == "jpeg":  # exactly the pixels cachebuild serves for that sample
        from loaders.dataset import CachedImageDataset

        assert np.array_equal(scope["image"], CachedImageDataset(jpeg_cache).gather([3])[0])
    elif reader == "numpy":
        assert np.array_equal(scope["images"], images) and np.array_equal(scope["labels"], labels)
    elif reader == "xarray":
        assert np.array_equal(scope["images"].values, images)
    else:
        assert np.array_equal(np.asarray(scope["first"]), images[:8])
