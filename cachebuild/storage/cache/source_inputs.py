"""``source_files.json``: the per-file inputs of the source digest, as the build saw them.

The source digest in the manifest (`source.fingerprint`) says *whether* the source changed; this table, one row
per planned file (relative path, label, size, mtime in ns; size -1 for an entry that could not be stat'ed), lets
``cachebuild status`` say *what* changed (files added, removed, modified) without decoding anything. Written for
sources of files; the manifest names it in ``source.inputs`` with its checksum (``digest``, the manifest's
algorithm; ``sha256`` in format versions 1-3). About 70 bytes per file
(ImageNet train: ~90 MB beside a ~190 GB cache).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from cachebuild.atomic import write_bytes_atomic
from cachebuild.errors import CacheCorruptError, RemoteError
from cachebuild.format.manifest import BUILD, FORMAT_VERSION, Manifest, entry_key
from cachebuild.storage import Location, check_name

__all__ = ["INPUTS_FORMAT", "SOURCE_INPUTS", "SourceInputs", "load_source_inputs", "save_source_inputs"]

SOURCE_INPUTS = "source_files.json"
INPUTS_FORMAT = "cachebuild-source-files"



class SourceInputs(NamedTuple):
    """The table as arrays: ``keys`` in the build's plan order and one int64 row (label, size, mtime_ns) each
    (half the memory of a dict of tuples: ~330 bytes a file while parsing, most of it the JSON)."""

    keys: list[str]
    rows: np.ndarray


def save_source_inputs(folder: Path, keys: Sequence[str], labels: np.ndarray, stats: np.ndarray) -> dict[str, Any]:
    """Write the table into ``folder``; returns the manifest's ``source.inputs`` entry."""
    doc = {"format": INPUTS_FORMAT, "keys": list(keys), "labels": np.asarray(labels).tolist(),
           "sizes": stats[:, 0].tolist(), "mtimes_ns": stats[:, 1].tolist()}
    data = json.dumps(doc, ensure_ascii=True).encode()  # ASCII: undecodable names survive as \udcxx escapes
    write_bytes_atomic(folder / SOURCE_INPUTS, data, durable=False)
    return {"file": SOURCE_INPUTS, entry_key(FORMAT_VERSION): BUILD.of(data)}  # a build's: format version 4


def load_source_inputs(location: Location, manifest: Manifest) -> SourceInputs | None:
    """The build's per-file inputs, or None when the cache has none (older caches, CIFAR)."""
    ref = manifest.source.get("inputs")
    if not ref:
        return None
    if not isinstance(ref, dict):
        raise CacheCorruptError(f"manifest field 'source.inputs' must be an object, got {ref!r}")
    name = check_name(ref.get("file"), "source.inputs.file")
    where = location.describe(name)
    try:
        data = location.read_bytes(name)
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"{where}, named by the manifest, cannot be read: {e}") from None
    if manifest.digest.of(data) != ref.get(entry_key(manifest.format_version)):
        raise CacheCorruptError(f"{where} does not match the checksum its manifest records: damaged; re-fetch "
                                f"or rebuild the cache")
    try:
        doc = json.loads(data)
        keys = doc["keys"]
        columns = [np.asarray(doc.pop(c), dtype=np.int64) for c in ("labels", "sizes", "mtimes_ns")]
        if not isinstance(keys, list) or not set(map(type, keys)) <= {str} or \
                any(c.shape != (len(keys),) for c in columns):
            raise ValueError("keys must be strings, one label, size and mtime each")
        return SourceInputs(keys, np.stack(columns, axis=1) if keys else np.zeros((0, 3), np.int64))
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CacheCorruptError(f"{where} is not a valid source table: {e}") from None
