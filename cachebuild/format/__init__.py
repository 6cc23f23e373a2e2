"""The on-disk cache format, as a leaf spec (``cachebuild.format.manifest``; prose in ``docs/FORMAT.md``): the
manifest's fields, their parsing and serialisation, the checksum of each format version, the encoding of file
names, a cache's identity. No file I/O and no backend registry: reading and writing a cache's files is
``cachebuild.storage``."""

from cachebuild.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ArrayInfo,
    ColumnInfo,
    Failure,
    Manifest,
    ShardInfo,
)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "ArrayInfo", "ColumnInfo", "Failure", "Manifest",
           "ShardInfo"]
