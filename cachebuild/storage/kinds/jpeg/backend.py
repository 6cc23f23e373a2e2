"""The ``jpeg`` storage kind ("compact caches"): each fixed-shape sample stored as one JPEG, decoded on read.

Write side: a worker's block becomes one shard ``images-NNNNN.jpegs`` (layout in
:mod:`~cachebuild.storage.kinds.jpeg.payloads`): each committed slot (resized exactly as for raw caches) is
encoded (:mod:`~cachebuild.storage.kinds.jpeg.codec`) and kept in memory (~20 MB a block at 224 px), and the
shard is written when the block closes, under a temporary name. The manifest's per-shard digest covers
every byte of the shard file (index and payloads), so ``verify`` needs no decode and finds any flipped
byte; each sample's crc32 in the index is checked before every decode, so a damaged sample is an error
naming it at read time, never a silently wrong image.

Read side: :class:`JpegImages` gathers a batch by reading the samples' bytes (zero-copy views of memory
maps locally, byte ranges remotely) and decoding them straight into the caller's buffer with a small
pool of threads per process (libjpeg-turbo releases the GIL). ``read_encoded`` hands the checked bytes
over undecoded instead, for decoding on a GPU (``loaders.device.device_loader(decode="cuda")``).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import zlib
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cachebuild.atomic import AtomicFile
from cachebuild.errors import CacheCorruptError, OptionError, RemoteError
from cachebuild.format.manifest import BUILD
from cachebuild.settings import settings
from cachebuild.storage.kinds.base import (
    Backend,
    BlockRecord,
    ImageStore,
    StorageParams,
    adopt_file,
    digest_of_file,
    one_file_per_block,
)
from cachebuild.storage.kinds.jpeg import codec
from cachebuild.storage.kinds.jpeg.payloads import PayloadFiles, ShardIndex, index_bytes, parse_index, write_shard
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache

if TYPE_CHECKING:
    from cachebuild.format.manifest import Manifest, ShardInfo

__all__ = ["JpegBackend", "JpegImages", "JpegShardSink", "decode_in_this_thread", "decode_threads", "shard_file_name"]

MAX_DECODE_THREADS = 4
_CHUNK_BYTES = 8 << 20  # the sampler's read unit: ~8 MB of stored bytes, as for npy rows


def shard_file_name(index: int) -> str:
    return f"images-{index:05d}.jpegs"


_here = threading.local()  # .inline: this thread decodes its own gathers (a loader's thread)


def decode_in_this_thread() -> None:
    """From now on this thread decodes the samples it gathers itself, with no pool of decoding threads: for
    threads that already share the CPUs among them (``ThreadLoader``'s). Handing each chunk to a shared pool and
    waiting cost ThreadLoader on 2 cores: decoding in its threads made crop + normalize of a compact cache 1.13x
    and whole samples 1.25x faster (``bench/results/2026-12-04-vm-threadloader-decode/``).
    ``$CACHEBUILD_DECODE_THREADS`` and ``DatasetOptions(decode_threads=)`` still win."""
    _here.inline = True


def decode_threads() -> int:
    """Decoding threads for this process: ``$CACHEBUILD_DECODE_THREADS``, else 1 in a thread that decodes
    in itself (:func:`decode_in_this_thread`), else the CPUs this process may use divided among the
    DataLoader's workers when in one, at most 4."""
    threads = settings().decode_threads
    if threads is not None:
        return threads
    if getattr(_here, "inline", False):
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = 1
    data = sys.modules.get("torch.utils.data")  # never imported here: only asked when the caller uses torch
    if data is not None:
        info = data.get_worker_info()
        if info is not None:
            workers = info.num_workers
    return max(1, min(MAX_DECODE_THREADS, cpus // workers))


class JpegShardSink:
    """A worker's block: each committed slot encoded, the shard written at close (see the module doc)."""

    def __init__(self, staging: Path, block: int, sample_shape: tuple[int, int, int], quality: int,
                 subsampling: str) -> None:
        self.path = staging / shard_file_name(block)
        self.slot = np.empty(sample_shape, dtype=np.uint8)
        self.quality, self.subsampling = quality, subsampling
        self.payloads: list[bytes] = []
        self.crcs: list[int] = []
        #: extra fields for the block record: the shard's size as stored
        self.stored_bytes: int | None = None  # known at close

    def next_slot(self) -> np.ndarray:
        return self.slot

    def commit(self) -> None:
        data = codec.encode(self.slot, self.quality, self.subsampling)
        self.payloads.append(data)
        self.crcs.append(zlib.crc32(data))

    def commit_stored(self, stored: Any) -> None:
        data = bytes(memoryview(stored).cast("B"))  # the JPEG as stored: byte-identical, never encoded again
        self.payloads.append(data)
        self.crcs.append(zlib.crc32(data))

    def abort(self) -> None:
        self.payloads.clear()  # nothing was written yet

    def close(self) -> tuple[str, str]:
        with AtomicFile(self.path) as f:
            digest, size = write_shard(f.file, self.payloads, self.crcs, BUILD)
        self.stored_bytes = size
        return self.path.name, digest


class JpegImages(ImageStore):
    """Read side of a jpeg cache (see the module doc). Picklable; threads and maps are made per process."""

    encoded = True

    def __init__(self, location: Location, manifest: Manifest, shards: list[ShardIndex],
                 block_cache: BlockCache | None) -> None:
        self.location = location
        self.manifest = manifest
        self.files = PayloadFiles(location, shards, block_cache=block_cache, cache_id=manifest.content_id)
        stored = sum(s.size for s in shards)
        mean = stored / max(1, manifest.count)
        self.chunk_size = max(1, int(_CHUNK_BYTES // max(1.0, mean)))
        self.decode_threads: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_key: tuple[int, int] = (-1, 0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None, "_pool_key": (-1, 0)}

    def read_files_whole(self) -> None:
        self.files.read_files_whole()

    @property
    def bytes_fetched(self) -> int:
        return self.files.bytes_fetched

    # ------------------------------------------------------------ errors
    def _damaged(self, i: int, why: str) -> CacheCorruptError:
        shard = self.files.shard_of(i)
        source = ""
        try:  # the source file's name helps the user; reading it must never hide the real error
            from cachebuild.storage.kinds.side_arrays import load_paths

            source = f" ({load_paths(self.location, self.manifest)[i]})"
        except (CacheCorruptError, RemoteError, OSError, IndexError, ValueError):
            pass
        return CacheCorruptError(
            f"sample {i}{source} of {self.location.describe(shard.name)} is damaged: {why}; "
            f"`cachebuild verify` lists every damaged shard; rebuild the cache (or fetch it again)")

    def _check(self, i: int, data: Any) -> None:
        if zlib.crc32(data) != int(self.files.crc[i]):
            raise self._damaged(i, "its stored JPEG fails its crc32 checksum")

    # ------------------------------------------------------------ reading
    def _threads(self) -> ThreadPoolExecutor | None:
        n = self.decode_threads or decode_threads()
        if n <= 1:
            return None
        if self._pool is None or self._pool_key != (os.getpid(), n):
            # Threads do not survive a fork: a pool made by another process (or of another size) is dropped.
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="jpeg-decode")
            self._pool_key = (os.getpid(), n)
        return self._pool

    def _decode_range(self, idx: np.ndarray, bufs: list[Any], out: np.ndarray, lo: int, hi: int) -> None:
        for pos in range(lo, hi):
            i = int(idx[pos])
            data = bufs[pos]
            self._check(i, data)
            try:
                codec.decode_into(data, out[pos])
            except ValueError as e:
                raise self._damaged(i, f"its JPEG does not decode: {e}") from None

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        bufs = self.files.read(idx)
        pool = self._threads()
        n = len(idx)
        if pool is None or n < 2:
            self._decode_range(idx, bufs, out, 0, n)
            return
        parts = min(pool._max_workers, n)
        cuts = np.linspace(0, n, parts + 1).astype(int).tolist()
        futures = [pool.submit(self._decode_range, idx, bufs, out, a, z) for a, z in itertools.pairwise(cuts)]
        wait(futures)  # all of them, even after an error: none may write into `out` once we return
        for f in futures:
            f.result()  # the first damaged sample's error, named

    def read_encoded(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored JPEGs of samples ``idx`` (checked against their crc32), undecoded: one uint8 array of
        them back to back, and int64 offsets (len(idx) + 1,) into it."""
        bufs = self.files.read(idx)
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in bufs], out=offsets[1:])
        data = np.empty(int(offsets[-1]), dtype=np.uint8)
        for pos, (i, b) in enumerate(zip(idx.tolist(), bufs, strict=True)):
            self._check(i, b)
            data[offsets[pos] : offsets[pos + 1]] = np.frombuffer(b, dtype=np.uint8)
        return data, offsets

    # ------------------------------------------------------------ verify
    def verify(self, shards: Collection[int] | None = None) -> list[str]:
        problems = []
        algorithm = self.manifest.digest
        for s, shard in zip(self.manifest.shards, self.files.shards, strict=True):
            if shards is not None and s.start not in shards:
                continue
            try:
                got = digest_of_file(self.location, s.file, shard.size, algorithm)
            except (OSError, CacheCorruptError) as e:
                problems.append(f"{s.file}: {e}")
                continue
            if got == s.digest:
                continue
            bad = self._bad_samples(s.file, shard)
            where = (f"samples {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''} fail their crc32"
                     if bad else "its index or headers differ from the build")
            problems.append(f"{s.file} samples [{s.start}, {s.start + s.count}): checksum mismatch ({where})")
        return problems

    def _bad_samples(self, name: str, shard: ShardIndex) -> list[int]:
        (payload,) = self.location.read_ranges(name, [(shard.payload_start, shard.size)])
        view = memoryview(payload)
        off = shard.offsets.tolist()
        return [shard.start + j for j in range(shard.count)
                if zlib.crc32(view[off[j] : off[j + 1]]) != int(shard.crc[j])]


class JpegBackend(Backend):
    name = "jpeg"
    shard_digest_is_file = True
    adopts_shards = True
    staging_names = r"images-\d+\.jpegs(\.tmp)?"  # payload shards and AtomicFile's temporaries
    codec = "jpeg"

    def build_params(self, opts: StorageParams) -> dict[str, Any]:
        quality, subsampling = opts.quality, opts.subsampling
        codec.check_params(quality, subsampling)
        if opts.compression != "none":
            raise OptionError(f"jpeg caches take no chunk compression (the JPEG is the compression); "
                             f"got compression={opts.compression!r}")
        return {"chunk_size": None, "compression": "none", "codec": "jpeg", "quality": quality,
                "subsampling": subsampling, "encoder": codec.ENCODER}

    def sink(self, staging: Path, block: int, start: int, planned: int,
             sample_shape: tuple[int, int, int], params: dict[str, Any]) -> JpegShardSink:
        return JpegShardSink(staging, block, sample_shape, params["quality"], params["subsampling"])

    def finish(self, staging: Path, ordered: list[BlockRecord], count: int, planned: int) -> list[ShardInfo]:
        return one_file_per_block(staging, ordered)

    def adopt_shard(self, staging: Path, block: int, location: Location,
                    shard: ShardInfo) -> tuple[str, int | None] | None:
        name = shard_file_name(block)
        return (name, (staging / name).stat().st_size) if adopt_file(location, shard, staging / name) else None

    def open(self, location: Location, manifest: Manifest, *, block_cache: BlockCache | None = None) -> JpegImages:
        """Read every shard's index (12 bytes a sample) and check it against the manifest and, locally, the
        file's size; no payload is read."""
        names = [s.file for s in manifest.shards]
        try:
            heads = location.read_heads(names, max((index_bytes(s.count) for s in manifest.shards), default=0))
        except FileNotFoundError as e:
            raise CacheCorruptError(f"shard {e.filename}, listed in the manifest, is missing") from None
        shards = []
        for s, head in zip(manifest.shards, heads, strict=True):
            where = location.describe(s.file)
            index = parse_index(head, s.file, s.start, s.count, where)
            if location.is_local:
                size = location.local_path(s.file).stat().st_size
                if size != index.size:
                    raise CacheCorruptError(f"shard {where} is {size} bytes, its index says {index.size}"
                                            + (" (truncated)" if size < index.size else ""))
            shards.append(index)
        return JpegImages(location, manifest, shards, block_cache)
