"""Storage, along its two axes: how a cache's pixels are laid out (``kinds``: one module per kind, one registry)
and where a cache lives (``locations``: a local folder or any fsspec URL), over the one remote layer (``remote``:
retries, hedged reads, pinning, the block cache) and under the files every cache has (``cache``: open, verify,
commit; ``columns``). Layers inside, from the top: cache, columns > kinds > locations > remote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cachebuild.storage.kinds.base import (
    DEFAULT_STORAGE,
    STORAGE_KINDS,
    Backend,
    ImageStore,
    Sink,
    backend_names,
    cache_names,
    get_backend,
    register_backend,
    staging_names,
)
from cachebuild.storage.locations import LocalLocation, Location, check_name, is_url, open_location, redact
from cachebuild.storage.remote.block_cache import BlockCache, BlockCacheFullError

if TYPE_CHECKING:
    from cachebuild.storage.locations.url import FsspecLocation

__all__ = ["DEFAULT_STORAGE", "STORAGE_KINDS", "Backend", "BlockCache", "BlockCacheFullError", "FsspecLocation",
           "ImageStore", "LocalLocation", "Location", "Sink", "backend_names", "cache_names", "check_name",
           "get_backend", "is_url", "open_location", "redact", "register_backend", "staging_names"]


def __getattr__(name: str) -> Any:
    """``FsspecLocation`` is imported where it is asked for: the fsspec side comes in where a URL is opened."""
    if name == "FsspecLocation":
        from cachebuild.storage.locations.url import FsspecLocation

        return FsspecLocation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
