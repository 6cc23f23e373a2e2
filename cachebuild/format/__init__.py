"""The on-disk cache format, as a leaf spec: the manifest's fields, their parsing and serialisation, the
encoding of file names, a cache's identity. Prose in ``docs/FORMAT.md``. No file I/O and no backend registry
here: reading and writing a cache's files is ``cachebuild.storage`` (``reader``, ``writer``, ``side_arrays``,
``file_table``); how pixels are stored is each storage backend's business."""

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

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ArrayInfo",
    "ColumnInfo",
    "Failure",
    "Manifest",
    "ShardInfo",
]
