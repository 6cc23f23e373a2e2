"""Writes the caches under this folder with a release before format version 4 (sha256 checksums), so that the
tests read, verify, pull and update bytes an older cachebuild really wrote, not this release's idea of them.

Run with the older release first on the path (the fixtures here were written by commit f5b9b56, the last
release of format versions 2 and 3)::

    git archive f5b9b56 cachebuild loaders | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python tests/cachebuild/format/legacy/make_legacy_caches.py

Each cache holds the same ten 8 x 6 samples (``tests.loaders_fixtures.make_images``'s pattern, repeated here so
the old release needs nothing from this one), labels ``i % 3``, four samples a shard.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CACHES = {"v2-npy": "npy", "v2-jpeg": "jpeg", "v2-zarr": "zarr", "v3-npy-columns": "npy"}


def images(n: int = 10, h: int = 8, w: int = 6) -> np.ndarray:
    i = np.arange(n, dtype=np.int64)
    img = ((i[:, None, None, None] * 7 + np.arange(h)[:, None, None] * 3 + np.arange(w)[:, None] * 5
            + np.arange(3)) % 251).astype(np.uint8)
    return np.broadcast_to(img, (n, h, w, 3)).copy()


def main() -> None:
    from cachebuild.format.manifest import FORMAT_VERSION
    from cachebuild.storage.cache import write_cache
    from cachebuild.storage.columns import add_column

    if FORMAT_VERSION != 3:
        sys.exit(f"run this with a release that writes format versions 2 and 3, not {FORMAT_VERSION}")
    imgs = images()
    for name, storage in CACHES.items():
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        write_cache(out, imgs, np.arange(10) % 3, ["a", "b", "c"], storage=storage, shard_size=4,
                    paths=[f"img-{i}.png" for i in range(10)], dataset="legacy")
        if name.startswith("v3"):
            with tempfile.TemporaryDirectory() as tmp:
                np.save(Path(tmp) / "soft.npy", np.linspace(0, 1, 30, dtype=np.float32).reshape(10, 3))
                add_column(out, "soft", Path(tmp) / "soft.npy")


if __name__ == "__main__":
    main()
