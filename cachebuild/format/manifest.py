"""manifest.json: the self-description of a cache, written last.

A frozen dataclass with one parser per field and symmetric ``to_dict``/``from_dict`` (as zarr-python models
its metadata). The spec in prose is ``docs/FORMAT.md``; this module is its code. A reader refuses any
``format`` other than ours and any ``format_version`` not in ``READ_VERSIONS`` with a named error.

Checksums: the algorithm of a cache's files is ``Manifest.digest`` (``format.digests``: sha256 to version 3,
version 4's ``digest_algorithm``). In memory each entry's value is ``digest``; on disk versions 1-3 key it
``sha256``, version 4 ``digest``. The manifest's own seal (``checksum``) is sha256 in every version.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cachebuild.errors import CacheCorruptError, UnsupportedFormatError
from cachebuild.format.digests import ALGORITHMS, BUILD, DIGEST_VERSION, Digest, digest_for, entry_key
from cachebuild.format.pathnames import check_name, decode_path, encode_path

__all__ = [
    "CHECKSUM_FIELD",
    "COLUMNS_DIR",
    "COLUMNS_VERSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PLAIN_VERSION",
    "READ_VERSIONS",
    "ArrayInfo",
    "ColumnInfo",
    "Failure",
    "Manifest",
    "ShardInfo",
    "manifest_bytes",
    "parse_manifest",
]

FORMAT_NAME = "cachebuild"
# Bump on any change a reader of the previous version would misread; readers refuse other versions.
# 2: an npy shard's sha256 covers its whole file (1: its pixel rows); nothing else differs, so version 1
# caches are still read (docs/FORMAT.md, "Changing the format").
# 3: version 2 plus ``columns`` (extra per-sample arrays added after the build). Only a cache that holds
# columns is written as 3: a cache of version 2 whose last column was removed goes back to 2.
# 4: every file checksum (shards, side arrays, columns, files.json, source_files.json) by the manifest's
# ``digest_algorithm`` (xxh3-128: 30x cheaper than sha256, 5-6% of a build worker), under the key ``digest``;
# columns allowed. Every build writes 4 (its build key names it: a version 2/3 cache of the same recipe is
# another build); a column added to or removed from a version 2/3 cache keeps sha256 (version 3, or 2).
FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
PLAIN_VERSION = 2  # what a sha256 cache without columns is written as (the last of them, version 3, with)
COLUMNS_DIR = "columns"  # the folder of a cache's column files: outside its file table (the manifest holds their sums)
COLUMNS_VERSION = 3
MANIFEST_NAME = "manifest.json"

FITS = ("crop", "squash", "pad")
# The manifest's own sha256 (optional: older caches lack it): of the file's bytes with the field's 64 hex
# digits read as zeros. The other checksums cover every other file; this one covers the manifest, so a
# flipped byte in a class name or a shard's checksum is found too. Raw bytes, not a canonical JSON form:
# any language checks it with one replace and one hash.
CHECKSUM_FIELD = "checksum"
_BLANK = b"0" * 64
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ShardInfo:
    """Samples ``[start, start + count)``; ``file`` relative to the cache; ``digest`` (the manifest's algorithm)
    as the storage kind defines it (npy, jpeg: the whole shard file; zarr: the samples' raw pixel bytes)."""

    file: str
    start: int
    count: int
    digest: str


@dataclass(frozen=True)
class ArrayInfo:
    """A per-sample side array (labels, original sizes, boxes...) stored as a plain ``.npy`` beside the images."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    digest: str


@dataclass(frozen=True)
class ColumnInfo:
    """An extra per-sample array added after the build (``cachebuild columns add``): a plain ``.npy`` whose
    ``digest`` and ``size`` are of the whole file, so a transfer checks it as it checks a file-table entry."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    size: int


# Numeric dtypes only (np.load(allow_pickle=False) reads them; torch takes them): no strings, objects, complex.
COLUMN_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True)
class Failure:
    """A source entry that produced no sample, and why."""

    path: str
    reason: str


def _parse_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CacheCorruptError(f"manifest field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_str(name: str, value: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        expected = f"one of {choices}" if choices else "a string"
        raise CacheCorruptError(f"manifest field {name!r} must be {expected}, got {value!r}")
    return value


def _parse_shape(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise CacheCorruptError(f"manifest field {name!r} must be a list of integers, got {value!r}")
    return tuple(_parse_int(name, v) for v in value)


def _parse_str_list(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise CacheCorruptError(f"manifest field {name!r} must be a list of strings")
    return tuple(value)


def _parse_mapping(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise CacheCorruptError(f"manifest field {name!r} must be an object, got {type(value).__name__}")
    return dict(value)


def _parse_files(value: Any, version: int) -> dict[str, Any]:
    """The file table's ref, its checksum under ``digest`` (the version's own key on disk)."""
    key = entry_key(version)
    files = {"digest" if k == key else k: v for k, v in _parse_mapping("files", value).items()}  # order kept
    if files:
        files["table"] = check_name(files.get("table"), "files.table")
        files["digest"] = _parse_str(f"files.{key}", files.get("digest"))
        files["count"] = _parse_int("files.count", files.get("count"))
        files["bytes"] = _parse_int("files.bytes", files.get("bytes"))
    return files


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about a cache, and everything needed to tell if it is stale."""

    dataset: str
    split: str
    count: int
    shape: tuple[int, int, int]  # (H, W, C)
    storage: str  # "npy" | "zarr"
    classes: tuple[str, ...]
    fit: str
    interpolation: str
    source: dict[str, Any]  # root, fingerprint, files
    build: dict[str, Any]  # parameters that shaped the output, and the build key
    tool: dict[str, Any]  # versions of cachebuild, OpenCV, numpy, ...
    shards: tuple[ShardInfo, ...]
    arrays: dict[str, ArrayInfo]  # "labels", "sizes", "paths", optional "boxes", "coarse_labels"
    failures: tuple[Failure, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. coarse class names, class descriptions
    created: str = ""
    # Optional (older caches lack them; older readers ignore them): the whole-file checksum table that
    # pull/push check every file against ({"table", "digest", "count", "bytes"}), and who built the cache.
    files: dict[str, Any] = field(default_factory=dict)
    built_by: dict[str, Any] = field(default_factory=dict)  # {"user", "host"}
    # Version 3: extra per-sample arrays added after the build, name -> ColumnInfo (none: the key is not written).
    columns: dict[str, ColumnInfo] = field(default_factory=dict)
    dtype: str = "uint8"
    layout: str = "NHWC"
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    # Version 4: the algorithm of every file checksum above ("sha256" for versions 1-3, where it is not written).
    digest_algorithm: str = BUILD.name

    @property
    def build_key(self) -> str:
        return str(self.build.get("key", ""))

    @property
    def digest(self) -> Digest:
        """The checksum algorithm of this cache's files (``format.digests``: the one map from a manifest)."""
        return digest_for(self.format_version,
                          self.digest_algorithm if self.format_version >= DIGEST_VERSION else None)

    @property
    def content_id(self) -> str:
        """A sha256 naming what the cache holds: its build key and every checksum the manifest records.

        The build key names source and parameters, not bytes: a source file rewritten with its size and
        mtime kept, or a build with another OpenCV, gives the same key and other pixels. Local copies of
        a cache's files (the block cache of URL reads) are keyed by this instead, so they never serve one
        cache's bytes to a reader of another.
        """
        blob = json.dumps({
            "build": self.build_key,
            "shards": [(s.file, s.start, s.count, s.digest) for s in self.shards],
            "arrays": {name: (a.file, a.digest) for name, a in sorted(self.arrays.items())},
            "files": self.files.get("digest", ""),
            # only when there are columns (or another algorithm): the content ids of older caches stay what they were
            **({"columns": {n: (c.file, c.digest) for n, c in sorted(self.columns.items())}} if self.columns else {}),
            **({"digest": self.digest_algorithm} if self.format_version >= DIGEST_VERSION else {}),
        }, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def sample_nbytes(self) -> int:
        h, w, c = self.shape
        return h * w * c

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failures"] = [{**f, "path": encode_path(f["path"])} for f in d["failures"]]  # non-UTF-8 names too
        if not d["columns"]:  # a cache without columns: the bytes of a version 2 manifest
            del d["columns"]
        key = entry_key(self.format_version)
        if key != "digest":  # versions 1-3: the bytes they always had (sha256, so named, in its place)
            del d["digest_algorithm"]
            d["shards"] = [_rekeyed(e, key) for e in d["shards"]]
            d["files"] = _rekeyed(d["files"], key)
            for field_name in ("arrays", "columns"):
                if field_name in d:
                    d[field_name] = {n: _rekeyed(e, key) for n, e in d[field_name].items()}
        # Lead with the fields a human or another tool checks first.
        lead = ("format", "format_version", "dataset", "split", "count", "shape", "dtype", "layout", "storage")
        head = {k: d.pop(k) for k in lead + (("digest_algorithm",) if key == "digest" else ())}
        return {**head, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], storage_kinds: tuple[str, ...] | None = None) -> Manifest:
        version = _check_format(d)
        key = entry_key(version)
        digest = digest_for(version, d.get("digest_algorithm"))  # named errors: unknown, missing, or where none is
        try:
            shape = _parse_shape("shape", d["shape"])
            if len(shape) != 3 or shape[2] != 3:
                raise CacheCorruptError(f"manifest field 'shape' must be [H, W, 3], got {list(shape)}")
            if d.get("dtype") != "uint8" or d.get("layout") != "NHWC":
                raise CacheCorruptError(
                    f"manifest says dtype={d.get('dtype')!r} layout={d.get('layout')!r}; version "
                    f"{version} caches are uint8 NHWC"
                )
            shards = tuple(
                ShardInfo(
                    file=check_name(s["file"], "shards.file"),
                    start=_parse_int("shards.start", s["start"]),
                    count=_parse_int("shards.count", s["count"]),
                    digest=_parse_str(f"shards.{key}", s[key]),
                )
                for s in d["shards"]
            )
            arrays = {
                _parse_str("arrays key", k): ArrayInfo(
                    file=check_name(a["file"], "arrays.file"),
                    dtype=_parse_str("arrays.dtype", a["dtype"]),
                    shape=_parse_shape("arrays.shape", a["shape"]),
                    digest=_parse_str(f"arrays.{key}", a[key]),
                )
                for k, a in _parse_mapping("arrays", d["arrays"]).items()
            }
            m = cls(
                format_version=version,
                dataset=_parse_str("dataset", d["dataset"]),
                split=_parse_str("split", d["split"]),
                count=_parse_int("count", d["count"]),
                shape=(shape[0], shape[1], shape[2]),
                storage=_parse_str("storage", d["storage"], storage_kinds),
                classes=_parse_str_list("classes", d["classes"]),
                fit=_parse_str("fit", d["fit"], FITS),
                interpolation=_parse_str("interpolation", d["interpolation"]),
                source=_parse_mapping("source", d["source"]),
                build=_parse_mapping("build", d["build"]),
                tool=_parse_mapping("tool", d["tool"]),
                shards=shards,
                arrays=arrays,
                failures=tuple(Failure(path=decode_path(f["path"], "manifest failures"), reason=str(f["reason"]))
                               for f in d.get("failures", [])),
                extra=_parse_mapping("extra", d.get("extra", {})),
                created=str(d.get("created", "")),
                files=_parse_files(d.get("files", {}), version),
                built_by=_parse_mapping("built_by", d.get("built_by", {})),
                columns=_parse_columns(d.get("columns", {}), version),
                digest_algorithm=digest.name,
            )
        except KeyError as e:
            raise CacheCorruptError(f"manifest is missing the field {e.args[0]!r}") from None
        except TypeError as e:
            raise CacheCorruptError(f"manifest has a malformed entry: {e}") from None
        m.check_consistent()
        return m

    def check_consistent(self) -> None:
        """Shards must tile ``[0, count)`` in order; side arrays must have ``count`` rows."""
        pos = 0
        for s in self.shards:
            if s.start != pos:
                raise CacheCorruptError(f"shard {s.file} starts at sample {s.start}, expected {pos}")
            pos += s.count
        if pos != self.count:
            raise CacheCorruptError(f"shards hold {pos} samples but the manifest count is {self.count}")
        for name, a in self.arrays.items():
            if not a.shape or a.shape[0] != self.count:
                raise CacheCorruptError(f"array {name!r} has shape {list(a.shape)}, expected {self.count} rows")
        for required in ("labels", "sizes"):
            if required not in self.arrays:
                raise CacheCorruptError(f"manifest lists no {required!r} array")
        allowed = ("sha256",) if self.format_version < DIGEST_VERSION else tuple(ALGORITHMS)
        if self.digest_algorithm not in allowed:  # a manifest made in code (a parsed one was checked already)
            raise CacheCorruptError(f"manifest of format version {self.format_version} says digest_algorithm "
                                    f"{self.digest_algorithm!r} (versions before {DIGEST_VERSION} are sha256)")
        if self.columns and self.format_version < COLUMNS_VERSION:
            raise CacheCorruptError(f"manifest lists columns but says format version {self.format_version}; "
                                    f"columns need version {COLUMNS_VERSION}")
        for name, c in self.columns.items():
            if name in self.arrays or not COLUMN_NAME.fullmatch(name):
                raise CacheCorruptError(f"column name {name!r} clashes with a built-in array or is not a name")
            if not c.shape or c.shape[0] != self.count or c.dtype not in COLUMN_DTYPES:
                raise CacheCorruptError(f"column {name!r} is {c.dtype}{list(c.shape)}, expected a numeric "
                                        f"array of {self.count} rows")


def _rekeyed(entry: dict[str, Any], key: str) -> dict[str, Any]:
    return {key if k == "digest" else k: v for k, v in entry.items()}


def _parse_columns(value: Any, version: int) -> dict[str, ColumnInfo]:
    columns = _parse_mapping("columns", value)
    if columns and version < COLUMNS_VERSION:
        raise CacheCorruptError(f"manifest field 'columns' needs format version {COLUMNS_VERSION}, got {version}")
    key = entry_key(version)
    return {
        _parse_str("columns key", k): ColumnInfo(
            file=check_name(c["file"], "columns.file"),
            dtype=_parse_str("columns.dtype", c["dtype"], COLUMN_DTYPES),
            shape=_parse_shape("columns.shape", c["shape"]),
            digest=_parse_str(f"columns.{key}", c[key]),
            size=_parse_int("columns.size", c["size"]),
        )
        for k, c in columns.items()
    }


def _check_format(d: Mapping[str, Any]) -> int:
    """The format version of a manifest's fields, or a named error for another format or an unknown version."""
    fmt = d.get("format")
    if fmt != FORMAT_NAME:
        raise UnsupportedFormatError(f"not a {FORMAT_NAME} manifest: format is {fmt!r}, expected {FORMAT_NAME!r}")
    version = d.get("format_version")
    if version not in READ_VERSIONS:
        raise UnsupportedFormatError(
            f"cache format version {version!r} is not supported: this cachebuild reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}; rebuild the cache or use a cachebuild release that reads "
            f"version {version!r}"
        )
    return int(version)


def manifest_bytes(m: Manifest) -> bytes:
    """The bytes of ``manifest.json`` for ``m``: one-space-indented UTF-8 JSON, sealed with its checksum."""
    raw = (json.dumps({**m.to_dict(), CHECKSUM_FIELD: _BLANK.decode()}, indent=1, ensure_ascii=False) + "\n")
    data = raw.encode("utf-8")
    at = data.rindex(_BLANK)  # the checksum is the last field: no other value can be mistaken for it
    return data[:at] + hashlib.sha256(data).hexdigest().encode() + data[at + len(_BLANK):]


def _check_seal(raw: bytes, d: Mapping[str, Any], where: str) -> None:
    """A named error unless the manifest's bytes match its own checksum (none: a cache of an older release)."""
    if CHECKSUM_FIELD not in d:
        # A flipped bit in the field's name would pass for a manifest edited on purpose: a key one byte
        # away from it is damage, not an edit.
        near = [k for k in d if len(k) == len(CHECKSUM_FIELD)
                and sum(a != b for a, b in zip(k, CHECKSUM_FIELD, strict=True)) == 1]
        if near:
            raise CacheCorruptError(
                f"{where}: its {CHECKSUM_FIELD!r} field's name is damaged (a byte of it changed after the build "
                f"wrote it); re-fetch or rebuild the cache")
        return
    seal = d[CHECKSUM_FIELD]
    ok = isinstance(seal, str) and _HEX64.fullmatch(seal) is not None and raw.count(seal.encode()) == 1
    if not ok or hashlib.sha256(raw.replace(seal.encode(), _BLANK)).hexdigest() != seal:
        raise CacheCorruptError(
            f"{where} does not match its own checksum: a byte of it changed after the build wrote it (damaged "
            f"on disk or in transfer, or edited); re-fetch or rebuild the cache (if you edited it on purpose, "
            f"delete its {CHECKSUM_FIELD!r} field)"
        )


def parse_manifest(raw: bytes, where: str, storage_kinds: tuple[str, ...] | None = None) -> Manifest:
    """Parse and validate a manifest's bytes; ``where`` names it in errors. ``storage_kinds``: the kinds
    the caller can read (the storage registry's names; None: any name). The spec knows no registry."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CacheCorruptError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CacheCorruptError(f"{where} must hold a JSON object")
    _check_format(data)  # first: a newer format may seal differently, and "unsupported version" is the news
    _check_seal(raw, data, where)
    return Manifest.from_dict(data, storage_kinds)
