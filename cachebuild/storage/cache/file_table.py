"""``files.json``: the size and checksum of every file of a cache, as bytes on disk.

The manifest's checksums are of *content* (pixel bytes of a shard range, decoded zarr slices, array data),
which a transfer cannot check one file at a time (a zarr shard range spans many chunk files). The table
lists every file of the cache but ``manifest.json`` and itself, so ``pull`` and ``push`` check each file
whole as it arrives or leaves, and ``verify --quick`` checks every size, whatever the storage kind. The
manifest's optional ``files`` field names the table and holds its checksum, so the table is as trustworthy
as the manifest; caches built before it existed simply have no ``files`` field. Every checksum of the table,
and the table's own, is by the manifest's algorithm (``Manifest.digest``: sha256 before format version 4,
xxh3-128 in a build of this release); a version 4 table names it too (``"digest"``), for readers without
the manifest at hand.

The table is written at commit. Shard files whose manifest checksum is already the file's own digest
(npy since format version 2, jpeg) take it from the manifest: their writers hashed every byte as they
wrote it, and hashing them again cost ~12% of a 2-process build. The other files (zarr chunks, side
arrays) are hashed in parallel threads, mostly from the page cache.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from cachebuild.atomic import is_temporary_name, write_bytes_atomic
from cachebuild.errors import CacheCorruptError, RemoteError
from cachebuild.format.manifest import COLUMNS_DIR, DIGEST_VERSION, MANIFEST_NAME, Digest, Manifest
from cachebuild.storage import Location, check_name, get_backend
from cachebuild.storage.kinds.base import digest_file

__all__ = [
    "FILE_TABLE",
    "TABLE_FORMAT",
    "FileEntry",
    "compute_file_table",
    "is_unfinished_write",
    "local_files",
    "parse_file_table",
    "read_file_table",
    "with_file_table",
]

FILE_TABLE = "files.json"
TABLE_FORMAT = "cachebuild-files"
_ZARR_TMP = re.compile(r"\.[0-9a-f]{32}\.partial$")  # zarr-python's LocalStore writes "<key>.<uuid4 hex>.partial"


def is_unfinished_write(name: str) -> bool:
    """A temporary file of a write that never finished (ours or zarr's): never part of a cache."""
    return is_temporary_name(name) or bool(_ZARR_TMP.search(name))


@dataclass(frozen=True)
class FileEntry:
    size: int
    digest: str  # by the algorithm of the cache's manifest


def local_files(folder: Path, skip: Iterable[str] = (MANIFEST_NAME, FILE_TABLE)) -> dict[str, int]:
    """Every regular file below ``folder`` (relative name -> size), without ``skip`` and unfinished writes."""
    skipped = set(skip)
    out: dict[str, int] = {}
    for dirpath, _, names in os.walk(folder):
        rel = os.path.relpath(dirpath, folder)
        for name in names:
            full = os.path.join(dirpath, name)
            key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
            if key in skipped or is_unfinished_write(name) or not os.path.isfile(full) or os.path.islink(full):
                continue
            out[key] = os.stat(full).st_size
    return out


def compute_file_table(folder: Path, algorithm: Digest, jobs: int | None = None,
                       known: Mapping[str, str] | None = None) -> dict[str, FileEntry]:
    """Size and ``algorithm``'s digest of every file of the cache in ``folder`` (sorted by name); files in
    ``known`` (name -> digest of the file, as its writer hashed it while writing) are not read again."""
    # not the column files (an update carries them over): the manifest holds their sums, and `columns rm`
    # deletes them without rewriting this table
    sizes = {n: s for n, s in local_files(folder).items() if not n.startswith(f"{COLUMNS_DIR}/")}
    known = known or {}
    todo = sorted(n for n in sizes if n not in known)
    workers = jobs or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = dict(zip(todo, pool.map(lambda n: digest_file(folder / n, algorithm), todo), strict=True))
    return {n: FileEntry(sizes[n], digests[n] if n in digests else known[n]) for n in sorted(sizes)}


def _encode(table: dict[str, FileEntry], manifest: Manifest) -> bytes:
    rows = [[name, e.size, e.digest] for name, e in sorted(table.items())]
    # One file per line: readable, and diffs of two tables stay small.
    body = ",\n".join(json.dumps(r, ensure_ascii=True) for r in rows)
    named = f', "digest": "{manifest.digest.name}"' if manifest.format_version >= DIGEST_VERSION else ""
    return f'{{"format": "{TABLE_FORMAT}"{named}, "files": [\n{body}\n]}}\n'.encode()


def with_file_table(folder: Path, manifest: Manifest) -> Manifest:
    """Write ``files.json`` for the finished cache in ``folder``; return ``manifest`` naming it. Kinds whose
    shard checksum is the file's own (npy since format 2, jpeg) are not hashed a second time."""
    known = ({s.file: s.digest for s in manifest.shards}
             if manifest.format_version >= 2 and get_backend(manifest.storage).shard_digest_is_file else None)
    table = compute_file_table(folder, manifest.digest, known=known)
    data = _encode(table, manifest)
    write_bytes_atomic(folder / FILE_TABLE, data, durable=False)
    ref = {"table": FILE_TABLE, "digest": manifest.digest.of(data), "count": len(table),
           "bytes": sum(e.size for e in table.values())}
    return replace(manifest, files=ref)


def parse_file_table(data: bytes, manifest: Manifest, where: str) -> dict[str, FileEntry]:
    """Check ``data`` against the manifest's ``files`` checksum and parse it (every name inside the cache)."""
    ref = manifest.files
    if manifest.digest.of(data) != ref["digest"]:
        raise CacheCorruptError(f"{where} does not match the checksum its manifest records: damaged or from "
                                f"another version of the cache; re-fetch or rebuild the cache")
    try:
        doc = json.loads(data.decode("utf-8"))
        if doc.get("format") != TABLE_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {TABLE_FORMAT!r}")
        if doc.get("digest", "sha256") != manifest.digest.name:
            raise ValueError(f"its digest is {doc.get('digest')!r}, the manifest's {manifest.digest.name!r}")
        table = {}
        for name, size, digest in doc["files"]:
            if not isinstance(size, int) or size < 0 or not isinstance(digest, str):
                raise ValueError(f"bad entry for {name!r}")
            table[check_name(name, "files.json name")] = FileEntry(size, digest)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, CacheCorruptError):
            raise
        raise CacheCorruptError(f"{where} is not a valid file table: {e}") from None
    if MANIFEST_NAME in table or ref["table"] in table or len(table) != ref["count"]:
        raise CacheCorruptError(f"{where} lists {len(table)} files, its manifest says {ref['count']} (and never "
                                f"{MANIFEST_NAME} or the table itself)")
    return table


def read_file_table(location: Location, manifest: Manifest) -> tuple[dict[str, FileEntry], bytes] | None:
    """(table, its bytes) of the cache at ``location``; None for a cache built before tables existed."""
    if not manifest.files:
        return None
    name = manifest.files["table"]
    try:
        data = location.read_bytes(name)
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"file table {location.describe(name)}, named by the manifest, cannot be read: "
                                f"{e}") from None
    return parse_file_table(data, manifest, location.describe(name)), data
