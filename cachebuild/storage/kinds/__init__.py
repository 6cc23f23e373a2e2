"""Storage kinds: how a cache's pixels are laid out. What a kind is and their one registry live in
:mod:`cachebuild.storage.kinds.base` (re-exported by :mod:`cachebuild.storage`); each kind is one module: ``npy``,
``zarr``, ``jpeg``."""
