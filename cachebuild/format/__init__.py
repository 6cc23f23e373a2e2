"""The on-disk cache format: spec in ``docs/FORMAT.md``, code here (manifest, side arrays, reader, writer).
How pixels are stored is each storage backend's business (``cachebuild.storage``)."""

from cachebuild.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ArrayInfo,
    Failure,
    Manifest,
    ShardInfo,
    read_manifest,
)
from cachebuild.format.writer import commit_cache, staging_path, write_cache

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ArrayInfo",
    "Failure",
    "Manifest",
    "ShardInfo",
    "commit_cache",
    "read_manifest",
    "staging_path",
    "write_cache",
]
