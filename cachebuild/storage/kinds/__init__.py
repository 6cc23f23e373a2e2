"""Storage kinds: how a cache's pixels are laid out, one module per kind (``npy``, ``zarr``, ``jpeg``), what a kind
is and their one registry (:mod:`cachebuild.storage.kinds.base`)."""

from cachebuild.storage.kinds.base import (
    DEFAULT_STORAGE,
    Backend,
    ImageStore,
    Sink,
    backend_names,
    cache_names,
    codecs,
    get_backend,
    register_backend,
    staging_names,
)

__all__ = ["DEFAULT_STORAGE", "Backend", "ImageStore", "Sink", "backend_names", "cache_names", "codecs",
           "get_backend", "register_backend", "staging_names"]
