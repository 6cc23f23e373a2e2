"""``verify`` finds any flipped byte: in every file of a real build, the manifest and its file table included.

Each file of a cache built from real photos (npy, zarr raw and zstd, jpeg) gets single-bit flips at its
first and last byte and at random places; after each, opening the cache must raise a named cachebuild
error or ``verify`` must report a problem. Before the manifest carried its own checksum and ``verify``
checked the files the table lists, flips in class names, in ``files.json``, ``source_files.json`` and zarr
metadata passed, and some flips in an ``.npy`` header crashed the reader with a tokenizer error.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.errors import CacheBuildError, CacheCorruptError
from cachebuild.format.manifest import CHECKSUM_FIELD
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache, read_manifest

KINDS = {
    "npy": {},
    "zarr": {"storage": "zarr"},
    "zarr-zstd": {"storage": "zarr", "compression": "zstd"},
    "jpeg": {"storage": "jpeg"},
}
FLIPS_PER_FILE = 6  # first byte, last byte and 4 random ones


@pytest.fixture(scope="module", params=sorted(KINDS))
def built(request, imagenet_clean, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"verify-{request.param}") / "c"
    plan = imagenet_plans(imagenet_clean["root"], "train")[0]
    build(plan, out, BuildOptions(size=24, jobs=1, block_size=16, **KINDS[request.param]))
    assert open_cache(out).verify() == []
    return out


def _problems(root: Path) -> list[str]:
    try:
        return open_cache(root).verify()
    except CacheBuildError as e:  # refused at open: named, never served
        return [str(e)]


def test_any_flipped_bit_in_any_file_is_found(built):
    rng = random.Random(7)
    files = sorted(p for p in built.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    assert {"manifest.json", "files.json", "source_files.json", "labels.npy"} <= {p.name for p in files}
    missed = []
    for path in files:
        original = path.read_bytes()
        spots = {0, len(original) - 1, *(rng.randrange(len(original)) for _ in range(FLIPS_PER_FILE - 2))}
        for at in sorted(spots):
            damaged = bytearray(original)
            damaged[at] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(damaged))
            try:
                if not _problems(built):
                    missed.append(f"{path.relative_to(built)}@{at}")
            finally:
                path.write_bytes(original)
    assert missed == []
    assert _problems(built) == []


def test_a_class_name_changed_in_the_manifest_is_refused_by_name(built):
    """A flipped byte that keeps the JSON valid (a class name) changes what a label means: refused at
    open with the manifest named, not served."""
    path = built / "manifest.json"
    raw = path.read_bytes()
    name = json.loads(raw)["classes"][1]
    changed = raw.replace(f'"{name}"'.encode(), f'"{name[:-1]}{chr(ord(name[-1]) ^ 1)}"'.encode(), 1)
    path.write_bytes(changed)
    try:
        with pytest.raises(CacheCorruptError, match=r"manifest\.json does not match its own checksum"):
            read_manifest(built)
    finally:
        path.write_bytes(raw)


def test_the_checksum_is_checkable_without_cachebuild(built):
    """The rule FORMAT.md states: sha256 of the file with the checksum's 64 hex digits read as zeros."""
    raw = (built / "manifest.json").read_bytes()
    seal = json.loads(raw)[CHECKSUM_FIELD]
    assert hashlib.sha256(raw.replace(seal.encode(), b"0" * 64)).hexdigest() == seal


def test_a_manifest_without_a_checksum_still_reads(built):
    """Caches of earlier releases have no checksum: read as before (and so does a hand-edited manifest
    whose checksum was removed, as the error message says to do)."""
    path = built / "manifest.json"
    raw = path.read_bytes()
    d = json.loads(raw)
    del d[CHECKSUM_FIELD]
    path.write_text(json.dumps(d, indent=1))
    try:
        assert read_manifest(built).count == d["count"] and open_cache(built).verify() == []
    finally:
        path.write_bytes(raw)


def test_every_flipped_bit_in_the_checksum_fields_name_is_refused(built):
    """A flip in the key (``"checksul"``) once read as a manifest without a checksum (one edited on purpose):
    each of the name's 64 bits, flipped, is refused or does not parse."""
    path = built / "manifest.json"
    raw = path.read_bytes()
    at = raw.rindex(f'"{CHECKSUM_FIELD}"'.encode()) + 1
    try:
        for i in range(len(CHECKSUM_FIELD) * 8):
            changed = bytearray(raw)
            changed[at + i // 8] ^= 1 << (i % 8)
            path.write_bytes(bytes(changed))
            with pytest.raises(CacheCorruptError):
                read_manifest(built)
    finally:
        path.write_bytes(raw)
