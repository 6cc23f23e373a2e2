"""Storage kinds: how a cache's pixels are laid out, one sub-package per kind, and their one registry.

A manifest's ``storage`` field names its backend; adding a kind is one sub-package with a
:class:`~cachebuild.storage.kinds.base.Backend` subclass and one line in ``_BACKENDS`` (or a call to
:func:`register_backend`). Backends are imported on first use, so reading an npy cache never imports zarr.
"""

from __future__ import annotations

import importlib

from cachebuild.errors import UnsupportedFormatError
from cachebuild.storage.kinds.base import Backend, ImageStore, Sink

__all__ = ["DEFAULT_STORAGE", "Backend", "ImageStore", "Sink", "backend_names", "cache_names", "codecs",
           "get_backend", "register_backend", "staging_names"]

DEFAULT_STORAGE = "npy"

# kind -> "module:Class"
_BACKENDS: dict[str, str] = {
    "npy": "cachebuild.storage.kinds.npy.backend:NpyBackend",
    "zarr": "cachebuild.storage.kinds.zarr.backend:ZarrBackend",
    "jpeg": "cachebuild.storage.kinds.jpeg.backend:JpegBackend",
}
_LOADED: dict[str, Backend] = {}


def register_backend(name: str, target: str | Backend) -> None:
    """Add a storage kind: ``target`` is a Backend instance or a ``"module:Class"`` string."""
    if isinstance(target, Backend):
        _LOADED[name] = target
        _BACKENDS[name] = f"{type(target).__module__}:{type(target).__qualname__}"
    else:
        _BACKENDS[name] = target
        _LOADED.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend of storage kind ``name`` (a named error for a kind this release does not know)."""
    backend = _LOADED.get(name)
    if backend is None:
        if name not in _BACKENDS:
            raise UnsupportedFormatError(
                f"storage kind {name!r} is not known to this cachebuild (it knows {', '.join(_BACKENDS)}); "
                f"upgrade cachebuild or rebuild the cache"
            )
        module, cls = _BACKENDS[name].split(":")
        backend = _LOADED[name] = getattr(importlib.import_module(module), cls)()
    return backend


def staging_names() -> str:
    """A regex (fullmatch) of every name some storage kind writes at the top of a staging folder."""
    return "|".join(f"(?:{b.staging_names})" for b in map(get_backend, _BACKENDS) if b.staging_names)


def cache_names() -> frozenset[str]:
    """Names some storage kind keeps in a finished cache beyond the files its manifest lists."""
    return frozenset().union(*(get_backend(name).cache_names for name in _BACKENDS))


def codecs() -> dict[str, str]:
    """codec name -> the storage kind that stores samples encoded with it (``--codec jpeg`` -> ``jpeg``)."""
    return {b.codec: name for name, b in ((n, get_backend(n)) for n in _BACKENDS) if b.codec}
