"""What the peer-format tests share: the golden files beside this module, the reference build of the original
photos they hold, and reading a converted cache back in sample order."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.sources.registry import plan_source
from cachebuild.storage.cache import open_cache
from tests.cachebuild.sources.peer_files.make_peer_files import HERE, LABELS, ORIGINALS, originals

__all__ = ["HERE", "LABELS", "SIZE", "build_folder", "cache_samples", "cli", "converts_and_reads", "copy_of",
           "payload_shas", "psnr", "reference_pixels", "refused", "sha"]

SIZE = 16  # every original is larger on both sides: each build downscales (crop, antialias)


def cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def sha(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(data.tobytes() if isinstance(data, np.ndarray) else data).hexdigest()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def payload_shas(folder: Path) -> dict[str, list[str]]:
    """The SHA-256 of the stored JPEG payloads, as make_peer_files.py recorded them."""
    return json.loads((folder / "payloads.json").read_text())["sha256"]


def cache_samples(path: Path) -> tuple[np.ndarray, list[int], list[str]]:
    """(pixels, labels, provenance) of a cache, in cache order."""
    cache = open_cache(path)
    return cache.gather(np.arange(len(cache))), cache.labels.tolist(), list(cache.paths())


def reference_pixels(dest: Path) -> dict[str, Any]:
    """The originals as a build makes them (a folder build of their lossless PNGs at SIZE), by sample index."""
    pixels = build_folder(ORIGINALS, dest)
    assert sorted(pixels) == list(range(len(LABELS)))
    return {"pixels": pixels, "originals": originals()}


def build_folder(tree: Path, dest: Path) -> dict[int, np.ndarray]:
    """Build a class-folder tree of files named by sample index (``c3/00.png``) at SIZE: pixels by index."""
    plan = plan_source("folder", tree)[0]
    result = build(plan, dest, BuildOptions(size=SIZE))
    pixels, _, keys = cache_samples(result.path)
    return {int(Path(k).stem): p for k, p in zip(keys, pixels, strict=True)}


def converts_and_reads(kind: str, src: Path, field: str, *, jpeg: bool, first_key: str, reference: dict[str, Any],
                       out: Path) -> None:
    """``cachebuild KIND SRC --image-field FIELD`` makes a cache of every sample, labelled and in order: pixels
    exactly a build of the originals (JPEG payloads, at quality 97 and 4:4:4: >= 40 dB), and info, verify and
    status read it."""
    r = cli(kind, src, "--image-field", field, "--size", SIZE, "--out", out, "--no-progress")
    assert r.exit_code == 0, r.output
    pixels, labels, keys = cache_samples(out / "train")
    assert labels == LABELS and len(keys) == len(LABELS) and keys[0] == first_key
    for i in range(len(LABELS)):
        if jpeg:
            assert psnr(pixels[i], reference["pixels"][i]) >= 40, i
        else:
            assert np.array_equal(pixels[i], reference["pixels"][i]), i
    for command in ("info", "verify", "status"):
        r = cli(command, out / "train")
        assert r.exit_code == 0, (command, r.output)


def copy_of(src: Path, dest: Path) -> Path:
    """A writable copy of a golden file or folder (tests damage copies, never the goldens)."""
    if src.is_dir():
        shutil.copytree(src, dest)
    else:
        shutil.copyfile(src, dest)
    return dest


def refused(kind: str, src: Path, out: Path, *args: object) -> str:
    """Run ``cachebuild KIND SRC`` expecting a refusal: the error text; nothing may have been written."""
    r = cli(kind, src, "--size", SIZE, "--out", out, "--no-progress", *args)
    assert r.exit_code == 1, r.output
    assert not out.exists(), f"{out} was written by a refused build"
    return " ".join(r.output.split())
