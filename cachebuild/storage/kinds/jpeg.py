"""The ``jpeg`` storage kind ("compact caches"): each fixed-shape sample stored as one JPEG, decoded on read.

A worker's block becomes one shard ``images-NNNNN.jpegs``, written when the block closes (its encoded samples are
kept in memory until then): three ``.npy`` records back to back (``np.load`` on an open file reads them in turn)::

    offsets  int64  (n + 1,)   sample j is payload[offsets[j]:offsets[j + 1]]; offsets[0] = 0
    crc32    uint32 (n,)       zlib.crc32 of each sample's bytes, checked before every decode
    payload  uint8  (bytes,)   the samples' JPEG files, back to back

The manifest's digest covers every byte of the shard, so ``verify`` finds any flipped byte without decoding; the
crc32 makes a damaged sample an error naming it at read time, never a wrong image. A reader reads the index once
and then only its batch's samples' bytes (memory-map views locally, coalesced byte ranges remotely), decoded
straight into the caller's buffer by a few threads (:func:`decode_threads`), or handed over undecoded
(``read_encoded``) for nvJPEG (:func:`decode_jpegs`: TorchCodec's batch decoder, the optional extra
``torchcodec``). The codec is libjpeg-turbo through simplejpeg: it decodes into a caller's buffer, scales across
threads, and with ``strict=True`` turns libjpeg's "corrupt data" warnings into errors; accurate IDCT and fancy
upsampling, so any libjpeg-turbo decodes the stored bytes to the same pixels.
"""

from __future__ import annotations

import io
import itertools
import json
import mmap
import os
import sys
import zlib
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from cachebuild.atomic import AtomicFile
from cachebuild.errors import CacheCorruptError, MissingExtraError, OptionError, RemoteError, require_extra
from cachebuild.format.manifest import BUILD, Digest, decode_path
from cachebuild.storage.kinds.base import (
    Backend,
    BlockRecord,
    ImageStore,
    ShardHandles,
    StorageParams,
    adopt_file,
    digest_of_file,
    one_file_per_block,
)
from cachebuild.storage.kinds.npy import npy_header, npy_header_bytes
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache

if TYPE_CHECKING:
    from cachebuild.format.manifest import Manifest, ShardInfo

__all__ = ["DEFAULT_QUALITY", "DEFAULT_SUBSAMPLING", "ENCODER", "SUBSAMPLINGS", "TORCHCODEC_EXTRA", "JpegBackend",
           "JpegImages", "JpegShardSink", "PayloadFiles", "ShardIndex", "check_params",
           "decode_into", "decode_jpegs", "decode_threads", "encode", "index_bytes", "jpeg_batch_decoder",
           "parse_index", "shard_file_name", "write_shard"]

# ---------------------------------------------------------------- the codec

DEFAULT_QUALITY = 90
DEFAULT_SUBSAMPLING = "420"
SUBSAMPLINGS = ("420", "444")
ENCODER = "simplejpeg"  # recorded in the build parameters: another encoder would write other bytes


def check_params(quality: int, subsampling: str) -> None:
    """A named error for settings the encoder cannot take."""
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be an integer in 1..100, got {quality!r}")
    if subsampling not in SUBSAMPLINGS:
        raise ValueError(f"JPEG chroma subsampling must be one of {', '.join(SUBSAMPLINGS)}, got {subsampling!r}")


def encode(pixels: np.ndarray, quality: int, subsampling: str) -> bytes:
    """Baseline JPEG of an RGB uint8 (H, W, 3) C-contiguous array (accurate DCT, standard Huffman tables:
    every decoder, nvJPEG included, takes it)."""
    import simplejpeg

    return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling=subsampling,
                                  fastdct=False)


def decode_into(data: bytes | memoryview | np.ndarray, out: np.ndarray) -> None:
    """Decode a JPEG into ``out`` (uint8 (H, W, 3), C-contiguous). Raises ``ValueError`` for corrupt data
    (libjpeg's warnings included) and for an image of another shape than ``out``."""
    import simplejpeg

    got = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, buffer=out, strict=True)
    if got.shape != out.shape:
        raise ValueError(f"the JPEG holds a {got.shape[1]}x{got.shape[0]} image, the cache's samples are "
                         f"{out.shape[1]}x{out.shape[0]}")


TORCHCODEC_EXTRA = "torchcodec"  # pip install 'cachebuild[torchcodec]': the JPEG batch decoder on a GPU


def jpeg_batch_decoder() -> Any:
    """TorchCodec's ``decode_jpeg`` (``torchcodec.decoders``, from torchcodec 0.16: libjpeg-turbo on the CPU,
    nvJPEG in batches on CUDA), which supersedes torchvision's deprecated image decoders. It is the optional
    extra ``torchcodec``, imported here only: without it (or with a torchcodec too old to decode images), a
    one-line :class:`~cachebuild.errors.MissingExtraError` names the extra."""
    decoders = require_extra("torchcodec.decoders", TORCHCODEC_EXTRA,
                             "decoding JPEGs with nvJPEG (device_loader(decode='cuda'), --decode-device cuda)")
    decode = getattr(decoders, "decode_jpeg", None)
    if decode is None:
        raise MissingExtraError(f"this torchcodec decodes no images (its image decoders came in torchcodec 0.16); "
                                f"upgrade it with pip install -U 'cachebuild[{TORCHCODEC_EXTRA}]'")
    return decode


def decode_jpegs(data: Any, device: Any) -> Any:
    """TorchCodec's ``decode_jpeg(data, mode="RGB", device=device)``: a 1-D uint8 CPU tensor, or a list of them
    (one batched nvJPEG call on CUDA), to (3, H, W) uint8 tensor(s) on ``device``. TorchCodec turns a JPEG by its
    EXIF orientation, always: a compact cache's own JPEGs carry none, and the GPU build hands it only files that
    are upright (``cachebuild.builder.gpu_build``)."""
    return jpeg_batch_decoder()(data, mode="RGB", device=device)


# ---------------------------------------------------------------- the shard layout and its reader

_OFFSETS = np.dtype("<i8")
_CRC = np.dtype("<u4")
_PAYLOAD = np.dtype("|u1")
INDEX_HEAD_BYTES = 3 * 128  # the three .npy headers cachebuild writes are 128 bytes each
_SLACK = 4096  # headers written by other tools may be longer (numpy pads to 64 bytes)


def write_shard(f: IO[bytes], payloads: Sequence[bytes], crcs: Sequence[int], algorithm: Digest) -> tuple[str, int]:
    """Write one shard (see the module doc) to ``f``; returns (``algorithm``'s digest of every byte written, size)."""
    offsets = np.zeros(len(payloads) + 1, dtype=_OFFSETS)
    np.cumsum([len(p) for p in payloads], out=offsets[1:])
    h = algorithm.new()
    size = 0
    parts: list[bytes | memoryview] = [
        npy_header_bytes(_OFFSETS, (len(offsets),)), offsets.tobytes(),
        npy_header_bytes(_CRC, (len(crcs),)), np.asarray(crcs, dtype=_CRC).tobytes(),
        npy_header_bytes(_PAYLOAD, (int(offsets[-1]),)), *payloads,
    ]
    for part in parts:
        f.write(part)
        h.update(part)
        size += len(part)
    return h.hexdigest(), size


def index_bytes(count: int) -> int:
    """Bytes to read from the start of a shard of ``count`` samples to hold its whole index."""
    return INDEX_HEAD_BYTES + _OFFSETS.itemsize * (count + 1) + _CRC.itemsize * count + _SLACK


@dataclass(frozen=True)
class ShardIndex:
    """One shard: samples ``[start, start + count)`` of file ``name``; sample ``start + j`` is the bytes
    ``[payload_start + offsets[j], payload_start + offsets[j + 1])`` of the file."""

    name: str
    start: int
    count: int
    payload_start: int
    offsets: np.ndarray  # int64 (count + 1,)
    crc: np.ndarray  # uint32 (count,)

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self.payload_start + int(self.offsets[-1])


def _read_header(f: io.BytesIO, dtype: np.dtype, where: str, what: str) -> int:
    """The length of the 1-D ``dtype`` .npy record starting at ``f``'s position (left after its header)."""
    _, shape, got = npy_header(f, f"{where}: the {what} record")
    if got != dtype or len(shape) != 1:
        raise CacheCorruptError(f"{where}: the {what} record holds {got}{list(shape)}, expected a 1-D {dtype} array")
    return int(shape[0])


def _read_npy(f: io.BytesIO, dtype: np.dtype, where: str, what: str) -> np.ndarray:
    n = _read_header(f, dtype, where, what)
    data = f.read(n * dtype.itemsize)
    if len(data) != n * dtype.itemsize:
        raise CacheCorruptError(f"{where} is truncated inside its {what} record")
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="))


def parse_index(head: bytes, name: str, start: int, count: int, where: str) -> ShardIndex:
    """The index of a shard from its first :func:`index_bytes` bytes, checked against the manifest's count."""
    f = io.BytesIO(head)
    offsets = _read_npy(f, _OFFSETS, where, "offsets")
    crc = _read_npy(f, _CRC, where, "crc32")
    payload = _read_header(f, _PAYLOAD, where, "payload")
    if len(offsets) != count + 1 or len(crc) != count:
        raise CacheCorruptError(f"{where} indexes {len(crc)} samples, the manifest says {count}")
    if offsets[0] != 0 or np.any(np.diff(offsets) <= 0) or offsets[-1] != payload:
        raise CacheCorruptError(f"{where}: its offsets do not tile its payload of {payload} bytes "
                                f"(each sample must be a non-empty, in-order byte range)")
    return ShardIndex(name, start, count, f.tell(), offsets, crc)


class PayloadFiles(ShardHandles):
    """Read samples' stored bytes from shards under ``location`` (picklable; files opened lazily per process)."""

    def __init__(self, location: Location, shards: Sequence[ShardIndex], *, block_cache: BlockCache | None = None,
                 cache_id: str = "") -> None:
        super().__init__(location, len(shards), block_cache, cache_id)
        self.shards = tuple(shards)
        self.starts = np.array([s.start for s in self.shards] + [self.shards[-1].start + self.shards[-1].count
                                                                 if self.shards else 0], dtype=np.int64)
        # Per sample, in file coordinates: one searchsorted away from any batch's byte ranges.
        self.begin = np.concatenate([s.payload_start + s.offsets[:-1] for s in self.shards] or [np.empty(0, np.int64)])
        self.end = np.concatenate([s.payload_start + s.offsets[1:] for s in self.shards] or [np.empty(0, np.int64)])
        self.crc = np.concatenate([s.crc for s in self.shards] or [np.empty(0, np.uint32)])

    def shard_of(self, i: int) -> ShardIndex:
        return self.shards[int(np.searchsorted(self.starts, i, side="right")) - 1]

    def _name_and_size(self, k: int) -> tuple[str, int]:
        return self.shards[k].name, self.shards[k].size

    def _open_local(self, k: int) -> np.ndarray:
        """Shard ``k`` as a uint8 array over its memory map."""
        s = self.shards[k]
        path = self.location.describe(s.name)
        try:
            with self.location.open_file(s.name) as f:  # rename-safe (pinned)
                size = os.fstat(f.fileno()).st_size
                if size < s.size:
                    raise CacheCorruptError(f"{path} is truncated: {size} bytes, its index needs {s.size}")
                mm = mmap.mmap(f.fileno(), s.size, prot=mmap.PROT_READ) if s.size else b""
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}, listed in the manifest, is missing") from None
        return np.frombuffer(mm, dtype=np.uint8)

    def read(self, idx: np.ndarray) -> list[Any]:
        """The stored bytes of samples ``idx`` (any order, in range), as buffers in that order. Local
        samples are zero-copy views of the memory maps; remote ones are fetched in one concurrent pass
        over every shard (:meth:`read_files`), consecutive samples as one range."""
        out: list[Any] = [None] * len(idx)
        if not len(idx):
            return out
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        seg_of = np.searchsorted(self.starts, sorted_idx, side="right") - 1
        begin, end = self.begin[sorted_idx].tolist(), self.end[sorted_idx].tolist()
        bounds = np.flatnonzero(np.diff(seg_of)) + 1
        wanted: list[tuple[int, list[tuple[int, int]]]] = []
        places: list[list[tuple[int, int]]] = []
        for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(sorted_idx)].tolist(), strict=True):
            k = int(seg_of[lo])
            if self.location.is_local:
                f = self._handle(k)
                for j in range(lo, hi):
                    out[order[j]] = f[begin[j] : end[j]]
                continue
            # Runs of samples stored back to back become one range: the bytes fetched are the bytes needed.
            runs, a = [], lo
            for j in range(lo + 1, hi + 1):
                if j == hi or begin[j] != end[j - 1]:
                    runs.append((a, j))
                    a = j
            wanted.append((k, [(begin[a], end[z - 1]) for a, z in runs]))
            if self.whole_files:
                self.read_whole(k)
            places.append(runs)
        for runs, datas in zip(places, self.read_files(wanted), strict=True):
            for (a, z), data in zip(runs, datas, strict=True):
                view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data
                base = begin[a]
                for j in range(a, z):
                    out[order[j]] = view[begin[j] - base : end[j] - base]
        return out


# ---------------------------------------------------------------- the kind

MAX_DECODE_THREADS = 4
RETIRED_DECODE_THREADS = "CACHEBUILD_DECODE_THREADS"
_CHUNK_BYTES = 8 << 20  # the sampler's read unit: ~8 MB of stored bytes, as for npy rows


def shard_file_name(index: int) -> str:
    return f"images-{index:05d}.jpegs"


def decode_threads(requested: int | None = None) -> int:
    """How many threads decode a batch of a compact cache here: the one rule. ``requested``
    (``DatasetOptions(decode_threads=)``) when given; else the CPUs this process may use divided among the
    DataLoader's workers when in one, at most ``MAX_DECODE_THREADS``."""
    if requested is not None:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = 1
    data = sys.modules.get("torch.utils.data")  # never imported here: only asked when the caller uses torch
    if data is not None:
        info = data.get_worker_info()
        if info is not None:
            workers = info.num_workers
    return max(1, min(MAX_DECODE_THREADS, cpus // workers))


def _check_retired_setting() -> None:
    """The decode threads were once also set by an environment variable: one that is still set stops the open."""
    if os.environ.get(RETIRED_DECODE_THREADS, "").strip():
        raise OptionError(f"{RETIRED_DECODE_THREADS} is no longer read: pass DatasetOptions(decode_threads=N) to "
                          f"set the threads that decode a compact cache, and unset {RETIRED_DECODE_THREADS}")


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
        data = encode(self.slot, self.quality, self.subsampling)
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
            paths = json.loads(self.location.read_bytes(self.manifest.arrays["paths"].file))
            source = f" ({decode_path(paths[i])})"
        except (CacheCorruptError, RemoteError, OSError, IndexError, KeyError, TypeError, ValueError):
            pass
        return CacheCorruptError(
            f"sample {i}{source} of {self.location.describe(shard.name)} is damaged: {why}; "
            f"`cachebuild verify` lists every damaged shard; rebuild the cache (or fetch it again)")

    def _check(self, i: int, data: Any) -> None:
        if zlib.crc32(data) != int(self.files.crc[i]):
            raise self._damaged(i, "its stored JPEG fails its crc32 checksum")

    # ------------------------------------------------------------ reading
    def _threads(self) -> ThreadPoolExecutor | None:
        n = decode_threads(self.decode_threads)
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
                decode_into(data, out[pos])
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

    def build_params(self, opts: StorageParams) -> dict[str, Any]:
        quality, subsampling = opts.quality, opts.subsampling
        check_params(quality, subsampling)
        if opts.compression != "none":
            raise OptionError(f"jpeg caches take no chunk compression (the JPEG is the compression); "
                             f"got compression={opts.compression!r}")
        return {"chunk_size": None, "compression": "none", "codec": "jpeg", "quality": quality,
                "subsampling": subsampling, "encoder": ENCODER}

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
        _check_retired_setting()
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
