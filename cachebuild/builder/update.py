"""``--update``: rebuild the cache at ``--out`` for a changed source, decoding only what changed.

The cache at ``--out`` must have been built with the same recipe (every parameter a user chooses): anything
else is refused, naming what differs. Each planned file whose (relative path, size, mtime) equals the row the
old build stat'ed (``source_files.json``) and that gave a sample there is *reused*: its stored bytes are copied
into the new cache through the storage kind's own interfaces (``ImageStore.read_stored`` ->
``Sink.commit_stored``: raw rows, or the stored JPEG as it is), with its recorded source size and box. A file of
the same path and size whose mtime changed (a ``cp -r`` of the tree, a ``touch``, a restore from backup), or
whose stat is racy (below), is reused too when its bytes are the bytes the old build read: they are read and
digested (``SOURCE_DIGEST``, xxh3-64) and compared with the digest the old build recorded of them, in threads,
before any block runs; nothing is decoded for it. Every other file is decoded as a fresh build decodes it:
added, changed, relabelled-and-moved (a new path), failed before, and racy ones whose bytes cannot be compared
(caches of releases before the digests). An update of a cache that recorded no digests reads the files it
reuses once, to record theirs (no decode), so that its result is a fresh build's, digests included.

Racy files (git's "racily clean" entries): a file rewritten in the same tick of the filesystem's clock as
the old build stat'ed it keeps its size and mtime. So a file whose recorded mtime is not at least
:data:`RACY_NS` older than the moment the old build listed the source (``source.inputs.listed_ns``; caches
built before it was recorded: their ``created`` time) is not trusted by its stat: its bytes are compared with
their recorded digest, or, without one, it is decoded again (that decode is its content check). 2 s covers the
coarsest clocks in use (FAT; ext3, HFS+ and many NFS servers tick per second). A tool that rewrites a file and
then sets its old size-equal mtime back (``touch -r``, an ``rsync -t`` of other bytes) defeats any size-and-mtime
check, as it does rsync's and make's: ``--force``.

The blocks, the staging folder, resume after a kill, ``finish`` and the commit are the build's own, so the
result is a fresh build's: the same plan order, labels, block layout, bytes, manifest and file table (but
the times). The old cache stays whole and readable at ``--out`` until the commit renames it aside, as
``--force`` does. What is copied from it is verified first (the shards whose samples are copied one by one,
and the side arrays read): damage is never hashed into the new cache as if it were good. A shard taken whole
(npy, jpeg: hard-linked) keeps the checksum the old manifest recorded, so ``verify`` still finds any damage in it.

A cache whose pixels an earlier release made (another :data:`~cachebuild.builder.sample.PIXEL_RECIPE`, or
another OpenCV, simplejpeg or torch) is updated by decoding every file again: its samples are not this
release's, so none is reused; its columns are carried as always.

Columns (``cachebuild columns add``) hold one row per sample; a row belongs to its sample's source path, so the
new cache's row for a path is the old row of that path, whether or not the file's pixels changed. A planned
file the old cache had no sample for has no row: the update is refused before anything is written, naming it.
Rows are checked against the old manifest's checksums before they are carried, and written with the build's.

A cache of an older format (sha256 checksums, versions 1-3) is updated into this release's (version 4, xxh3-128):
the recipe check ignores the format version (it shapes no pixel), no shard is taken whole (its recorded sha256
would be misread as an xxh3-128 digest), and every reused sample is copied, from shards verified first against
their sha256, and hashed anew as written. The result is a fresh build's, as always; the old cache is renamed
aside by the commit, as ``--force`` does, and nothing the old cache held but its files is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import gc
import io
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.builder.block import Decoded, decode_run
from cachebuild.builder.options import PIXEL_RECIPE, pixel_recipe, recipe_differences
from cachebuild.builder.sample import pixel_tools
from cachebuild.errors import CacheBuildError, CacheExistsError
from cachebuild.format.manifest import BUILD, MANIFEST_NAME, SOURCE_DIGEST, ColumnInfo, Manifest, ShardInfo
from cachebuild.sources.plan import Plan, digest_contents
from cachebuild.storage import Location, get_backend, open_location
from cachebuild.storage.cache import (
    SourceInputs,
    load_paths,
    load_source_inputs,
    map_array,
    open_cache,
    read_manifest,
)
from cachebuild.storage.columns import write_column_file
from cachebuild.storage.kinds.base import BlockRecord

__all__ = ["RACY_NS", "BlockReuse", "CarriedColumns", "Reuse", "end_worker_processes", "gc_paused", "plan_reuse",
           "racy_files", "release_reader"]

log = logging.getLogger("cachebuild")

RACY_NS = 2_000_000_000  # an mtime this close to the listing may hide a same-tick rewrite (see the module doc)
_READ_ROWS = 256  # stored samples read at a time when copying (bounded memory at any sample size)


# This process's reader of the cache an update copies from: opened once per process, not once per block
# (an npy cache reads every shard's header when opened). Pinned to the folder it opened, with a shared lock
# on it, so a worker that outlives the update holds the replaced cache until it exits or the next update.
_READER: list[Any] = []


def _reader(cache: str, content_id: str) -> Any:
    if _READER and _READER[0] == (cache, content_id):
        return _READER[1]
    reader = open_cache(cache)
    if reader.manifest.content_id != content_id:  # never copy another cache's bytes than the one planned from
        raise CacheBuildError(f"{cache} changed during the update (another cache is there now); rerun the command")
    _READER[:] = [(cache, content_id), reader]
    return reader


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector off for the ``with`` block, the caller's setting back after: an update run in
    this process copies samples with no decode between them, and the collector's passes over the plan's and the
    reader's millions of live, acyclic objects would take a large share of its time (docs/performance.md). What
    runs meanwhile makes no cycles worth collecting."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def release_reader() -> None:
    """Drop this process's reader of a replaced cache (the build's own process, once the update committed)."""
    _READER.clear()


def end_worker_processes() -> None:
    """End the worker processes an update's blocks ran in: each keeps its reader of the old cache, with its
    shared lock, until it exits, and that lock would keep the replaced cache on disk after the build although
    no job reads it. They are started again by the next build that needs them."""
    from joblib.externals.loky import get_reusable_executor

    get_reusable_executor().shutdown(wait=True)


@dataclass(frozen=True)
class BlockReuse:
    """One block's share of an update (picklable, small): per block position, the old cache's sample to copy
    (-1: decode the file) and that sample's recorded source size and box."""

    cache: str
    content_id: str  # of the cache the update planned from: a worker copies from that one or fails
    old: np.ndarray  # int64 (planned,)
    sizes: np.ndarray  # int32 (planned, 2)
    boxes: np.ndarray  # int32 (planned, 4)
    shard: ShardInfo | None = None  # the old shard holding exactly this block's samples, in order

    @property
    def reused(self) -> int:
        return int((self.old >= 0).sum())

    def adopt(self, task: Any) -> BlockRecord | None:
        """The block's record when its storage kind takes the old shard whole (``Backend.adopt_shard``: npy and
        jpeg shards, hard-linked), else None: nothing read, decoded or hashed again (a touched file's neighbours)."""
        if self.shard is None:
            return None
        taken = get_backend(task.storage).adopt_shard(Path(task.staging), task.block,
                                                      _reader(self.cache, self.content_id).location, self.shard)
        if taken is None:
            return None
        n = len(self.old)
        ok = np.arange(task.start, task.start + n, dtype=np.int64)
        return BlockRecord(task.block, task.start, n, n, taken[0], self.shard.digest, ok, self.sizes, self.boxes,
                           (), taken[1], n)

    def fill(self, task: Any, sink: Any) -> Decoded:
        """``block.decode_run`` for a block with samples to reuse: runs of reused samples copied from the old
        cache, runs of the others decoded by the build's own ``decode_run``. Positions, sizes and boxes go into
        arrays made for the whole block, a run's slice at a time."""
        reader = _reader(self.cache, self.content_id)
        planned = len(self.old)
        ok = np.empty(planned, np.int64)
        sizes = np.empty((planned, 2), np.int32)
        boxes = np.empty((planned, 4), np.int32)
        failures: list[Any] = []
        n = 0
        reuse = self.old >= 0
        cuts = [0, *(np.flatnonzero(np.diff(reuse.astype(np.int8))) + 1).tolist(), len(reuse)]
        for a, z in itertools.pairwise(cuts):
            if not reuse[a]:
                part_ok, part_sizes, part_boxes, part_failures = decode_run(task, sink, a, z)
                k = len(part_ok)
                ok[n : n + k], sizes[n : n + k], boxes[n : n + k] = part_ok, part_sizes, part_boxes
                failures += part_failures
                n += k
                continue
            for lo in range(a, z, _READ_ROWS):
                hi = min(z, lo + _READ_ROWS)
                for stored in reader.images.read_stored(self.old[lo:hi]):
                    sink.commit_stored(stored)
            k = z - a
            ok[n : n + k] = np.arange(task.start + a, task.start + z)
            sizes[n : n + k], boxes[n : n + k] = self.sizes[a:z], self.boxes[a:z]
            n += k
        return ok[:n], sizes[:n], boxes[:n], failures


@dataclass(frozen=True)
class Reuse:
    """An update's plan: for every planned file, the old cache's sample to copy, or -1 to decode it."""

    cache: str
    content_id: str
    old: np.ndarray  # int64 (len(plan),)
    sizes: np.ndarray  # int32 (old count, 2)
    boxes: np.ndarray | None  # int32 (old count, 4): fit=pad only
    shards: dict[tuple[int, int], ShardInfo] = dataclasses.field(default_factory=dict)  # (start, count) -> shard
    columns: CarriedColumns | None = None  # the old cache's columns, their rows by path (plan_columns)
    adopts: bool = True  # shards may be taken whole: the old cache's checksums are the build's (format.manifest)
    # S16 (len(plan),): the recorded digest of each reused file's bytes (b"": not known), for the new table
    digests: np.ndarray | None = None

    @property
    def reused(self) -> int:
        return int((self.old >= 0).sum())

    def whole_shard(self, lo: int, hi: int) -> ShardInfo | None:
        """The old shard that holds exactly the samples of block ``[lo, hi)``, in order, if one does."""
        old = self.old[lo:hi]
        if not len(old) or old[0] < 0 or not np.array_equal(old, np.arange(old[0], old[0] + len(old))):
            return None
        return self.shards.get((int(old[0]), len(old)))

    def copied_shards(self, block: int, adopts: bool) -> set[int]:
        """Starts of the old shards whose samples are copied one by one (all but those taken whole)."""
        copied = self.old >= 0
        if adopts:
            for lo in range(0, len(self.old), block):
                if self.whole_shard(lo, lo + block) is not None:
                    copied[lo : lo + block] = False
        starts = np.array(sorted(start for start, _ in self.shards), dtype=np.int64)
        if not len(starts):
            return set()
        return set(starts[np.unique(np.searchsorted(starts, self.old[copied], side="right") - 1)].tolist())

    def for_block(self, lo: int, hi: int) -> BlockReuse | None:
        """Block ``[lo, hi)``'s share, or None when it reuses nothing (it is then built as any block is)."""
        old = self.old[lo:hi]
        if not (old >= 0).any():
            return None
        at = np.where(old >= 0, old, 0)
        boxes = self.boxes[at] if self.boxes is not None else np.zeros((len(old), 4), np.int32)
        whole = self.whole_shard(lo, hi) if self.adopts else None
        return BlockReuse(self.cache, self.content_id, old.copy(), np.asarray(self.sizes[at]), np.asarray(boxes),
                          whole)


@dataclass(frozen=True)
class CarriedColumns:
    """The old cache's columns, checked, and for every planned file the old sample whose row it takes."""

    values: dict[str, np.ndarray]  # name -> rows, one per old sample
    row_of: np.ndarray  # int64 (len(plan),): old sample of the same path

    def write(self, staging: Path, ok: np.ndarray) -> dict[str, ColumnInfo]:
        """Write each column's rows for the new samples (plan positions ``ok``) into ``staging``."""
        rows = self.row_of[ok]
        return {name: write_column_file(staging, name, np.ascontiguousarray(values[rows]), BUILD)
                for name, values in sorted(self.values.items())}


def plan_columns(out: Path, location: Location, m: Manifest, keys: Sequence[str], paths: list[str],
                 fix: str) -> CarriedColumns | None:
    """The columns of the cache at ``out`` (manifest ``m``, old sample paths ``paths``) carried to the planned
    ``keys``; None when it has none. Refuses a planned file without a row, or a damaged column file."""
    if not m.columns:
        return None
    if list(keys) == paths:  # nothing added, removed or moved (the usual update: files rewritten in place)
        row_of = np.arange(len(paths), dtype=np.int64)
    else:
        index = {p: i for i, p in enumerate(paths)}
        row_of = np.fromiter((index.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
    missing = np.flatnonzero(row_of < 0)
    names = ", ".join(sorted(m.columns))
    if len(missing):
        first = keys[int(missing[0])]
        raise CacheExistsError(
            f"cannot update {out}: it has columns ({names}) with one row per sample, and {len(missing)} planned "
            f"file(s) had no sample in it (first: {first}), so they have no row; remove the columns "
            f"(cachebuild columns rm), update, and add them again with rows for every file, or {fix}")
    values = {}
    for name, info in m.columns.items():
        data = location.read_bytes(info.file)
        if len(data) != info.size or m.digest.of(data) != info.digest:
            raise CacheBuildError(f"cannot update {out}: its column file {location.describe(info.file)} does not "
                                  f"match the checksum its manifest records: nothing damaged is carried over; "
                                  f"add the column again (cachebuild columns add --replace), or {fix}")
        values[name] = np.load(io.BytesIO(data), allow_pickle=False)
        if len(values[name]) != m.count:
            raise CacheBuildError(f"cannot update {out}: its column {name!r} has {len(values[name])} rows for "
                                  f"{m.count} samples; add the column again (cachebuild columns add --replace), "
                                  f"or {fix}")
    return CarriedColumns(values, row_of)


def _other_pixels(old: Manifest) -> str | None:
    """Why the old cache's samples are not what this release makes of the same files, or None."""
    if pixel_recipe(old.build) != PIXEL_RECIPE:
        return f"pixel recipe {pixel_recipe(old.build)} -> {PIXEL_RECIPE}"
    changed = [f"{name} {old.tool.get(name)} -> {v}" for name, v in pixel_tools().items() if old.tool.get(name) != v]
    return "; ".join(changed) or None


def _listed_ns(m: Manifest) -> int:
    """When the old build stat'ed its source (ns); caches that do not record it: their commit time."""
    inputs = m.source.get("inputs")
    listed = inputs.get("listed_ns") if isinstance(inputs, dict) else None
    if isinstance(listed, int) and not isinstance(listed, bool):
        return listed
    try:
        return int(_dt.datetime.fromisoformat(m.created).timestamp()) * 1_000_000_000
    except (TypeError, ValueError):
        return 0  # no time known: nothing is trusted, every file is decoded


def _old_samples(keys: list[str], paths: list[str], where: str) -> np.ndarray:
    """Old plan position -> old sample index (-1: the file failed): ``paths`` is the readable subsequence of the
    old plan's ``keys``, in order."""
    if paths == keys:  # every old file gave a sample (the usual case): no loop over 1.28M names
        return np.arange(len(keys), dtype=np.int64)
    sample_of = np.full(len(keys), -1, dtype=np.int64)
    j = 0
    for i, key in enumerate(keys):
        if j < len(paths) and paths[j] == key:
            sample_of[i] = j
            j += 1
    if j != len(paths):
        raise CacheBuildError(f"cannot update {where}: its paths.json does not follow its source_files.json (the "
                              f"cache is damaged); pass --force to rebuild it, or choose another --out")
    return sample_of


def _match(plan: Plan, inputs: SourceInputs, sample_of: np.ndarray, trusted_before: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per planned file: the old sample to reuse or -1; whether its bytes must be compared with the recorded
    digest first (same size, but another mtime or a racy one); the recorded digest (b"": none). By arrays (1.28M
    files: one dict, no row objects)."""
    n = len(plan)
    keys, rows = inputs.keys, inputs.rows
    if keys == list(plan.keys):
        at = np.arange(n, dtype=np.int64)
    else:
        index = {k: i for i, k in enumerate(keys)}
        at = np.fromiter((index.get(k, -1) for k in plan.keys), dtype=np.int64, count=n)
    found = at >= 0
    at0 = np.where(found, at, 0)
    old = rows[at0] if len(rows) else np.zeros((n, 3), np.int64)
    new = np.asarray(plan.file_stats, dtype=np.int64)
    sample = np.where(found, sample_of[at0], -1) if len(sample_of) else np.full(n, -1, np.int64)
    same_size = found & (old[:, 1] == new[:, 0]) & (new[:, 0] >= 0) & (sample >= 0)
    trusted = same_size & (old[:, 2] == new[:, 1]) & (old[:, 2] < trusted_before - RACY_NS)
    recorded = (np.where(found, inputs.digests[at0], b"") if inputs.digests is not None and len(inputs.digests)
                else np.zeros(n, f"S{SOURCE_DIGEST.hex_len}"))
    check = same_size & ~trusted & (recorded != b"")
    return np.where(trusted | check, sample, -1).astype(np.int64), check, recorded


def racy_files(plan: Plan, m: Manifest) -> int:
    """Files of ``plan`` whose stat the cache ``m`` (of the same source digest) cannot vouch for: modified within
    :data:`RACY_NS` of its listing, so rewritten unseen perhaps. An update decodes them even then."""
    if plan.file_stats is None or not len(plan):
        return 0
    return int((np.asarray(plan.file_stats)[:, 1] >= _listed_ns(m) - RACY_NS).sum())


def _carried(out: Path, location: Any, m: Manifest, plan: Plan, fix: str) -> CarriedColumns | None:
    """Columns of a cache that records no per-file inputs: checked paths first, as an update with them does."""
    if not m.columns:
        return None
    problems = open_cache(out).verify_arrays(["paths"])
    if problems:
        raise CacheBuildError(f"cannot update {out}: it fails its checksums ({problems[0]}): nothing damaged is "
                              f"carried over; {fix}")
    return plan_columns(out, location, m, plan.keys, load_paths(location, m), fix)


def plan_reuse(out: Path, plan: Plan, params: dict[str, Any], block: int, jobs: int = 1) -> Reuse | None:
    """The update of the cache at ``out`` to ``plan`` (None: nothing there, a plain build). Refuses another
    recipe or a damaged cache, by name; a cache without per-file inputs (CIFAR, WebDataset, Parquet), or whose
    pixels an earlier release made, is rebuilt by decoding every file, with a warning. Files whose bytes must be
    compared with their recorded digest are read in ``jobs`` threads."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    fix = "pass --force to rebuild it, or choose another --out"
    try:
        m = read_manifest(out)
    except CacheBuildError as e:
        raise CacheExistsError(f"cannot update {out}: {e}; {fix}") from None
    diffs = recipe_differences(m.build, params)
    if diffs:
        raise CacheExistsError(f"cannot update {out}: it was built with another recipe ({'; '.join(diffs)}); "
                               f"{fix}")
    location = open_location(out)
    inputs = load_source_inputs(location, m)
    other = _other_pixels(m)
    if other is not None or inputs is None or plan.file_stats is None:
        why = (f"its samples were made by an earlier release's pixels ({other})" if other is not None else
               "it records no per-file inputs of its source (or this source has none)")
        log.warning("%s: %s: the update decodes every file", out, why)
        columns = _carried(out, location, m, plan, fix)
        return Reuse(str(out), m.content_id, np.full(len(plan), -1, np.int64), np.zeros((0, 2), np.int32), None,
                     columns=columns)
    held = open_cache(out)
    if held.manifest.content_id != m.content_id:
        raise CacheBuildError(f"cannot update {out}: it changed while the update was planned; rerun the command")
    problems = held.verify_arrays([n for n in ("paths", "sizes", "boxes") if n in m.arrays])
    paths = load_paths(location, m) if not problems else []
    sample_of = _old_samples(inputs.keys, paths, str(out)) if not problems else np.zeros(0)
    old, recorded = np.zeros(0, np.int64), None
    if not problems:
        old, check, recorded = _match(plan, inputs, sample_of, _listed_ns(m))
        checked = np.flatnonzero(check)
        if len(checked):  # same size, another (or a racy) mtime: the same bytes as the old build read?
            differs = digest_contents(plan, checked, jobs) != recorded[checked]
            old[checked[differs]] = -1
            log.info("%s: %d of %d files with a new mtime (or a racy one) hold the bytes the cache was built from",
                     out, len(checked) - int(differs.sum()), len(checked))
    sizes = np.asarray(map_array(location, m, "sizes"))
    boxes = np.asarray(map_array(location, m, "boxes")) if "boxes" in m.arrays else None
    columns = plan_columns(out, location, m, plan.keys, paths, fix) if not problems else None
    adopts = get_backend(m.storage).adopts_shards and m.digest == BUILD  # else every sample is copied, re-hashed
    carried = None if recorded is None else np.where(old >= 0, recorded, b"")
    unknown = np.flatnonzero(old >= 0) if carried is None else np.flatnonzero((old >= 0) & (carried == b""))
    if len(unknown) and plan.file_stats is not None:  # reused, no digest recorded (an earlier release's cache)
        log.info("%s: recording the digests of %d reused files' bytes (its release recorded none): reading them, "
                 "decoding none", out, len(unknown))
        if carried is None:
            carried = np.zeros(len(plan), f"S{SOURCE_DIGEST.hex_len}")
        carried[unknown] = digest_contents(plan, unknown, jobs)
    reuse = Reuse(str(out), m.content_id, old, sizes, boxes, {(sh.start, sh.count): sh for sh in m.shards},
                  columns, adopts, carried)
    if not problems:  # a shard taken whole keeps its checksum, for `verify` of the new cache; a copied one is checked
        problems = held.images.verify(reuse.copied_shards(block, adopts))
    if problems:
        raise CacheBuildError(f"cannot update {out}: it fails its checksums ({problems[0]}"
                              f"{f' and {len(problems) - 1} more' if len(problems) > 1 else ''}): nothing "
                              f"damaged is carried over; {fix}")
    log.info("updating %s: %d of %d files reused, %d to decode", out, int((old >= 0).sum()), len(plan),
             int((old < 0).sum()))
    return reuse
