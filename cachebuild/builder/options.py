"""What a build is asked for (``BuildOptions``: every flag of the build commands, declared and checked once),
what identifies the result (:func:`build_key`) and what a build reports (``BuildResult``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachebuild.builder.sample import DEFAULT_MAX_PIXELS, EXIF_ORIENTATIONS, FITS, INTERPOLATIONS, PIXEL_RECIPE
from cachebuild.errors import OptionError
from cachebuild.format.manifest import FORMAT_VERSION
from cachebuild.options import REQUIRED, Options, option, wait_option
from cachebuild.storage import DEFAULT_STORAGE, STORAGE_KINDS, get_backend
from cachebuild.storage.kinds.jpeg import SUBSAMPLINGS
from cachebuild.storage.kinds.zarr import COMPRESSIONS

if TYPE_CHECKING:
    from cachebuild.sources.plan import Plan

__all__ = ["COMPRESSIONS", "DECODE_DEVICES", "EXIF_ORIENTATIONS", "MAX_SIZE", "ON_ERROR", "PIXEL_RECIPE",
           "SUBSAMPLINGS", "BuildOptions", "BuildResult", "build_key", "pixel_recipe", "recipe_differences"]

BLOCK_TARGET_BYTES = 64 << 20  # ~64 MB of pixels per block/shard: few files, tasks long enough to amortise
MIN_BLOCKS = 64  # a plan of n files makes at least min(64, n / 64) blocks
DECODE_DEVICES = ("cpu", "cuda")
ON_ERROR = ("skip", "fail")
MAX_SIZE = 16384  # output side: one sample is then 768 MB


def _nonzero(jobs: int) -> None:
    if jobs == 0:
        raise OptionError("jobs must be a positive count or -1 (all cores), not 0")


@dataclass(frozen=True)
class BuildOptions(Options):
    """Every setting of a build; ``cachebuild <kind> SRC`` offers each field as its flag."""

    size: int = option(REQUIRED, "Output side S: every sample is S x S x 3 uint8.", min=1, max=MAX_SIZE)
    storage: str = option(DEFAULT_STORAGE, "npy: fixed-shape shards to memory-map; zarr: one v3 array chunked "
                          "along samples; jpeg: each sample one JPEG (a compact cache, ~10x smaller at 224 px, "
                          "decoded when read).", flag="--format", choices=STORAGE_KINDS)
    fit: str = option("crop", "crop: short side to S then centre crop; squash: to SxS; pad: letterbox, boxes "
                      "recorded.", choices=FITS)
    interpolation: str = option("antialias", "antialias: torchvision's PIL filter (bilinear below a 2x downscale, "
                                "widened from there on); area/linear: OpenCV's.", choices=INTERPOLATIONS)
    jobs: int = option(-1, "Parallel workers; -1: all cores.", short="-j", check=_nonzero)
    block_size: int | None = option(None, "Samples per block and npy shard (zarr: rounded down to whole chunks). "
                                    "Default: about 64 MB of pixels.", flag="--shard-size", min=1)
    chunk_size: int | None = option(None, "zarr: samples per chunk. Default: about 4 MB of pixels.", min=1)
    compression: str = option("none", "zarr chunk compression.", choices=COMPRESSIONS)
    quality: int = option(90, "--format jpeg: encoder quality.", min=1, max=100)
    subsampling: str = option("420", "--format jpeg: chroma subsampling (444 keeps full colour resolution, "
                              "~1.3x the bytes).", choices=SUBSAMPLINGS)
    decode_device: str = option("cpu", "cuda: decode source JPEGs in batches with nvJPEG and resize on the GPU, one "
                                "worker per GPU (close to, not byte-equal with, a CPU build); files nvJPEG cannot "
                                "take go to the CPU.", choices=DECODE_DEVICES)
    on_error: str = option("skip", "skip: list bad files in the manifest and go on; fail: stop at the first.",
                           choices=ON_ERROR)
    exif_orientation: str = option("ignore", "ignore: the stored pixels, as torchvision's PIL-based ImageFolder "
                                   "sees them; apply: turned upright by the file's EXIF orientation tag (as a "
                                   "photo viewer shows them, PIL's ImageOps.exif_transpose).",
                                   choices=EXIF_ORIENTATIONS)
    max_pixels: int = option(DEFAULT_MAX_PIXELS, "Refuse, before decoding, any image whose header declares more "
                             "pixels.", min=1)
    reduced_decode: bool = option(True, None, hidden=True)  # JPEGs decoded at a DCT scale when large
    force: bool = option(False, "Replace a different cache already at --out.")
    update: bool = option(False, "--out holds this recipe's cache of an earlier state of SRC: decode only the files "
                          "added or changed, copy every other sample's stored bytes, drop removed ones (as a fresh "
                          "build of SRC, replaced as --force replaces).")
    summary: str | None = option(None, "Write a JSON summary there: decoded, reused, skipped, seconds (per split "
                                 "and in all).", flag="--json", metavar="FILE")
    lock_wait: float | None = wait_option()
    progress: bool | None = option(None, "Progress bar (default: on a terminal).")

    def __post_init__(self) -> None:
        """Every value checked here, so a build that cannot be right never starts."""
        super().__post_init__()
        if self.update and self.force:
            raise OptionError("update and force exclude each other: --update reuses the cache at --out, "
                              "--force rebuilds it from nothing; pass one")
        try:  # what only the storage kind knows (e.g. npy and jpeg shards take no compression)
            get_backend(self.storage).build_params(self)
        except ValueError as e:
            raise OptionError(str(e)) from None

    def resolved_block(self, planned: int | None = None) -> int:
        """Samples per block: ``block_size``, else ~64 MB of pixels, but small enough that a plan of ``planned``
        files makes >= 64 blocks, so every worker stays busy to the end of a small build. It depends on the
        plan alone, never on ``jobs``, so the shard layout does not either."""
        per = self.size * self.size * 3
        block = self.block_size or int(min(8192, max(64, BLOCK_TARGET_BYTES // per // 64 * 64)))
        if not self.block_size and planned:
            block = min(block, max(64, -(-planned // MIN_BLOCKS // 64) * 64))
        return get_backend(self.storage).align_block(block, self)

    def resolved_chunk(self) -> int | None:
        """Samples per chunk of the storage kind (None for kinds without chunks)."""
        return get_backend(self.storage).build_params(self).get("chunk_size")


def build_key(plan: Plan, opts: BuildOptions) -> tuple[str, dict[str, Any]]:
    """(the build key, the parameters it covers): sha256 of the source digest and every parameter that shapes
    the cache's bytes. Another key is another cache."""
    params: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "size": opts.size,
        "fit": opts.fit,
        "interpolation": opts.interpolation,
        "storage": opts.storage,
        "block_size": opts.resolved_block(len(plan)),
        **get_backend(opts.storage).build_params(opts),  # chunk_size, compression; quality, subsampling
        "max_pixels": opts.max_pixels,
        "reduced_decode": opts.reduced_decode,
        "pixel_recipe": PIXEL_RECIPE,
    }
    if opts.decode_device != "cpu":  # other pixels than a CPU build (close, not equal): another cache
        params["decode_device"] = opts.decode_device
    if opts.exif_orientation != "ignore":  # the default adds nothing: caches of earlier releases keep their key
        params["exif_orientation"] = opts.exif_orientation
    blob = json.dumps({"source": plan.source_digest, "params": params}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest(), params


# Build parameters that differ between two caches of one recipe: the key itself, the block size (from the plan's
# length), what shapes no pixel (the file format's version among them), and how a release makes pixels (the
# pixel recipe, and what earlier releases recorded of theirs).
_NOT_RECIPE = frozenset({"key", "block_size", "on_error", "format_version", "pixel_recipe", "antialias_from",
                         "reduced_geometry"})
# Parameters whose absence means a value: the key leaves out a default (earlier releases' caches keep theirs), and
# earlier releases recorded EXIF orientation as "ignored".
_IMPLIED = {"exif_orientation": "ignore"}
_SPELLINGS = {("exif_orientation", "ignored"): "ignore"}


def _recipe_of(build: dict[str, Any]) -> dict[str, Any]:
    seen = {**_IMPLIED, **{k: v for k, v in build.items() if k not in _NOT_RECIPE}}
    return {k: _SPELLINGS.get((k, v), v) if isinstance(v, str) else v for k, v in seen.items()}


def pixel_recipe(build: dict[str, Any]) -> int:
    """The pixel recipe a manifest's ``build`` section records (caches made before it was recorded: 1)."""
    recipe = build.get("pixel_recipe", 1)
    return recipe if isinstance(recipe, int) and not isinstance(recipe, bool) else 1


def recipe_differences(old: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """What makes a cache's recipe (its manifest's ``build``) another than ``params``: ``name: old -> new``
    for each parameter a user chose differently."""
    was, now = _recipe_of(old), _recipe_of(params)
    return [f"{k} {was.get(k, '(none)')} -> {now.get(k, '(none)')}"
            for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]


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

    def summary(self) -> dict[str, Any]:
        """What ``--json FILE`` writes: integer counts and the seconds."""
        return {"path": str(self.path), "status": self.status, "count": self.count, "decoded": self.decoded,
                "reused": self.reused, "skipped": self.failures, "seconds": round(self.seconds, 3),
                "bytes_written": self.bytes_written}

    @property
    def images_per_second(self) -> float:
        return (self.count + self.failures) / self.seconds if self.seconds > 0 else float("nan")
