"""cachebuild: decode an image dataset once into a fixed-shape uint8 cache that training jobs memory-map.

The library's public names; everything else is private and free to move::

    import cachebuild

    results = cachebuild.build("imagenet", "/data/ILSVRC2012", "/caches/in-224", size=224)  # train/ and val/
    cache = cachebuild.open("/caches/in-224/train")   # a folder or a URL; loaders.CachedImageDataset reads it too
    cache.manifest.count, cache.gather([3, 1, 4])    # the manifest; samples as (n, S, S, 3) uint8

    cachebuild.build("imagenet", "/data/ILSVRC2012", store="s3://team/caches", size=224)  # once, for the team
    url = cachebuild.resolve("s3://team/caches", "imagenet", "/data/ILSVRC2012", size=224, split="train")
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cachebuild.errors import CacheBuildError

if TYPE_CHECKING:
    from cachebuild.builder.options import BuildResult
    from cachebuild.share.store_build import StoreResult
    from cachebuild.storage.cache import CacheReader

__version__ = "0.1.0"

__all__ = ["CacheBuildError", "__version__", "build", "open", "resolve"]


def build(kind: str, src: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
          size: int | None = None, classes: list[str] | None = None, store: str | os.PathLike[str] | None = None,
          wait: bool = True, **options: Any) -> list[BuildResult] | list[StoreResult]:
    """Build the caches of the source ``src`` of kind ``kind`` (``"imagenet"``, ``"cifar10"``, ``"cifar100"``,
    ``"folder"``, ``"wds"``, ``"parquet"``, ``"ffcv"``, ``"mds"``, ``"litdata"``), one folder per split under
    ``out`` (default ``$CACHEBUILD_HOME/<dataset>-<size>``): what ``cachebuild KIND SRC`` does, with its flags
    as keyword arguments (``fit="pad"``, ``storage="jpeg"``, ``jobs=8``, ``update=True``, ``split="train"``...).
    Returns each split's result (``status``, ``count``, ``failures``, ``path``...). A killed build resumes when
    called again; a cache already up to date is left as it is.

    ``store`` (default ``$CACHEBUILD_STORE``): a team store, as ``--store``: its cache of the recipe is used
    (``out`` given: pulled there), one being built elsewhere waited for (``wait=False``: an error naming it),
    else it is built and published; each split's result is then a ``StoreResult`` (``status``, ``url``,
    ``path``, ``count``)."""
    if store is None:
        from cachebuild.settings import settings

        store = settings().store
    if store:
        from cachebuild.share.store_build import build_with_store

        return build_with_store(kind, src, out, store=store, wait=wait, size=size, classes=classes, **options)
    from cachebuild.builder.pipeline import build_source

    return build_source(kind, src, out, size=size, classes=classes, **options)


def resolve(store: str | os.PathLike[str], kind: str, src: str | os.PathLike[str], *, size: int | None = None,
            **options: Any) -> str:
    """The URL (a path, in a folder store) of ``store``'s cache of the recipe ``cachebuild.build(kind, src,
    size=..., **options)`` makes, for one split (``split="train"``): what ``cachebuild resolve`` prints, for
    ``CachedImageDataset(resolve(...))``. The source is planned (listed, each file stat'ed), nothing decoded.
    Raises :class:`~cachebuild.errors.CacheNotFoundError` when the store does not hold it."""
    from cachebuild.share.store import resolve as resolve_in

    return resolve_in(store, kind, src, size=size, **options)


def open(where: str | os.PathLike[str], **options: Any) -> CacheReader:
    """Open and check the cache at ``where`` (a folder holding ``manifest.json``, or its URL): its ``manifest``,
    ``len()``, ``labels``, ``gather(indices)`` and ``verify()``. ``options``: ``local_cache=`` (a folder for a
    URL's blocks), ``storage_options=`` (fsspec's)."""
    from cachebuild.storage.cache import open_cache

    return open_cache(where, **options)
