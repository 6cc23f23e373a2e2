"""Two real builds with one build key and other bytes.

The build key names the source by path, size and mtime, and the parameters; not the bytes. BMP sizes depend
on the dimensions only, so rewriting every source BMP with other pixels and putting its mtime back gives a
second build of the same key: what a source file restored with its times, or another OpenCV, would give.
"""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.storage.cache import read_manifest

__all__ = ["same_key_caches"]


def _build(src: Path, out: Path, flags: list[str]) -> Path:
    # In-process (-j 1): 12 samples need no worker pool, and jobs never change a byte (test_build).
    r = CliRunner().invoke(main, ["folder", str(src), "--size", "32", "--out", str(out), "-j", "1", *flags])
    assert r.exit_code == 0, r.output
    return out / "train"


def same_key_caches(tmp: Path, flags: list[str] = ()) -> tuple[Path, Path]:
    """(cache a, cache b) under ``tmp``: 12 samples each, the same build key, every pixel different."""
    src = tmp / "same-key-src"
    rng = np.random.default_rng(0)
    for k in range(12):
        (src / f"class{k % 2}").mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(src / f"class{k % 2}" / f"{k}.bmp"), rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
    a = _build(src, tmp / "same-key-a", list(flags))
    for f in src.rglob("*.bmp"):
        st = f.stat()
        cv2.imwrite(str(f), 255 - cv2.imread(str(f)))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    b = _build(src, tmp / "same-key-b", list(flags))
    assert read_manifest(a).build_key == read_manifest(b).build_key
    return a, b
