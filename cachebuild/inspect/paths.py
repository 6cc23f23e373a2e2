"""The source paths of a few samples, without decoding the whole ``paths.json``.

``paths.json`` is one JSON list (N strings, or ``{"bytes": ...}`` objects for non-UTF-8 names) with no
offset table. Parsing all of it costs ~0.5 s per million entries in Python objects; instead the element
boundaries are found in one vectorised pass over the bytes (quotes not escaped by an odd run of
backslashes, commas outside strings) and only the wanted entries are decoded. The file is still read
whole, like every side array (docs/FORMAT.md): a few tens of MB for ImageNet's 1.28M paths.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from cachebuild.errors import CacheCorruptError, RemoteError
from cachebuild.format.manifest import Manifest, decode_path
from cachebuild.storage import Location

__all__ = ["PathTable", "element_bounds", "paths_at"]

_QUOTE, _BACKSLASH, _COMMA = 0x22, 0x5C, 0x2C


def _unescaped_quotes(buf: np.ndarray) -> np.ndarray:
    quotes = np.flatnonzero(buf == _QUOTE)
    after_bs = quotes[(quotes > 0) & (buf[np.maximum(quotes - 1, 0)] == _BACKSLASH)]
    if not len(after_bs):  # nearly always: no file name holds a quote or ends in a backslash
        return quotes
    escaped = []
    for q in after_bs.tolist():  # rare: count the run of backslashes before this quote
        run = 0
        while q - 1 - run >= 0 and buf[q - 1 - run] == _BACKSLASH:
            run += 1
        if run % 2:
            escaped.append(q)
    return quotes[~np.isin(quotes, escaped)]


def element_bounds(data: bytes, where: str) -> np.ndarray:
    """Positions ``b`` such that element ``k`` of the JSON list in ``data`` is ``data[b[k] + 1 : b[k + 1]]``."""
    buf = np.frombuffer(data, dtype=np.uint8)
    text = data.strip()
    if not text.startswith(b"[") or not text.endswith(b"]"):
        raise CacheCorruptError(f"{where} is not a JSON list")
    start = data.index(b"[")
    end = data.rindex(b"]")
    quotes = _unescaped_quotes(buf)
    commas = np.flatnonzero(buf == _COMMA)
    outside = commas[np.searchsorted(quotes, commas) % 2 == 0]  # an even count of quotes before it
    if not data[start + 1 : end].strip():
        return np.array([start], dtype=np.int64)  # the empty list
    return np.concatenate([[start], outside, [end]]).astype(np.int64)


class PathTable:
    """``paths.json`` read once, its element boundaries found once; entries decoded on demand."""

    def __init__(self, location: Location, manifest: Manifest) -> None:
        self.count = manifest.count
        info = manifest.arrays.get("paths")
        self._data: bytes | None = None
        if info is None:  # caches without provenance: "?" for every sample
            return
        self._where = location.describe(info.file)
        try:
            self._data = location.read_bytes(info.file)
        except (FileNotFoundError, RemoteError) as e:
            raise CacheCorruptError(f"provenance file {self._where}, listed in the manifest, cannot be read: "
                                    f"{e}") from None
        self._bounds = element_bounds(self._data, self._where)
        if len(self._bounds) - 1 != manifest.count:
            raise CacheCorruptError(f"{self._where} lists {len(self._bounds) - 1} paths, the manifest counts "
                                    f"{manifest.count} samples")

    def at(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The source path of each sample in ``indices`` (in that order)."""
        idx = [int(i) for i in np.asarray(indices).reshape(-1)]
        if self._data is None:
            return ["?"] * len(idx)
        out = []
        for i in idx:
            try:
                entry = json.loads(self._data[self._bounds[i] + 1 : self._bounds[i + 1]])
            except ValueError as e:
                raise CacheCorruptError(f"{self._where}: entry {i} is damaged: {e}") from None
            out.append(decode_path(entry, self._where))
        return out


def paths_at(location: Location, manifest: Manifest, indices: Sequence[int] | np.ndarray) -> list[str]:
    """The source path of each sample in ``indices`` (in that order); ``"?"`` for caches without paths."""
    return PathTable(location, manifest).at(indices)
