"""What a build is asked for (``BuildOptions``, every value checked on construction) and what it reports."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cachebuild.builder.sample.geometry import DEFAULT_MAX_PIXELS, FITS, INTERPOLATIONS
from cachebuild.errors import OptionError
from cachebuild.options import parse_bool, parse_choice, parse_float, parse_int, parse_optional_bool
from cachebuild.storage import DEFAULT_STORAGE, backend_names, get_backend
from cachebuild.storage.kinds import jpeg as jpeg_codec
from cachebuild.storage.kinds import zarr as zarr_write

__all__ = ["COMPRESSIONS", "DECODE_DEVICES", "MAX_SIZE", "ON_ERROR", "SUBSAMPLINGS", "WORKERS", "BuildOptions",
           "BuildResult"]

BLOCK_TARGET_BYTES = 64 << 20  # ~64 MB of pixels per block/shard: few files, tasks long enough to amortise
MIN_BLOCKS = 64  # a plan of n files makes at least min(64, n / 64) blocks
# chunk codecs (zarr) and chroma subsampling (jpeg): declared once, by the storage kinds that use them
COMPRESSIONS = zarr_write.COMPRESSIONS
SUBSAMPLINGS = jpeg_codec.SUBSAMPLINGS
DECODE_DEVICES = ("cpu", "cuda")
ON_ERROR = ("skip", "fail")
WORKERS = ("auto", "processes", "threads")  # what runs a local CPU build's --jobs blocks
MAX_SIZE = 16384  # output side: one sample is then 768 MB


@dataclass(frozen=True)
class BuildOptions:
    size: int
    fit: str = "crop"
    interpolation: str = "antialias"
    storage: str = DEFAULT_STORAGE
    jobs: int = -1
    workers: str = "auto"  # "processes", "threads", or auto: the choice of cachebuild.builder.worker_kind
    block_size: int | None = None  # samples per block (= per npy shard); default from BLOCK_TARGET_BYTES
    chunk_size: int | None = None  # samples per chunk, for storage kinds that chunk (zarr)
    compression: str = "none"
    quality: int = 90  # storage kinds that encode samples (jpeg): encoder quality 1..100
    subsampling: str = "420"  # ... and chroma subsampling, "420" or "444"
    decode_device: str = "cpu"  # "cuda": decode source JPEGs in batches on the GPU (cachebuild.builder.gpu_build)
    on_error: str = "skip"  # or "fail"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = True
    force: bool = False
    update: bool = False  # --out holds this recipe's cache of an earlier source: decode only what changed
    summary: str | None = None  # --json FILE: write what the build did there (decoded, reused, skipped, seconds)
    progress: bool | None = None  # None: a bar when stderr is a terminal
    lock_wait: float | None = None  # another build of the same output: None fail at once, N s, math.inf

    def __post_init__(self) -> None:
        """Every value checked here, so a build that cannot be right never starts (an unknown ``fit``
        would build a cache no reader opens; an unknown interpolation would be recorded but not used)."""
        parse_int("size", self.size, 1, MAX_SIZE)
        parse_choice("fit", self.fit, FITS)
        parse_choice("interpolation", self.interpolation, INTERPOLATIONS)
        parse_choice("storage", self.storage, backend_names())
        parse_int("jobs", self.jobs, not_zero=True)
        parse_choice("workers", self.workers, WORKERS)
        parse_int("block_size", self.block_size, 1, optional=True)
        parse_int("chunk_size", self.chunk_size, 1, optional=True)
        parse_choice("compression", self.compression, COMPRESSIONS)
        parse_int("quality", self.quality, 1, 100)
        parse_choice("subsampling", self.subsampling, SUBSAMPLINGS)
        parse_choice("decode_device", self.decode_device, DECODE_DEVICES)
        parse_choice("on_error", self.on_error, ON_ERROR)
        parse_int("max_pixels", self.max_pixels, 1)
        parse_bool("reduced_decode", self.reduced_decode)
        parse_bool("force", self.force)
        parse_bool("update", self.update)
        if self.update and self.force:
            raise OptionError("update and force exclude each other: --update reuses the cache at --out, "
                              "--force rebuilds it from nothing; pass one")
        if self.summary is not None and (not isinstance(self.summary, str) or not self.summary):
            raise OptionError(f"summary must be a file name; got {self.summary!r}")
        parse_optional_bool("progress", self.progress)
        if self.lock_wait is not None and self.lock_wait != math.inf:  # inf: wait as long as it takes
            parse_float("lock_wait", self.lock_wait, 0.0)
        try:  # what only the storage kind knows (e.g. npy and jpeg shards take no compression)
            get_backend(self.storage).build_params(self)
        except ValueError as e:
            raise OptionError(str(e)) from None

    def resolved_block(self, planned: int | None = None) -> int:
        """Samples per block: ``block_size``, else ~64 MB of pixels, but small enough that a plan of
        ``planned`` files makes >= 64 blocks (so every worker stays busy to the end of a small build:
        at 21 blocks for 2 workers the last one ran alone ~10% of the time). It depends on the plan alone,
        never on --jobs, so the shard layout does not either."""
        per = self.size * self.size * 3
        block = self.block_size or int(min(8192, max(64, BLOCK_TARGET_BYTES // per // 64 * 64)))
        if not self.block_size and planned:
            block = min(block, max(64, -(-planned // MIN_BLOCKS // 64) * 64))
        return get_backend(self.storage).align_block(block, self)

    def resolved_chunk(self) -> int | None:
        """Samples per chunk of the storage kind (None for kinds without chunks)."""
        return get_backend(self.storage).build_params(self).get("chunk_size")


@dataclass(frozen=True)
class BuildResult:
    path: Path
    status: str  # "built" | "up to date"
    count: int
    failures: int
    seconds: float
    bytes_written: int
    decoded: int = 0  # source files decoded (those that failed among them: ``failures``)
    reused: int = 0  # samples whose stored bytes an update copied from the cache it replaced

    def summary(self) -> dict[str, object]:
        """What ``--json FILE`` writes: integer counts and the seconds."""
        return {"path": str(self.path), "status": self.status, "count": self.count, "decoded": self.decoded,
                "reused": self.reused, "skipped": self.failures, "seconds": round(self.seconds, 3),
                "bytes_written": self.bytes_written}

    @property
    def images_per_second(self) -> float:
        return (self.count + self.failures) / self.seconds if self.seconds > 0 else float("nan")
