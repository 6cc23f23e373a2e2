"""Before any block runs: the build's key, whether the destination already holds this build (or may be
replaced), and the staging folder created or reopened with the blocks an earlier run finished."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from cachebuild.atomic import write_json_atomic
from cachebuild.builder.block import record_path
from cachebuild.builder.destination import check_replaceable, is_own_staging
from cachebuild.builder.options import BuildOptions
from cachebuild.builder.sample.geometry import ANTIALIAS_FROM
from cachebuild.errors import CacheBuildError, CacheExistsError
from cachebuild.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from cachebuild.sources.plan import Plan
from cachebuild.storage import get_backend
from cachebuild.storage.cache import read_manifest
from cachebuild.storage.kinds.base import BlockRecord

__all__ = ["build_key", "check_destination", "prepare_staging"]

log = logging.getLogger("cachebuild")


def build_key(plan: Plan, opts: BuildOptions) -> tuple[str, dict[str, Any]]:
    params = {
        "format_version": FORMAT_VERSION,  # 4: xxh3-128 checksums (format.manifest); a version 2/3 cache is another
        "size": opts.size,
        "fit": opts.fit,
        "interpolation": opts.interpolation,
        "storage": opts.storage,
        "block_size": opts.resolved_block(len(plan)),
        **get_backend(opts.storage).build_params(opts),  # chunk_size, compression
        "max_pixels": opts.max_pixels,
        "reduced_decode": opts.reduced_decode,
    }
    if opts.decode_device != "cpu":  # other pixels than a CPU build (close, not equal): another cache
        params["decode_device"] = opts.decode_device
    if opts.interpolation == "antialias":  # the resize policy's switch-over scale: other pixels, another cache
        params["antialias_from"] = ANTIALIAS_FROM
        if opts.reduced_decode:  # DCT-reduced JPEGs fitted with the source's geometry (decode._fit_reduced):
            params["reduced_geometry"] = "source"  # other pixels than earlier releases, so never resumed into
    blob = json.dumps({"source": plan.source_digest, "params": params}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest(), params


def check_destination(out: Path, key: str, force: bool, update: bool = False) -> Manifest | None:
    """The manifest of ``out`` when it already holds this exact build, else None: ``out`` does not exist,
    or ``force`` (or ``update``, which then checks the recipe: ``builder.update``) and it is provably a cache
    cachebuild wrote (``destination.check_replaceable``), so it may be replaced. Raises otherwise, saying
    what is there."""
    if not out.exists() and not out.is_symlink():
        return None
    if not out.is_dir():
        raise CacheExistsError(f"{out} exists and is a file, not a cache folder; choose another --out")
    if not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
        return None
    existing, problem = None, None
    if (out / MANIFEST_NAME).is_file():
        try:
            existing = read_manifest(out)
        except CacheBuildError as e:  # say what is wrong with it, not that it is "different"
            problem = str(e)
    if existing is not None and existing.build_key == key and not force:
        return existing
    if force or update:
        check_replaceable(out, problem)
        return None
    if problem is not None:
        raise CacheExistsError(
            f"{out} holds a cache whose manifest cannot be used ({problem}); pass --force to rebuild it "
            f"(replaced only if the folder holds nothing but files its manifest names), or choose another --out"
        )
    if existing is None:
        raise CacheExistsError(f"{out} exists and is not a cachebuild cache (no {MANIFEST_NAME}); "
                               f"choose another --out")
    if existing.format_version < FORMAT_VERSION:
        raise CacheExistsError(
            f"{out} holds a cache written by another cachebuild release (format version "
            f"{existing.format_version}; this one writes {FORMAT_VERSION}); it still reads, but pass --update to "
            f"bring it to this release's format (reusing its samples), --force to rebuild it, or choose another --out"
        )
    raise CacheExistsError(
        f"{out} holds a different cache (other source files or build parameters); pass --update to update it "
        f"for a changed source (same recipe), --force to replace it, or choose another --out"
    )


def prepare_staging(staging: Path, key: str, storage: str) -> dict[int, BlockRecord]:
    """Create or reopen the staging folder; return the records of blocks finished by an earlier run."""
    build_file = staging / "build.json"
    if staging.exists() and not (staging.is_dir() and is_own_staging(staging)):
        raise CacheExistsError(f"{staging} exists and was not made by cachebuild (a build keeps its unfinished "
                               f"work there); move it away or choose another --out")
    if staging.exists():
        try:
            same = json.loads(build_file.read_text())["key"] == key
        except (OSError, ValueError, KeyError):
            same = False
        if not same:
            log.warning("discarding the unfinished build in %s: it was started with other inputs", staging)
            shutil.rmtree(staging)
    (staging / "blocks").mkdir(parents=True, exist_ok=True)
    if not build_file.exists():
        write_json_atomic(build_file, {"key": key})
    get_backend(storage).resume(staging, lambda block: record_path(staging, block).unlink(missing_ok=True))
    done = {}
    for rec_path in sorted((staging / "blocks").glob("block-*.json")):
        try:
            rec = BlockRecord.from_json(json.loads(rec_path.read_text()))
        except (ValueError, KeyError, TypeError):
            continue  # a record is written atomically, but be lenient with foreign debris
        if (staging / rec.file).exists():
            done[rec.block] = rec
    return done
