"""cachebuild: decode an image dataset once into a fixed-shape uint8 cache that training jobs memory-map.

The library's public names; everything else is private and free to move::

    import cachebuild

    results = cachebuild.build("imagenet", "/data/ILSVRC2012", "/caches/in-224", size=224)  # train/ and val/
    cache = cachebuild.open("/caches/in-224/train")   # a folder or a URL; loaders.CachedImageDataset reads it too
    cache.manifest.count, cache.gather([3, 1, 4])    # the manifest; samples as (n, S, S, 3) uint8
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cachebuild.errors import CacheBuildError

if TYPE_CHECKING:
    from cachebuild.builder.options import BuildResult
    from cachebuild.storage.cache import CacheReader

__version__ = "0.1.0"

__all__ = ["CacheBuildError", "__version__", "build", "open"]


def build(kind: str, src: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
          size: int | None = None, classes: list[str] | None = None, **options: Any) -> list[BuildResult]:
    """Build the caches of the source ``src`` of kind ``kind`` (``"imagenet"``, ``"cifar10"``, ``"cifar100"``,
    ``"folder"``, ``"wds"``, ``"parquet"``, ``"ffcv"``, ``"mds"``, ``"litdata"``), one folder per split under
    ``out`` (default ``$CACHEBUILD_HOME/<dataset>-<size>``): what ``cachebuild KIND SRC`` does, with its flags
    as keyword arguments (``fit="pad"``, ``storage="jpeg"``, ``jobs=8``, ``update=True``, ``split="train"``...).
    Returns each split's result (``status``, ``count``, ``failures``, ``path``...). A killed build resumes when
    called again; a cache already up to date is left as it is."""
    from cachebuild.builder.pipeline import build_source

    return build_source(kind, src, out, size=size, classes=classes, **options)


def open(where: str | os.PathLike[str], **options: Any) -> CacheReader:
    """Open and check the cache at ``where`` (a folder holding ``manifest.json``, or its URL): its ``manifest``,
    ``len()``, ``labels``, ``gather(indices)`` and ``verify()``. ``options``: ``local_cache=`` (a folder for a
    URL's blocks), ``storage_options=`` (fsspec's)."""
    from cachebuild.storage.cache import open_cache

    return open_cache(where, **options)
