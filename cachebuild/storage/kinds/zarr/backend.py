"""The ``zarr`` storage kind: one zarr v3 uint8 array (N, H, W, 3) in ``images.zarr``, chunked along samples.

Write side in :mod:`cachebuild.storage.kinds.zarr.write`, read side in :mod:`cachebuild.storage.kinds.zarr.read`. The
cache folder is also made a zarr v3 group with consolidated metadata, so ``xarray.open_zarr(cache)`` opens
it (variable ``images.zarr``, dimensions ``sample, y, x, channel``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachebuild.atomic import write_json_atomic
from cachebuild.errors import OptionError
from cachebuild.storage.kinds.base import Backend, BlockRecord, StorageParams
from cachebuild.storage.kinds.zarr.read import ZarrImages, check_chunks, read_layout
from cachebuild.storage.kinds.zarr.write import (
    COMPACTING,
    COMPRESSIONS,
    ZARR_NAME,
    ZarrChunkSink,
    create_staging_zarr,
    place_zarr_blocks,
    undo_interrupted_compaction,
)
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache

if TYPE_CHECKING:
    from cachebuild.format.manifest import Manifest, ShardInfo

__all__ = ["ZARR_CHUNK_TARGET_BYTES", "ZarrBackend", "resolved_chunk"]

ZARR_CHUNK_TARGET_BYTES = 4 << 20  # ~4 MB chunks: random reads stay cheap


def resolved_chunk(opts: StorageParams) -> int:
    """Samples per chunk: ``chunk_size``, else about 4 MB of pixels."""
    if opts.chunk_size:
        return opts.chunk_size
    return int(min(1024, max(1, ZARR_CHUNK_TARGET_BYTES // (opts.size * opts.size * 3))))


class ZarrBackend(Backend):
    name = "zarr"
    # the array (and its temporary, create_staging_zarr), the compaction marker, the group metadata
    staging_names = r"images\.zarr(\.tmp)?|compacting\.json|zarr\.json"
    cache_names = frozenset({"zarr.json"})  # the group metadata that makes the folder readable by xarray
    # each sink opens the array under zarr.config.set(...), a process-wide setting one thread's exit restores
    # under another's open (found by the threaded build: "ignored write_empty_chunks")
    threaded_sinks = False

    def align_block(self, block: int, opts: StorageParams) -> int:
        chunk = resolved_chunk(opts)  # whole chunks per block: workers never share a chunk
        return max(chunk, block // chunk * chunk)

    def build_params(self, opts: StorageParams) -> dict[str, Any]:
        if opts.compression not in COMPRESSIONS:
            raise OptionError(f"unknown compression {opts.compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        return {"chunk_size": resolved_chunk(opts), "compression": opts.compression}

    def prepare(self, staging: Path, planned: int, sample_shape: tuple[int, int, int], opts: StorageParams) -> None:
        create_staging_zarr(staging, planned, sample_shape, resolved_chunk(opts), opts.compression)

    def resume(self, staging: Path, forget_block: Callable[[int], None]) -> None:
        undo_interrupted_compaction(staging, forget_block)

    def sink(self, staging: Path, block: int, start: int, planned: int,
             sample_shape: tuple[int, int, int], params: dict[str, Any]) -> ZarrChunkSink:
        return ZarrChunkSink(staging, start, sample_shape)

    def finish(self, staging: Path, ordered: list[BlockRecord], count: int, planned: int) -> list[ShardInfo]:
        return place_zarr_blocks(staging, ordered, count, planned)

    def cleanup(self, staging: Path) -> None:
        (staging / COMPACTING).unlink(missing_ok=True)

    def finalize_folder(self, staging: Path, manifest: Manifest) -> None:
        """Make the cache folder a zarr group with consolidated metadata (what ``xarray.open_zarr`` reads)."""
        array_meta = json.loads((staging / ZARR_NAME / "zarr.json").read_text(encoding="utf-8"))
        group = {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {"cachebuild": {"manifest": "manifest.json", "dataset": manifest.dataset,
                                          "split": manifest.split}},
            "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                      "metadata": {ZARR_NAME: array_meta}},
        }
        write_json_atomic(staging / "zarr.json", group, durable=False)

    def open(self, location: Location, manifest: Manifest, *, block_cache: BlockCache | None = None) -> ZarrImages:
        layout = read_layout(location, manifest)
        check_chunks(location, manifest, layout)
        return ZarrImages(location, manifest, layout, block_cache)
