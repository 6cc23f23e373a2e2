"""Which checksum guards a cache's files: one map from a manifest to its hasher, so nothing else asks.

Format versions 1 to 3 check every file (shards, side arrays, columns, ``files.json``, ``source_files.json``)
with sha256, the key ``sha256`` beside each value. Version 4 names its algorithm once, in the manifest's
``digest_algorithm`` (``xxh3-128``: these checksums find damage, on disk or in transfer, not attack), and each
value sits under the key ``digest``. xxh3-128 hashes a 224 px sample (150,528 bytes) in 0.0037 ms against
sha256's 0.087 ms, and the npy sink's per-sample cost goes 0.163 -> 0.068 ms (``bench/scripts/sink_digest.py``).
Its hex is the canonical big-endian form, what ``xxh128sum`` prints for a file.

Identity stays sha256, whatever the version: the build key, the content id, the source fingerprint and the
manifest's own seal (``checksum``) cost nothing (a few kB) and are what a job pins or compares across
releases. A column file's name begins with its checksum, by the manifest's algorithm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import xxhash

from cachebuild.errors import CacheCorruptError, UnsupportedFormatError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer  # bytes, memoryview, a C-contiguous ndarray...

__all__ = ["ALGORITHMS", "BUILD", "DIGEST_VERSION", "SHA256", "XXH3_128", "Digest", "Hasher", "digest_for",
           "entry_key"]

DIGEST_VERSION = 4  # the first format version that names its algorithm (and keys each value ``digest``)


class Hasher(Protocol):
    """hashlib's and xxhash's incremental interface, as far as caches use it."""

    def update(self, data: ReadableBuffer, /) -> None: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Digest:
    """One checksum algorithm: its manifest name, a new incremental hasher, and its hex length."""

    name: str
    new: Callable[[], Hasher]
    hex_len: int

    def of(self, data: ReadableBuffer) -> str:
        """The hex digest of ``data`` (any C-contiguous buffer)."""
        h = self.new()
        h.update(data)
        return h.hexdigest()


SHA256 = Digest("sha256", hashlib.sha256, 64)
XXH3_128 = Digest("xxh3-128", xxhash.xxh3_128, 32)
ALGORITHMS = {d.name: d for d in (SHA256, XXH3_128)}
BUILD = XXH3_128  # what this release writes into every new cache (format version 4)


def digest_for(version: int, algorithm: object) -> Digest:
    """The algorithm of a manifest of format ``version`` whose ``digest_algorithm`` is ``algorithm`` (None: it
    has none). ``UnsupportedFormatError`` for a name this release does not know (a newer release's);
    ``CacheCorruptError`` for a version 4 manifest without one, or an older one with one (its readers would
    take its checksums for sha256)."""
    if version < DIGEST_VERSION:
        if algorithm is not None:
            raise CacheCorruptError(f"manifest field 'digest_algorithm': format version {version} names no digest "
                                    f"algorithm (its checksums are sha256), got {algorithm!r}")
        return SHA256
    if not isinstance(algorithm, str):
        raise CacheCorruptError(f"manifest field 'digest_algorithm' must name the checksum algorithm of a format "
                                f"version {version} cache, got {algorithm!r}")
    if algorithm not in ALGORITHMS:
        raise UnsupportedFormatError(f"this cache's checksums are {algorithm!r}, which this cachebuild does not "
                                     f"know ({', '.join(ALGORITHMS)}); use a cachebuild release that reads them")
    return ALGORITHMS[algorithm]


def entry_key(version: int) -> str:
    """The JSON key of each checksum value in a manifest (and ``files.json``'s ref) of format ``version``."""
    return "sha256" if version < DIGEST_VERSION else "digest"
