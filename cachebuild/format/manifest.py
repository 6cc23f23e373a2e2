"""The on-disk cache format as code: ``manifest.json`` (a frozen dataclass with one parser per field and
symmetric ``to_dict``/``from_dict``, as zarr-python models its metadata), the checksum algorithm of each format
version, how source file names are written in JSON, and the names a manifest may give. The prose spec is
``docs/FORMAT.md``. No file I/O and no backend registry: the caller passes the storage kinds it can read.

A reader refuses any ``format`` other than ours and any ``format_version`` not in ``READ_VERSIONS`` with a
named error. The manifest is written last, so its presence means the cache is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from cachebuild.errors import CacheCorruptError, FingerprintMismatchError, OptionError, UnsupportedFormatError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer  # bytes, memoryview, a C-contiguous ndarray...

__all__ = ["ALGORITHMS", "BUILD", "CACHE_SUBFOLDER", "CHECKSUM_FIELD", "COLUMNS_DIR", "COLUMNS_VERSION",
           "COLUMN_DTYPES", "COLUMN_NAME", "DIGEST_VERSION", "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME",
           "PLAIN_VERSION", "READ_VERSIONS", "SHA256", "SHOWN_DIGITS", "SOURCE_DIGEST", "URL_SCHEME", "XXH3_128",
           "ArrayInfo", "ColumnInfo", "Digest", "Failure", "Hasher", "Manifest", "ShardInfo", "check_fingerprint",
           "check_name", "decode_path", "decode_paths", "different_cache", "digest_for", "encode_path", "encode_paths",
           "entry_key", "manifest_bytes", "parse_manifest"]

FORMAT_NAME = "cachebuild"
MANIFEST_NAME = "manifest.json"
# Bump on any change a reader of the previous version would misread; readers refuse other versions.
# 1: an npy shard's checksum covers its pixel rows. 2: its whole file (nothing else differs, so 1 is still read).
# 3: version 2 plus ``columns`` (per-sample arrays added after the build); only a sha256 cache that holds columns
#    is written as 3, and one whose last column is removed goes back to 2.
# 4: every file checksum by the manifest's ``digest_algorithm``, under the key ``digest``; columns allowed. Every
#    build writes 4; a column added to or removed from a version 2/3 cache keeps sha256 (version 3, or 2).
FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
PLAIN_VERSION = 2  # what a sha256 cache without columns is written as
COLUMNS_VERSION = 3  # the first version with columns
DIGEST_VERSION = 4  # the first version that names its checksum algorithm (and keys each value ``digest``)
COLUMNS_DIR = "columns"  # the folder of a cache's column files: outside its file table (the manifest holds their sums)
# The one folder inside a source tree that may hold caches of it: sources never list it, and a build may write there.
CACHE_SUBFOLDER = ".cachebuild"
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, gs://, http(s)://, file://, memory://...

FITS = ("crop", "squash", "pad")
# Numeric dtypes only (np.load(allow_pickle=False) reads them; torch takes them): no strings, objects, complex.
COLUMN_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


# ---------------------------------------------------------------- checksums
#
# Versions 1 to 3 check every file (shards, side arrays, columns, files.json, source_files.json) with sha256, the
# key ``sha256`` beside each value. Version 4 names its algorithm once, in ``digest_algorithm`` (xxh3-128: these
# checksums find damage, on disk or in transfer, not attack, and a build's workers hash every byte they write),
# each value under the key ``digest``; its hex is the canonical big-endian form that ``xxh128sum`` prints.
# Identity stays sha256 in every version: the build key, the content id, the source fingerprint and the
# manifest's own seal (``checksum``) are a few kB and are what a job pins or compares across releases.

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
# The digest of each source file's bytes in source_files.json ("digests"): whether a file whose mtime changed still
# holds the bytes a cache was built from. Not a checksum of the cache's own files (never named by
# ``digest_algorithm``): 64 bits tell one file's states apart, at half the table's size and parse memory.
SOURCE_DIGEST = Digest("xxh3-64", xxhash.xxh3_64, 16)


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


# ---------------------------------------------------------------- names
#
# A POSIX file name is bytes; Python hands an undecodable byte over as a lone surrogate (``os.fsdecode``: byte
# 0xFF -> U+DCFF), which strict UTF-8 JSON cannot hold. So ``paths.json`` and ``failures[].path`` hold each name
# as the JSON string itself when it is valid UTF-8, else as ``{"bytes": E}``: E is the name's bytes with ``\xHH``
# (two lowercase hex digits) for each byte that is not part of valid UTF-8, ``\\`` for a backslash, and every
# other character as itself. ``os.fsencode(decode_path(encode_path(p))) == os.fsencode(p)`` for every name the
# filesystem can hold; a reader without this package that meets an object knows the name was not UTF-8.

_ESCAPE = re.compile(r"\\(\\|x[0-9a-f]{2})")


def encode_path(path: str) -> str | dict[str, str]:
    """The JSON value of one file name (``str`` as ``os.fsdecode`` returns it)."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        pass
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:  # a surrogate no file name can carry (not from surrogateescape)
        raise ValueError(f"{path!r} is not a file name this system can hold (lone surrogate)") from None
    return {"bytes": raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")}


def decode_path(entry: Any, where: str = "paths.json") -> str:
    """A file name back from its JSON value; a malformed entry is a CacheCorruptError naming ``where``."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and set(entry) == {"bytes"} and isinstance(entry["bytes"], str):
        text = entry["bytes"]
        parts = _ESCAPE.split(text)  # literal text at even positions, an escape's body (\\ or xHH) at odd ones
        if not any("\\" in literal for literal in parts[::2]):
            try:
                return os.fsdecode(b"".join(
                    p.encode("utf-8", "strict") if i % 2 == 0 else b"\\" if p == "\\" else bytes([int(p[1:], 16)])
                    for i, p in enumerate(parts)))
            except UnicodeEncodeError:  # a lone surrogate: not UTF-8 text
                pass
        raise CacheCorruptError(f"{where}: malformed escaped file name {text!r} (only \\\\ and \\xHH escapes)")
    raise CacheCorruptError(f"{where}: a file name must be a string or {{\"bytes\": ...}}, got {entry!r}")


def encode_paths(paths: list[str]) -> list[str | dict[str, str]]:
    return [encode_path(p) for p in paths]


def decode_paths(entries: list[Any], where: str = "paths.json") -> list[str]:
    if set(map(type, entries)) <= {str}:  # no escaped names (the usual case): nothing to decode, one C pass
        return list(entries)
    return [decode_path(e, where) for e in entries]


def check_name(name: object, what: str = "file name") -> str:
    """A name a manifest gives for a file of the cache: plain, relative, inside the cache (no absolute path, ``..``,
    ``.`` or empty segment, backslash, URL or control character), so a crafted manifest cannot make a reader
    open ``/etc/passwd``, a sibling folder or another host."""
    if not isinstance(name, str) or not name:
        raise CacheCorruptError(f"manifest {what} must be a non-empty string, got {name!r}")
    bad = (
        name.startswith("/")
        or "\\" in name
        or URL_SCHEME.match(name) is not None
        or ":" in name.split("/", 1)[0]  # drive letters, "c:foo", scheme-like prefixes
        or any(ord(ch) < 32 for ch in name)
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise CacheCorruptError(
            f"manifest {what} {name!r} is not a plain relative name inside the cache (no '..', no absolute "
            f"path, no URL); the manifest is damaged or was crafted: rebuild or re-fetch the cache"
        )
    return name


# ---------------------------------------------------------------- the manifest

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
    storage: str  # the storage kind: "npy", "zarr", "jpeg"
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
        """The checksum algorithm of this cache's files (:func:`digest_for`: the one map from a manifest)."""
        return digest_for(self.format_version,
                          self.digest_algorithm if self.format_version >= DIGEST_VERSION else None)

    @property
    def fingerprint(self) -> str:
        """The fingerprint as shown (``cachebuild info``, ``ls``): the build key's first hex digits."""
        return self.build_key[:SHOWN_DIGITS]

    @property
    def content_id(self) -> str:
        """A sha256 naming what the cache holds: its build key and every checksum the manifest records. The build
        key names source and parameters, not bytes (a source file rewritten keeping its size and mtime, another
        OpenCV), so local copies of a cache's files are keyed by this: never one cache's bytes for another's."""
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
                raise CacheCorruptError(f"manifest says dtype={d.get('dtype')!r} layout={d.get('layout')!r}; version "
                                        f"{version} caches are uint8 NHWC")
            shards = tuple(ShardInfo(check_name(s["file"], "shards.file"), _parse_int("shards.start", s["start"]),
                                     _parse_int("shards.count", s["count"]), _parse_str(f"shards.{key}", s[key]))
                           for s in d["shards"])
            arrays = {_parse_str("arrays key", k): ArrayInfo(check_name(a["file"], "arrays.file"),
                                                             _parse_str("arrays.dtype", a["dtype"]),
                                                             _parse_shape("arrays.shape", a["shape"]),
                                                             _parse_str(f"arrays.{key}", a[key]))
                      for k, a in _parse_mapping("arrays", d["arrays"]).items()}
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


# ---------------------------------------------------------------- identity
#
# The fingerprint a job can pin is the manifest's build key (sha256 of the source digest and every build
# parameter that shapes the bytes), shown as its first 12 hex digits. The same build repeated (or pulled
# elsewhere) keeps it, with the same bytes. The key names the source by path, size and mtime, not the decoder's
# version, so one key can hold other bytes: what must never mix two caches' bytes compares ``content_id``.

SHOWN_DIGITS = 12
_PREFIX = re.compile(r"[0-9a-f]{8,64}")


def different_cache(old: Manifest | None, new: Manifest, whose: str) -> str:
    """What a destination holds instead of ``new``, for a refusal: "a different cache (fingerprint ...)"."""
    if old is None:
        return "a different cache (its manifest is unreadable)"
    if old.build_key == new.build_key:
        return (f"a different cache with the same fingerprint {new.fingerprint} (same source files by name, size "
                f"and time, same parameters) but other contents: a source file changed keeping its size and time, "
                f"or another OpenCV or decoder built one of them")
    return f"a different cache (fingerprint {old.fingerprint}, {whose}'s is {new.fingerprint})"


def check_fingerprint(manifest: Manifest, expected: str, where: str) -> None:
    """Raise unless the cache's build key starts with ``expected`` (8 to 64 hex digits)."""
    want = str(expected).strip().lower()
    if not _PREFIX.fullmatch(want):
        raise OptionError(f"expect_fingerprint must be 8 to 64 hex digits (a prefix of the fingerprint `cachebuild "
                         f"info` or `cachebuild ls` shows), got {expected!r}")
    key = manifest.build_key.lower()
    if not key.startswith(want):
        shown = key[: max(len(want), SHOWN_DIGITS)] or "(none)"
        raise FingerprintMismatchError(
            f"{where} has fingerprint {shown}, expected {want}: the cache was rebuilt (other source files or "
            f"build parameters) or is another cache; check the path, or expect the new fingerprint")
