"""A plan: the sorted list of samples a build will produce, their labels, and the source digest.

The plan is fixed before any image is decoded, so the shard layout, the build key and every worker's
block follow from it alone: the same source gives the same plan whatever the directory listing order.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cachebuild.errors import DecodeError
from cachebuild.format.manifest import SOURCE_DIGEST

__all__ = ["MAX_FILE_BYTES", "FileReader", "Plan", "SampleReader", "block_reader", "digest_contents", "digest_files",
           "digest_stats", "file_plan", "stat_files"]


class SampleReader(Protocol):
    """Picklable; called in workers. Returns encoded bytes (to decode) or an RGB HWC uint8 array.

    A reader may also define ``for_block(start, stop)``, returning a reader of plan indices [start, stop)
    only: see :func:`block_reader`."""

    def __call__(self, index: int, key: str) -> bytes | np.ndarray: ...


def block_reader(reader: Callable[[int, str], Any], start: int, stop: int) -> Callable[[int, str], Any]:
    """The reader a block's task ships to its worker. Readers holding a table per sample (tar member offsets,
    Parquet row positions: tens of MB for ImageNet) hand over just the block's rows, so each task pickles
    KBs instead of the whole table."""
    narrow = getattr(reader, "for_block", None)
    return reader if narrow is None else narrow(start, stop)


MAX_FILE_BYTES = 1 << 30  # no image file of a classification set comes near; a bigger one is not read


@dataclass(frozen=True)
class FileReader:
    """Reads ``root / key`` as bytes (one ``read`` call; no mmap, so NFS and FUSE behave).

    Only regular files are read (checked on the open file, after following links): a FIFO, a device
    (a link to /dev/zero) or a socket named like an image would hang or fill memory, so it is refused
    unread, as is a file over ``max_bytes``. The open is non-blocking so that a FIFO cannot stall it.
    """

    root: str
    max_bytes: int = MAX_FILE_BYTES
    # (size, mtime_ns) of rows [offset, offset + len(stats)) as the plan digested them (None: not
    # checked): a file rewritten after planning would put new pixels under the old source digest, so it is
    # skipped and listed instead, and `cachebuild status` calls the cache stale.
    stats: np.ndarray | None = field(default=None, compare=False)
    offset: int = 0

    def for_block(self, start: int, stop: int) -> FileReader:
        """This reader with only the stats of samples [start, stop) (a block's task pickles KBs)."""
        if self.stats is None:
            return self
        return FileReader(self.root, self.max_bytes, self.stats[start - self.offset : stop - self.offset], start)

    def __call__(self, index: int, key: str) -> bytes:
        fd = os.open(f"{self.root}/{key}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = _KINDS.get(stat.S_IFMT(st.st_mode), "a special file")
                raise DecodeError(key, f"not a regular file ({kind}); not read")
            if self.stats is not None:
                size, mtime = self.stats[index - self.offset].tolist()
                if (st.st_size, st.st_mtime_ns) != (size, mtime):
                    raise DecodeError(key, f"changed after the build planned it ({size:,} -> {st.st_size:,} bytes, "
                                           f"mtime {mtime} -> {st.st_mtime_ns}); not read: `cachebuild status` "
                                           f"lists it, and a rebuild (--force) includes it")
            if st.st_size > self.max_bytes:
                raise DecodeError(key, f"{st.st_size:,} bytes, over the {self.max_bytes:,}-byte limit for one "
                                       f"image file; not read")
            # Plain reads sized by the stat (a buffered read(limit) would allocate the whole limit first),
            # to the end: a file that grew since is caught too.
            data = os.read(fd, st.st_size + 1)
            while len(data) <= self.max_bytes and (more := os.read(fd, min(1 << 16, self.max_bytes + 1 - len(data)))):
                data += more
        finally:
            os.close(fd)
        if len(data) > self.max_bytes:
            raise DecodeError(key, f"over {self.max_bytes:,} bytes, the limit for one image file; not read")
        return data


_KINDS = {stat.S_IFIFO: "a named pipe", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


@dataclass(frozen=True)
class Plan:
    dataset: str  # "imagenet", "cifar10", "cifar100", "folder"
    split: str
    root: str  # source root (a folder, or a URL for shard sources); keys are relative to it
    keys: Sequence[str]  # one per planned sample, in cache order (provenance)
    labels: np.ndarray  # int64, one per key
    classes: list[str]
    source_digest: str  # the source's files by name, size, mtime and label (manifest: source.fingerprint)
    reader: Callable[[int, str], bytes | np.ndarray]
    native_size: int | None = None  # CIFAR: the arrays are already SxS
    extra_labels: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. CIFAR-100 coarse_labels
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. class descriptions, coarse class names
    # (size, mtime_ns) per key as digested, for plans of files: kept in the cache so that `cachebuild
    # status` can say which files changed (None for sources digested otherwise, e.g. CIFAR pixels)
    file_stats: np.ndarray | None = None
    # how this plan was made (kind of source, what was named, options): `cachebuild status` makes it again
    recipe: dict[str, Any] = field(default_factory=dict)
    # wall time (ns) just before ``file_stats`` were taken: an mtime this recent may hide a rewrite in the
    # same tick of the filesystem's clock, so an update (--update) decodes such files again (builder.update)
    listed_ns: int | None = None

    def __len__(self) -> int:
        return len(self.keys)


def stat_files(root: Path, keys: Sequence[str]) -> np.ndarray:
    """int64 (n, 2): (size, mtime_ns) of every key under ``root``, links followed; (-1, -1) for an entry that
    cannot be stat'ed (a dangling link). The per-file inputs of :func:`digest_files`."""
    sizes, mtimes = [-1] * len(keys), [-1] * len(keys)
    top = os.fspath(root)
    for i, key in enumerate(keys):
        try:
            st = os.stat(os.path.join(top, key))
        except OSError:
            continue
        sizes[i], mtimes[i] = st.st_size, st.st_mtime_ns
    return np.ascontiguousarray(np.asarray([sizes, mtimes], dtype=np.int64).reshape(2, -1).T)


def digest_stats(keys: Sequence[str], labels: np.ndarray, stats: np.ndarray, extra: Any = None) -> str:
    """The source digest of (relative path, label, size, mtime) rows, ``stats`` from :func:`stat_files`."""
    h = hashlib.sha256()
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    # Rows joined and hashed a stretch at a time: the bytes of one row after another, in bounded memory.
    if not len(keys) == len(labels) == len(stats):
        raise ValueError(f"{len(keys)} keys, {len(labels)} labels and {len(stats)} stats: one each")
    for lo in range(0, len(keys), _DIGEST_STRETCH):
        hi = min(len(keys), lo + _DIGEST_STRETCH)
        rows = "".join([f"{key}\0{label}\0{'missing' if size < 0 else f'{size}:{mtime}'}\n"
                        for key, label, size, mtime in zip(keys[lo:hi], labels[lo:hi].tolist(),
                                                           stats[lo:hi, 0].tolist(), stats[lo:hi, 1].tolist(),
                                                           strict=True)])
        h.update(rows.encode("utf-8", "surrogateescape"))
    return h.hexdigest()


_DIGEST_STRETCH = 65_536


def digest_files(root: Path, keys: Sequence[str], labels: np.ndarray, extra: Any = None) -> str:
    """sha256 over every (relative path, label, size, mtime): a file added, removed, relabelled or
    rewritten changes it. A missing entry (dangling link) still counts, as 'missing'."""
    return digest_stats(keys, labels, stat_files(root, keys), extra)


def file_plan(dataset: str, split: str, root: Path, keys: list[str], labels: np.ndarray, classes: list[str],
              extra: dict[str, Any] | None = None) -> Plan:
    """A plan of encoded image files under ``root``, digested by path, label, size and mtime."""
    listed_ns = time.time_ns()
    stats = stat_files(root, keys)
    return Plan(
        dataset=dataset,
        split=split,
        root=str(root),
        keys=keys,
        labels=labels,
        classes=classes,
        source_digest=digest_stats(keys, labels, stats, {"classes": classes}),
        reader=FileReader(str(root), stats=stats),
        extra=extra or {},
        file_stats=stats,
        listed_ns=listed_ns,
    )


def digest_contents(plan: Plan, positions: np.ndarray, jobs: int = 1) -> np.ndarray:
    """The :data:`~cachebuild.format.manifest.SOURCE_DIGEST` hex (``S16``) of the bytes of the plan's files at
    ``positions``, read as a build reads them (``plan.reader``: regular files only, bounded, and refused if changed
    since planning), in ``jobs`` threads (-1: one per core; the reads run outside the GIL, overlapping the hashing,
    which holds it); ``b""`` for a file that cannot be read or gives no bytes."""
    keys = plan.keys

    def one(i: int) -> bytes:
        try:
            data = plan.reader(i, keys[i])
        except Exception:  # unreadable now (gone, changed, special): not the bytes of any digest
            return b""
        return SOURCE_DIGEST.of(data).encode() if isinstance(data, bytes) else b""

    todo = np.asarray(positions, dtype=np.int64).tolist()
    workers = (os.cpu_count() or 1) if jobs < 0 else max(1, jobs)
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(todo)))) as pool:
        return np.array(list(pool.map(one, todo)), dtype=f"S{SOURCE_DIGEST.hex_len}").reshape(-1)
