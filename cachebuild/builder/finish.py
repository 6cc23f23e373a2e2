"""After the last block: block records merged in plan order into side arrays and the manifest, the backend's
finish (samples to their final places), then the one commit that renames the staging folder into place."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.builder.carry_columns import CarriedColumns
from cachebuild.builder.options import BuildOptions
from cachebuild.builder.sample.geometry import ResizeSpec
from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import Failure, Manifest, decode_path
from cachebuild.sources.plan import Plan
from cachebuild.storage import get_backend, is_url
from cachebuild.storage.cache import commit_cache, save_side_arrays, save_source_inputs, tool_versions, utc_now
from cachebuild.storage.kinds.base import BlockRecord

__all__ = ["finish"]


def _joined(parts: list[np.ndarray], dtype: type[np.signedinteger[Any]], cols: int) -> np.ndarray:
    """The blocks' per-sample arrays end to end, in plan order (one copy; none of the blocks: no rows)."""
    if not parts:
        return np.zeros(0 if cols == 1 else (0, cols), dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def finish(plan: Plan, out: Path, staging: Path, records: dict[int, BlockRecord], opts: BuildOptions,
           params: dict[str, Any], key: str, spec: ResizeSpec, columns: CarriedColumns | None = None) -> Manifest:
    """Merge block records (in plan order) into side arrays and the manifest; commit atomically. ``columns``:
    an update's columns, written for the new samples into the staging folder, so they commit with it."""
    ordered = [records[b] for b in sorted(records)]
    ok = _joined([r.ok for r in ordered], np.int64, 1)
    count = len(ok)
    failures = tuple(Failure(decode_path(f.path, "a block record"), f.reason) for r in ordered for f in r.failures)
    if count == 0:
        raise CacheBuildError(
            f"none of the {len(plan)} source files of {plan.root} could be read; first failure: "
            f"{failures[0].path}: {failures[0].reason}" if failures else f"{plan.root} has no samples"
        )
    sample_shape = (spec.size, spec.size, 3)
    backend = get_backend(opts.storage)
    shards = backend.finish(staging, ordered, count, len(plan))

    arrays = save_side_arrays(
        staging,
        labels=plan.labels[ok],
        sizes=_joined([r.sizes for r in ordered], np.int32, 2),
        paths=[plan.keys[i] for i in ok.tolist()],
        boxes=_joined([r.boxes for r in ordered], np.int32, 4) if opts.fit == "pad" else None,
        extra_labels={name: np.asarray(values)[ok] for name, values in plan.extra_labels.items()},
    )

    root = plan.root if is_url(plan.root) else str(Path(plan.root).resolve())
    source: dict[str, Any] = {"root": root, "fingerprint": plan.source_digest, "files": len(plan)}
    if plan.recipe:  # how to plan the source again (`cachebuild status`)
        source["recipe"] = plan.recipe
    if plan.file_stats is not None:  # what `cachebuild status` compares a source against, file by file
        source["inputs"] = save_source_inputs(staging, plan.keys, plan.labels, plan.file_stats)
        if plan.listed_ns is not None:  # when those stats were taken: what an update trusts them from
            source["inputs"]["listed_ns"] = plan.listed_ns
    manifest = Manifest(
        dataset=plan.dataset,
        split=plan.split,
        count=count,
        shape=sample_shape,
        storage=opts.storage,
        classes=tuple(plan.classes),
        fit=opts.fit,
        interpolation=f"{opts.interpolation}" + ("+jpeg-dct-reduce" if opts.reduced_decode else ""),
        source=source,
        build={"key": key, **params, "on_error": opts.on_error, "exif_orientation": "ignored"},
        tool=tool_versions(),
        shards=tuple(shards),
        arrays=arrays,
        failures=failures,
        extra=plan.extra,
        created=utc_now(),
    )
    if columns is not None:
        manifest = dataclasses.replace(manifest, columns=columns.write(staging, ok))  # version 4 holds columns
    shutil.rmtree(staging / "blocks")
    (staging / "build.json").unlink()  # from here a killed build starts afresh (safe: nothing is half-done)
    backend.cleanup(staging)
    # drops killed writers' temporary files; an update replaces the old cache as --force does
    return commit_cache(staging, out, manifest, replace=opts.force or opts.update)
