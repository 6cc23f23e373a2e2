"""The zarr array of a build in its staging folder: made before the workers write into it, and after
them, when files failed, the blocks that follow a failure moved down so that sample i is the i-th
readable file (a kill at any point resumes correctly: see place_zarr_blocks).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from joblib import Parallel, delayed

from cachebuild.format.manifest import ShardInfo, write_json_atomic
from cachebuild.format.storage import ZARR_NAME, create_zarr_images, open_zarr_for_writing

__all__ = ["COMPACTING", "compact_zarr", "create_staging_zarr", "place_zarr_blocks", "undo_interrupted_compaction"]

log = logging.getLogger("cachebuild")

COMPACTING = "compacting.json"  # the marker of the moves, in the staging folder


def create_staging_zarr(staging: Path, planned: int, sample_shape: tuple[int, int, int], chunk: int,
                        compression: str) -> None:
    """The zarr array every block writes into, one row per planned file (cut to the readable ones at the
    end); made under a temporary name and renamed, so a resumed build never finds half an array."""
    final = staging / ZARR_NAME
    if final.exists():
        return
    tmp = staging / (ZARR_NAME + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    create_zarr_images(tmp, planned, sample_shape, chunk, compression)
    tmp.rename(final)


def place_zarr_blocks(staging: Path, ordered: list[dict[str, Any]], count: int, planned: int) -> list[ShardInfo]:
    """Shard entries of a zarr cache: one range per block. Blocks after a failed file move down to their
    output place in one worker task (nothing moves when every file decoded).

    Moving in place cannot be redone after a kill (a move overwrites samples a later one reads), so a
    marker names the blocks involved first; a resumed build finding it unfinished decodes those blocks
    again, and one finding it done (killed before the commit) does not move anything twice. The marker
    goes with the staging folder's other bookkeeping just before the commit.
    """
    shards, moves, pos = [], [], 0
    for r in ordered:
        if r["count"]:
            if r["start"] != pos:
                moves.append((r["start"], pos, r["count"]))
            shards.append(ShardInfo(ZARR_NAME, pos, r["count"], r["sha256"]))
            pos += r["count"]
    marker = staging / COMPACTING
    if count < planned and not marker.exists():  # an existing marker here is a finished one
        first = next(r["block"] for r in ordered if r["count"] < r["planned"])
        info = {"planned": planned, "redo": [r["block"] for r in ordered if r["block"] > first], "done": False}
        write_json_atomic(marker, info)
        Parallel(n_jobs=1)([delayed(compact_zarr)(str(staging), moves, count)])
        write_json_atomic(marker, {**info, "done": True})
    return shards


def undo_interrupted_compaction(staging: Path, forget_block: Callable[[int], None]) -> None:
    """After a kill while zarr blocks were being moved: ``forget_block`` each block whose samples may be
    clobbered, so it is decoded again (those up to the first failed file are untouched), and restore the
    planned length. The marker goes last: a kill in between repeats all of this."""
    marker = staging / COMPACTING
    if not marker.exists():
        return
    info = json.loads(marker.read_text())
    if info.get("done"):
        return  # every block is in place: the resumed build only has to commit
    for block in info["redo"]:
        forget_block(block)
    arr = open_zarr_for_writing(staging / ZARR_NAME)
    arr.resize((info["planned"], *arr.shape[1:]))
    log.info("the last run was stopped while moving zarr blocks: %d blocks will be decoded again", len(info["redo"]))
    marker.unlink()


def compact_zarr(staging: str, moves: list[tuple[int, int, int]], count: int) -> None:
    """Move each (plan start, output start, n) run of samples down to its output place, in order (a
    run only ever moves down, onto samples already moved), zero what follows the last sample in its
    chunk, and cut the array (one row per planned file) to ``count`` samples. One block in memory at
    a time."""
    arr = open_zarr_for_writing(Path(staging) / ZARR_NAME)
    planned = arr.shape[0]
    for src, dst, n in moves:
        arr[dst : dst + n] = arr[src : src + n]
    chunk = arr.chunks[0]
    tail_end = min(planned, -(-count // chunk) * chunk)
    if tail_end > count:
        arr[count:tail_end] = 0
    arr.resize((count, *arr.shape[1:]))
