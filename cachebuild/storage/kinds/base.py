"""What a storage kind is, their one registry, and the read mechanics the kinds of shard files share.

A kind is one :class:`Backend` per way of laying out a cache's pixels, owning both sides. Write (builds and
``storage.cache.write_cache``: one path): ``prepare`` the staging folder, a :class:`Sink` per worker's block,
``resume`` after a kill, ``finish`` the :class:`BlockRecord` s into the manifest's shards; the names it writes
(``staging_names``, ``cache_names``) so the build's destination rules never name a kind's files. Read: ``open`` a
location + manifest into an :class:`ImageStore`. Nothing outside the backends asks which kind a cache is. A new
kind is one module and one line in ``_BACKENDS`` (or :func:`register_backend`); kinds are imported on first use.
"""

from __future__ import annotations

import base64
import functools
import importlib
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import numpy as np

from cachebuild.errors import UnsupportedFormatError
from cachebuild.settings import settings
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import (
    STEP_BYTES,
    WHOLE_FILE_THREADS,
    BlockCache,
    BlockCacheFullError,
    CachedFile,
    Readahead,
)

if TYPE_CHECKING:
    from cachebuild.format.manifest import Digest, Manifest, ShardInfo

__all__ = [
    "DEFAULT_STORAGE",
    "STORAGE_KINDS",
    "Backend",
    "BlockFailure",
    "BlockRecord",
    "ImageStore",
    "ShardHandles",
    "Sink",
    "StorageParams",
    "adopt_file",
    "backend_names",
    "cache_names",
    "digest_file",
    "digest_of_file",
    "get_backend",
    "in_parallel",
    "link_shard",
    "one_file_per_block",
    "register_backend",
    "staging_names",
]

T = TypeVar("T")

@dataclass(frozen=True)
class BlockFailure:
    """A source file of a block that gave no sample: its plan position, its name as
    :func:`~cachebuild.format.manifest.encode_path` writes it, and why."""

    index: int
    path: str | dict[str, str]
    reason: str


# A block record's per-sample arrays: field -> (dtype, columns); the staging JSON keeps them little-endian.
_PER_SAMPLE: dict[str, tuple[type[np.signedinteger[Any]], int]] = {"ok": (np.int64, 1), "sizes": (np.int32, 2),
                                                                    "boxes": (np.int32, 4)}


def _per_sample(value: Any, dtype: type[np.signedinteger[Any]], cols: int) -> np.ndarray:
    """``value`` (an array or a sequence) as this field's array, read-only: (n,) for ``ok``, (n, cols) for the
    others. No copy of an array already of that dtype."""
    arr = np.asarray(value, dtype=dtype)
    arr = arr.reshape(-1) if cols == 1 else arr.reshape(-1, cols)  # a view: the caller's array keeps its flags
    arr.flags.writeable = False
    return arr


def _encode_array(arr: np.ndarray, dtype: type[np.signedinteger[Any]]) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, np.dtype(dtype).newbyteorder("<")).tobytes()).decode("ascii")


def _decode_array(value: Any, dtype: type[np.signedinteger[Any]], cols: int) -> np.ndarray:
    """A per-sample field as read back: base64 of little-endian bytes, or a list of numbers (the older staging
    form, so that a build an older release left unfinished resumes)."""
    if isinstance(value, str):
        flat = np.frombuffer(base64.b64decode(value, validate=True), np.dtype(dtype).newbyteorder("<"))
        return flat if cols == 1 else flat.reshape(-1, cols)
    if not isinstance(value, list):
        raise TypeError(f"a per-sample field of a block record is {type(value).__name__}")
    arr = np.asarray(value, dtype=dtype)
    if len(value) and arr.shape[1:] != (() if cols == 1 else (cols,)):
        raise ValueError(f"a per-sample field of a block record has rows of shape {arr.shape[1:]}")
    return arr


@dataclass(frozen=True, eq=False)
class BlockRecord:
    """A finished block, as its worker returns it and ``blocks/block-NNNNN.json`` keeps it (a killed build resumes
    by skipping the blocks that have one). ``ok``, ``sizes``, ``boxes``: per kept sample, its plan position, source
    (height, width) and placement box, as read-only arrays (int64 (n,), int32 (n, 2), int32 (n, 4)), not tuples."""

    block: int
    start: int  # plan position of the block's first file
    planned: int  # files in the block
    count: int  # samples kept (planned minus failures)
    file: str  # the file the sink wrote (npy, jpeg: the shard; zarr: the array)
    digest: str  # what the manifest keeps for the shard (the kind says what it covers; the build's algorithm)
    ok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int32))
    failures: tuple[BlockFailure, ...] = ()
    stored_bytes: int | None = None  # kinds that encode samples: bytes as stored (None: raw pixels)
    reused: int = 0  # samples an update copied from the cache it replaces (stored bytes, not decoded)

    def __post_init__(self) -> None:
        for name, (dtype, cols) in _PER_SAMPLE.items():
            object.__setattr__(self, name, _per_sample(getattr(self, name), dtype, cols))

    # Arrays make the generated __eq__ ambiguous (an elementwise ==): fields compared one by one, arrays by value.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockRecord):
            return NotImplemented
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) if f.name in _PER_SAMPLE
                   else getattr(self, f.name) == getattr(other, f.name) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # equal by value, and the arrays are not hashable

    def to_json(self) -> dict[str, Any]:
        """The record for ``json.dumps``: the per-sample arrays as base64 of their little-endian bytes (one string
        each, no number per sample for json to write or parse)."""
        d: dict[str, Any] = {"block": self.block, "start": self.start, "planned": self.planned, "count": self.count,
                             "file": self.file, "digest": self.digest}
        for name, (dtype, _) in _PER_SAMPLE.items():
            d[name] = _encode_array(getattr(self, name), dtype)
        d["failures"] = [asdict(f) for f in self.failures]
        if self.stored_bytes is not None:
            d["stored_bytes"] = self.stored_bytes
        if self.reused:
            d["reused"] = self.reused
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BlockRecord:
        """A record read back, in either form of :func:`_decode_array` (KeyError, TypeError or ValueError for one
        that is neither, or whose per-sample arrays do not hold ``count`` samples)."""
        arrays = {name: _decode_array(d[name], dtype, cols) for name, (dtype, cols) in _PER_SAMPLE.items()}
        rec = cls(int(d["block"]), int(d["start"]), int(d["planned"]), int(d["count"]), str(d["file"]),
                  str(d["digest"]), arrays["ok"], arrays["sizes"], arrays["boxes"],
                  tuple(BlockFailure(int(f["index"]), f["path"], str(f["reason"])) for f in d["failures"]),
                  None if d.get("stored_bytes") is None else int(d["stored_bytes"]), int(d.get("reused", 0)))
        if not len(rec.ok) == len(rec.sizes) == len(rec.boxes) == rec.count:
            raise ValueError(f"block record {rec.block} holds {len(rec.ok)}, {len(rec.sizes)} and {len(rec.boxes)} "
                             f"per-sample entries for {rec.count} samples")
        return rec


class Sink(Protocol):
    """Where one worker's block of decoded samples goes: a reused slot per sample, kept or dropped."""

    def next_slot(self) -> np.ndarray: ...

    def commit(self) -> None: ...

    def commit_stored(self, stored: Any) -> None:
        """Keep one sample given as stored (what :meth:`ImageStore.read_stored` of a cache of the same kind and
        parameters returns for it): copied as it is, never decoded or encoded again (``--update``)."""
        ...

    def abort(self) -> None: ...

    def close(self) -> tuple[str, str]:
        """Finish the block; returns the file name its record names and the digest (``format.manifest.BUILD``)
        the manifest keeps for it. The kind says what the digest covers (npy and jpeg: the shard file's every
        byte, so the file table takes it as is; zarr: the samples' pixels), and the sink hashes as it writes:
        one pass."""
        ...

    @property
    def stored_bytes(self) -> int | None:
        """After :meth:`close`: the bytes the block takes as stored, for kinds that encode samples (jpeg);
        None for raw pixels (count x sample bytes)."""
        ...


class StorageParams(Protocol):
    """The build options a backend reads (``cachebuild.builder.pipeline.BuildOptions`` has them all)."""

    @property
    def size(self) -> int: ...
    @property
    def chunk_size(self) -> int | None: ...
    @property
    def compression(self) -> str: ...
    @property
    def quality(self) -> int: ...  # kinds that encode samples (jpeg)
    @property
    def subsampling(self) -> str: ...


class ImageStore(ABC):
    """The read side of one cache's images: picklable, reopened lazily in each process."""

    #: the manifest the store was opened with
    manifest: Manifest
    #: samples per natural read unit (a zarr chunk, ~8 MB of npy rows): CacheSampler keeps them together
    chunk_size: int
    #: True when samples are stored encoded (jpeg): ``read_encoded`` hands them over undecoded
    encoded: bool = False
    #: threads a store that decodes on read may use in this process (None: automatic)
    decode_threads: int | None = None

    @abstractmethod
    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Copy samples ``idx`` (int64, any order, already checked in range) into ``out`` (uint8 (B, H, W, 3))."""

    @abstractmethod
    def verify(self, shards: Collection[int] | None = None) -> list[str]:
        """Re-hash every shard range against the manifest (``shards``: only those starting there); one line per
        problem, naming the file or chunk."""

    @property
    def bytes_fetched(self) -> int:
        """Bytes read from a remote location by this process (0 for local caches)."""
        return 0

    def file_bounds(self) -> np.ndarray:
        """int64: the first sample of each stored file, in order, then the count (the units a shard-windowed
        sampler keeps together; ``CacheSampler(shard_window=...)``)."""
        return np.array([s.start for s in self.manifest.shards] + [self.manifest.count], dtype=np.int64)

    def read_files_whole(self) -> None:
        """From now on (and in copies pickled after), each remote file a batch touches is fetched whole into the
        block cache in the background: a shard-windowed epoch reads every row of it soon. A no-op where the
        store has no files to fetch whole (local caches, compressed zarr)."""
        return  # what the stores of files (npy, jpeg, raw zarr) override

    def read_stored(self, idx: np.ndarray) -> list[Any]:
        """Samples ``idx`` as stored, one buffer each, for a :class:`Sink` of the same kind and parameters
        (``Sink.commit_stored``): raw kinds their pixel rows, encoded kinds their checked bytes (undecoded)."""
        if self.encoded:
            data, offsets = self.read_encoded(idx)
            return [data[a:z] for a, z in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
        h, w, c = self.sample_shape
        rows = np.empty((len(idx), h, w, c), dtype=np.uint8)
        self.gather(idx, rows)
        return list(rows)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of one decoded sample."""
        shape = self.manifest.shape
        return (int(shape[0]), int(shape[1]), int(shape[2]))

    def read_encoded(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encoded stores only: the stored bytes of samples ``idx``, checked, undecoded (uint8 data, int64
        offsets (len(idx) + 1,))."""
        raise TypeError(f"{type(self).__name__} stores raw pixels: there is nothing to decode")


class Backend(ABC):
    """One storage kind. Registered once in :mod:`cachebuild.storage` under ``name`` (= ``manifest.storage``)."""

    name: ClassVar[str]
    #: regex (fullmatch) of every name this kind writes at the top of a staging folder, temporaries included:
    #: with the build's own names, what lets ``--force`` discard an unfinished build it can prove it made
    staging_names: ClassVar[str] = ""
    #: names a finished cache of this kind holds beyond the files its manifest lists (zarr: the group metadata)
    cache_names: ClassVar[frozenset[str]] = frozenset()
    #: files of a finished cache without which no sample can be read (zarr: the array's metadata): ``verify``
    #: checks them first, and names them instead of every sample that then fails
    metadata_files: ClassVar[tuple[str, ...]] = ()
    #: True when :meth:`adopt_shard` can take an older cache's local shard whole (one file per block)
    adopts_shards: ClassVar[bool] = False
    #: True when a shard's manifest digest is that of its whole file (one file per shard; format version >= 2):
    #: the commit's file table then takes it from the manifest instead of hashing the file a second time
    shard_digest_is_file: ClassVar[bool] = False
    #: False when two of this kind's sinks must not be written by threads of one process at once (then a
    #: build's blocks run in worker processes: cachebuild.builder.worker_kind)
    threaded_sinks: ClassVar[bool] = True

    # ------------------------------------------------------------ write side
    def align_block(self, block: int, opts: StorageParams) -> int:
        """Samples per build block, adjusted to the layout (zarr: whole chunks, so workers never share one)."""
        return block

    @abstractmethod
    def build_params(self, opts: StorageParams) -> dict[str, Any]:
        """The layout parameters that shape the bytes: they go into the build key and the manifest."""

    def prepare(self, staging: Path, planned: int, sample_shape: tuple[int, int, int], opts: StorageParams) -> None:
        """Make whatever the workers write into (before any block runs; idempotent on resume)."""
        return None  # nothing to do for kinds without such a step

    def resume(self, staging: Path, forget_block: Callable[[int], None]) -> None:
        """After a kill: undo what a half-done :meth:`finish` left, ``forget_block`` blocks to decode again."""
        return None  # nothing to do for kinds without such a step

    @abstractmethod
    def sink(self, staging: Path, block: int, start: int, planned: int, sample_shape: tuple[int, int, int],
             params: dict[str, Any]) -> Sink:
        """In a worker: where block ``block`` (plan positions ``[start, start + planned)``) writes; ``params``
        are this backend's :meth:`build_params` for the build."""

    @abstractmethod
    def finish(self, staging: Path, ordered: list[BlockRecord], count: int, planned: int) -> list[ShardInfo]:
        """After every block: put samples in their final places; returns the manifest's shards."""

    def adopt_shard(self, staging: Path, block: int, location: Location,
                    shard: ShardInfo) -> tuple[str, int | None] | None:
        """``--update``: take shard ``shard`` of an older cache of this kind and parameters (at ``location``) whole
        as block ``block``'s output, when it holds exactly that block's samples; returns the file name the block's
        record names and its stored bytes (None: raw pixels), or None where the kind cannot (the samples are then
        copied one by one through :meth:`sink`)."""
        return None  # kinds whose shards are not one file per block (zarr chunks)

    def cleanup(self, staging: Path) -> None:
        """Remove the backend's build bookkeeping from the staging folder (just before the commit)."""
        return None  # nothing to do for kinds without such a step

    def finalize_folder(self, staging: Path, manifest: Manifest) -> None:
        """Last touches with the manifest known (e.g. metadata other readers need), before it is written."""
        return None  # nothing to do for kinds without such a step

    # ------------------------------------------------------------ read side
    @abstractmethod
    def open(self, location: Location, manifest: Manifest, *, block_cache: BlockCache | None = None) -> ImageStore:
        """Check the images against ``manifest`` (cheap: headers, a listing; no pixel read) and return a store."""


def one_file_per_block(staging: Path, ordered: list[BlockRecord]) -> list[ShardInfo]:
    """``Backend.finish`` for kinds that write one shard file per block (npy, jpeg): shards in plan order,
    each with its record's digest; a block whose every file failed leaves no shard."""
    from cachebuild.format.manifest import ShardInfo

    shards, pos = [], 0
    for r in ordered:
        if r.count:
            shards.append(ShardInfo(r.file, pos, r.count, r.digest))
            pos += r.count
        else:
            (staging / r.file).unlink(missing_ok=True)
    return shards


def adopt_file(location: Location, shard: ShardInfo, dst: Path) -> bool:
    """``Backend.adopt_shard`` for kinds that write one shard file per block (npy, jpeg): the older local cache's
    shard linked in as ``dst`` (a shard's bytes do not depend on its block's number); False for a remote cache."""
    if not location.is_local:
        return False
    link_shard(location.local_path(shard.file), dst)
    return True


def link_shard(src: Path, dst: Path) -> None:
    """``dst`` made the same bytes as ``src`` (an older cache's shard): a hard link when the filesystem allows (no
    byte copied; caches are never written in place), else a copy; under a temporary name, then renamed."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    # rename(2) of one hard link over another of the same file does nothing and succeeds: where a killed update had
    # linked this shard in already, ``tmp`` is still there, and would be committed as a file of the cache
    tmp.unlink(missing_ok=True)


def digest_file(path: str | os.PathLike[str], algorithm: Digest, read_bytes: int = 8 << 20) -> str:
    """``algorithm``'s digest of a whole local file, read ``read_bytes`` at a time."""
    h = algorithm.new()
    with open(path, "rb") as f:
        while chunk := f.read(read_bytes):
            h.update(chunk)
    return h.hexdigest()


def digest_of_file(location: Location, name: str, size: int, algorithm: Digest, read_bytes: int = 8 << 20) -> str:
    """``algorithm``'s digest of a shard file's ``size`` bytes read through ``location`` (local or remote) in
    slices, so verifying a large shard holds ``read_bytes`` at a time."""
    h = algorithm.new()
    for lo in range(0, size, read_bytes):
        (data,) = location.read_ranges(name, [(lo, min(size, lo + read_bytes))])
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------- the registry

DEFAULT_STORAGE = "npy"

# kind -> "module:Class"
_BACKENDS: dict[str, str] = {
    "npy": "cachebuild.storage.kinds.npy:NpyBackend",
    "zarr": "cachebuild.storage.kinds.zarr:ZarrBackend",
    "jpeg": "cachebuild.storage.kinds.jpeg:JpegBackend",
}
_LOADED: dict[str, Backend] = {}


def register_backend(name: str, target: str | Backend) -> None:
    """Add a storage kind: ``target`` is a Backend instance or a ``"module:Class"`` string."""
    if isinstance(target, Backend):
        _LOADED[name] = target
        _BACKENDS[name] = f"{type(target).__module__}:{type(target).__qualname__}"
    else:
        _BACKENDS[name] = target
        _LOADED.pop(name, None)


# The registered kinds' names, a live view: a kind registered later is in it.
STORAGE_KINDS = _BACKENDS.keys()


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend of storage kind ``name`` (a named error for a kind this release does not know)."""
    backend = _LOADED.get(name)
    if backend is None:
        if name not in _BACKENDS:
            raise UnsupportedFormatError(
                f"storage kind {name!r} is not known to this cachebuild (it knows {', '.join(_BACKENDS)}); "
                f"upgrade cachebuild or rebuild the cache"
            )
        module, cls = _BACKENDS[name].split(":")
        backend = _LOADED[name] = getattr(importlib.import_module(module), cls)()
    return backend


def staging_names() -> str:
    """A regex (fullmatch) of every name some storage kind writes at the top of a staging folder."""
    return "|".join(f"(?:{b.staging_names})" for b in map(get_backend, _BACKENDS) if b.staging_names)


def cache_names() -> frozenset[str]:
    """Names some storage kind keeps in a finished cache beyond the files its manifest lists."""
    return frozenset().union(*(get_backend(name).cache_names for name in _BACKENDS))



# ---------------------------------------------------------------- shard files, opened once per process

# Guards making a process's handle table and its lock (threads of a forked child or of an unpickled reader
# arrive together); made anew in a forked child, where another thread may have held it at the fork.
_TABLE_GUARD = threading.Lock()


def _new_table_guard() -> None:
    global _TABLE_GUARD
    _TABLE_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_new_table_guard)


class ShardHandles:
    """A cache's shard files under ``location``, each opened once per process, lazily (after a fork or unpickling
    the next use opens them again): what :meth:`_open_local` makes of a local file, a :class:`CachedFile` mirror
    for a URL with a block cache, or False for a URL without one (plain range reads). Threads of one process open
    each file once: two handles of one file would leak the loser's descriptors."""

    def __init__(self, location: Location, count: int, block_cache: BlockCache | None, cache_id: str) -> None:
        self.location = location
        self.block_cache = None if location.is_local else block_cache
        self.cache_id = cache_id
        self._count = count
        self._handles: list[Any] | None = None
        self._pid = -1  # no handle table in any process yet
        self._lock: Any = None
        self.bytes_fetched = 0
        self._readahead: Readahead | None = None  # whole files fetched ahead into the block cache (made when used)
        # Set by a shard-windowed sampler (CacheSampler(shard_window=W)): every file a batch touches is read
        # whole within the window, so it is fetched whole at once (big requests) rather than row by row.
        self.whole_files = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": None, "_pid": -1, "_lock": None, "bytes_fetched": 0}

    @property
    def readahead(self) -> Readahead:
        """This reader's background fetches into the block cache (a sequential or shard-windowed remote read)."""
        if self._readahead is None:
            self._readahead = Readahead(WHOLE_FILE_THREADS if self.whole_files else 1)
        return self._readahead

    def _open_local(self, k: int) -> Any:
        """File ``k`` of a local cache, opened (subclasses say how)."""
        raise NotImplementedError

    def _name_and_size(self, k: int) -> tuple[str, int]:
        """File ``k``'s name and the bytes a reader may use of it (what a block cache mirrors)."""
        raise NotImplementedError

    def _table(self) -> list[Any]:
        """This process's handle table (made on first use here, with the lock that guards opening)."""
        if self._pid != os.getpid():
            with _TABLE_GUARD:
                if self._pid != os.getpid():
                    self._lock = threading.Lock()
                    self._handles = [None] * self._count
                    self._pid = os.getpid()  # last: another thread that sees our pid finds both made
        return self._handles  # type: ignore[return-value]

    def _handle(self, k: int) -> Any:
        handles = self._table()
        got = handles[k]
        if got is None:
            with self._lock:
                got = handles[k]
                if got is None:
                    got = handles[k] = self._open(k)
        return got

    def _open(self, k: int) -> Any:
        if self.location.is_local:
            return self._open_local(k)
        if self.block_cache is not None and not self.block_cache.full:
            name, size = self._name_and_size(k)
            try:
                return self.block_cache.file(BlockCache.key(self.cache_id, name), size)
            except BlockCacheFullError as e:  # no room for its table: this file is read uncached
                self.block_cache.note_full(e)
        return False

    def _fetch(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self._fetch_many([(name, ranges)])[0]

    def _fetch_many(self, wanted: Sequence[tuple[str, Sequence[tuple[int, int]]]]) -> list[list[bytes]]:
        got = self.location.read_many(wanted)
        with _TABLE_GUARD:  # the files of a batch are fetched by several threads at once
            self.bytes_fetched += sum(len(g) for file in got for g in file)
        return got

    def read_ahead(self, k: int, start: int) -> None:
        """A sequential read reached byte ``start`` of file ``k``: fetch the rest of it and the next
        ``CACHEBUILD_READAHEAD_FILES`` files whole into the block cache, in the background, once each."""
        more = settings().readahead_files
        if self.block_cache is None or self.block_cache.full or more == 0:
            return
        for j in range(k, min(self._count, k + more + 1)):
            self._prefetch(j, start if j == k else 0)

    def read_files_whole(self) -> None:
        """From now on every file a batch touches is fetched whole (:attr:`whole_files`), several at once."""
        self.whole_files = True
        if self._readahead is not None:
            self._readahead.threads = WHOLE_FILE_THREADS

    def read_whole(self, k: int) -> None:
        """File ``k`` will be read whole soon (:attr:`whole_files`): fetch all of it into the block cache, in the
        background, once per process; nothing without a block cache or with ``CACHEBUILD_READAHEAD_FILES=0``."""
        if self.block_cache is None or self.block_cache.full or settings().readahead_files == 0:
            return
        self._prefetch(k, 0)

    def _prefetch(self, k: int, start: int) -> None:
        """Schedule file ``k`` from byte ``start`` to its end into its block-cache mirror (once per process)."""
        handle = self._handle(k)
        if isinstance(handle, CachedFile):
            name, size = self._name_and_size(k)
            job = functools.partial(handle.prefetch, start, size, functools.partial(self._fetch, name), STEP_BYTES)
            self.readahead.schedule(k, job, self.location.describe(name))

    def read_files(self, wanted: Sequence[tuple[int, Sequence[tuple[int, int]]]]) -> list[list[Any]]:
        """The byte ranges of remote files ``(k, ranges)``, one list per file: views of block-cache mirrors
        (blocks checked; those files read together), and every other range fetched in one group of requests,
        so that a batch waits once for its slowest request, not once per file or per thread."""
        handles = [self._handle(k) for k, _ in wanted]
        cached = [i for i, h in enumerate(handles) if isinstance(h, CachedFile)]
        plain = [i for i, h in enumerate(handles) if not isinstance(h, CachedFile)]
        name = [self._name_and_size(k)[0] for k, _ in wanted]
        jobs: list[Callable[[], Any]] = [
            functools.partial(handles[i].read, wanted[i][1], functools.partial(self._fetch, name[i])) for i in cached]
        if plain:
            jobs.append(functools.partial(self._fetch_many, [(name[i], wanted[i][1]) for i in plain]))
        results = in_parallel(jobs)
        out: list[list[Any]] = [[] for _ in wanted]
        for i, got in zip(cached, results[: len(cached)], strict=True):
            out[i] = got
        for i, got in zip(plain, results[-1] if plain else [], strict=True):
            out[i] = got
        return out


# The block-cache mirrors of a remote batch's files are read at once, each by a thread of this pool whose
# requests run on the location's event loop: one file's slow request (a 503 with Retry-After, a retry) delays
# the batch once, not once per file. Made anew in each process (a forked child has none of its parent's threads).
_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_THREADS = 16


def in_parallel(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each job's result, in order, the jobs run together; the first failure (in order) is raised once all ended."""
    global _POOL
    if len(jobs) <= 1:
        return [j() for j in jobs]
    with _TABLE_GUARD:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="cachebuild-read"))
        pool = _POOL[1]
    futures = [pool.submit(j) for j in jobs]
    wait(futures)
    return [f.result() for f in futures]
