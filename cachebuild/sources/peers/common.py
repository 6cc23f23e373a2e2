"""What the peer formats share: their files as planned (name, size, mtime), reading a byte range of one in a
worker, the reader of samples by byte range, picking the image and label fields, names and splits, and the
plan (order, labels, problems, source digest, the table of every sample's file inputs).

Local files only, read with ``os.pread`` through a few descriptors kept open per thread. A file whose size or
mtime differs from the plan's is not read: its samples are failures naming it (``cachebuild status`` calls the
cache stale), so no new bytes land under the old source digest.

Regular files only: every file a converter opens (an index, a shard, a chunk, a ``.beton``) is opened without
waiting (a FIFO would wait for a writer forever) and refused unless it is a regular file (a link to one is
followed, as ImageFolder follows links); every read is checked to lie inside the file before it is made, so a
size or offset read from a damaged header never asks for more memory than the file holds.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import DecodeError, SourceError
from cachebuild.sources.kind import SourceOptions, option
from cachebuild.sources.peers.pixels import check_codec, to_image
from cachebuild.sources.plan import Plan, digest_stats
from cachebuild.sources.sample_table import SampleTable
from cachebuild.sources.shards.files import thread_handle
from cachebuild.sources.shards.plan import check_labels, split_words

__all__ = ["MAX_UNNAMED_CLASSES", "PeerFile", "PeerOptions", "PeerReader", "Samples", "first_payload_check",
           "open_regular", "peer_plan", "pick_field", "read_at", "reason_of", "split_of"]

# Without --classes, classes are named 0..max label: a label above this (a damaged label field) is refused
# rather than making that many class names.
MAX_UNNAMED_CLASSES = 1_000_000


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def open_regular(path: str | os.PathLike[str], what: str) -> int:
    """A descriptor of ``path``, opened without waiting (O_NONBLOCK: a FIFO would block until a writer came) and
    refused with a SourceError unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:  # ValueError: a name with a NUL byte
        raise SourceError(f"{path}: cannot read the {what} ({getattr(e, 'strerror', None) or e}); copy the "
                          f"dataset again completely") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SourceError(f"{path} is not a regular file ({_kind(mode)}), so it is not read as the {what}: put the "
                          f"file itself there")
    return fd

@dataclass(frozen=True)
class PeerFile:
    """One file of a peer dataset as planned: ``name`` relative to the plan's root (the provenance prefix)."""

    path: str
    name: str
    size: int
    mtime_ns: int

    @classmethod
    def stat(cls, path: Path, name: str, what: str) -> PeerFile:
        """The file at ``path`` as planned; a SourceError unless it is a regular file that can be opened."""
        fd = open_regular(path, what)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return cls(str(path), name, st.st_size, st.st_mtime_ns)

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """A descriptor of the file while planning (a regular file, as :meth:`stat` found it)."""
        fd = open_regular(self.path, "file")
        try:
            yield fd
        finally:
            os.close(fd)

    def read(self, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) while planning (SourceError when the file ends before: checked against
        its planned size before anything is read, so a damaged size never asks for more than the file holds)."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise SourceError(f"{self.path} is truncated or damaged: its own index or header puts data at bytes "
                              f"[{offset:,}, {offset + size:,}), past its end at {self.size:,}; copy or write it "
                              f"again")
        with self.opened() as fd:
            data = read_all(fd, offset, size)
        if len(data) != size:
            raise SourceError(f"{self.path} is truncated: it ends at byte {offset + len(data):,}, before "
                              f"{offset + size:,} where its own index says data lies; copy or write it again")
        return data


def read_all(fd: int, offset: int, size: int) -> bytes:
    """Bytes [offset, offset + size) of ``fd``, fewer only where the file ends (pread may return less)."""
    parts = []
    while size > 0:
        chunk = os.pread(fd, min(size, 1 << 30), offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
        size -= len(chunk)
    return b"".join(parts)


def _descriptor(f: PeerFile, key: str) -> int:
    """This thread's open descriptor of ``f``, checked against the plan on every use (an ``fstat``: a file
    rewritten while a descriptor stays open is caught too)."""
    fd = thread_handle(("peer", f), lambda: os.open(f.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), os.close)
    st = os.fstat(fd)  # a FIFO put in its place since the plan: opened without waiting, refused by its size
    if (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
        raise DecodeError(key, f"{f.name} changed after the build planned it ({f.size:,} -> {st.st_size:,} bytes, "
                               f"mtime {f.mtime_ns} -> {st.st_mtime_ns}); not read: `cachebuild status` lists it, "
                               f"and a rebuild includes it")
    return fd


def read_at(f: PeerFile, offset: int, size: int, key: str) -> bytes:
    """Bytes [offset, offset + size) of ``f`` in a worker; DecodeError naming ``key`` when they are not there."""
    if offset < 0 or size < 0 or offset + size > f.size:
        raise DecodeError(key, f"{f.name}: the sample's bytes [{offset:,}, {offset + size:,}) lie past its end at "
                               f"{f.size:,}: damaged")
    try:
        data = read_all(_descriptor(f, key), offset, size)
    except OSError as e:
        raise DecodeError(key, f"cannot read {f.name} ({e.strerror or e})") from None
    if len(data) != size:
        raise DecodeError(key, f"{f.name} ends before the sample's {size:,} bytes at {offset:,}: truncated")
    return data


@dataclass(frozen=True)
class PeerReader:
    """Reads a planned sample's image payload by byte range and hands the build bytes or pixels (picklable).
    ``table`` columns: file (int32), offset, size (int64); ``mode``, ``width``, ``height`` for FFCV images."""

    files: tuple[PeerFile, ...]
    codec: str
    table: SampleTable

    def for_block(self, start: int, stop: int) -> PeerReader:
        files, table = self.table.slice(start, stop).only_used("file", self.files)
        return PeerReader(files, self.codec, table)

    def __call__(self, index: int, key: str) -> bytes | np.ndarray:
        row = self.table.row(index, key)
        c = self.table.columns
        data = read_at(self.files[int(c["file"][row])], int(c["offset"][row]), int(c["size"][row]), key)
        extra = {k: int(c[k][row]) for k in ("mode", "width", "height") if k in c}
        return to_image(self.codec, data, key, **extra)


def pick_field(role: str, wanted: str | None, found: dict[str, str], usable: Callable[[str], str | None],
               where: str, flag: str) -> str:
    """The field that holds the ``role`` ("image", "label"): the one named, else the one called ``role``, else
    the one usable field. ``found``: name -> its type in the peer's words; ``usable(name)``: None if that field
    can serve, else why not."""
    listed = ", ".join(f"{n} ({t})" for n, t in found.items())
    name = wanted if wanted is not None else role if role in found else None
    if name is None:
        fits = [n for n in found if usable(n) is None]
        if len(fits) != 1:
            raise SourceError(f"{where}: no field named {role!r} and {len(fits) or 'no'} fields that could hold "
                              f"the {role}s (its fields: {listed}); pass {flag} NAME")
        name = fits[0]
    if name not in found:
        raise SourceError(f"{where} has no field {name!r} (its fields: {listed}); pass {flag} with one of them")
    why = usable(name)
    if why is not None:
        raise SourceError(f"{where}: field {name!r} is {found[name]}: {why}; pass {flag} with another field "
                          f"(its fields: {listed})")
    return name


def reason_of(check: Callable[[str], Any], value: str) -> str | None:
    """None when ``check(value)`` passes, else the message of the ValueError it raised."""
    try:
        check(value)
    except ValueError as e:
        return str(e)
    return None


def split_of(name: str, split: str | None) -> str:
    """The split: the one asked for, else a split word in ``name`` (``imagenet_train.beton``), else train."""
    return split or next(iter(split_words(name)), "train")


@dataclass
class Samples:
    """What a format's index says of its samples, in order: payload locations, labels (-1: none), problems."""

    files: list[PeerFile]
    keys: list[str]
    labels: np.ndarray
    columns: dict[str, np.ndarray]  # file, offset, size [, mode, width, height]
    problems: dict[int, str] = field(default_factory=dict)


def peer_plan(samples: Samples, *, codec: str, dataset: str, split: str, root: Path, classes: list[str] | None,
              index_files: Sequence[PeerFile], digest_extra: dict[str, Any], source_format: str) -> Plan:
    """The plan of ``samples``: classes checked (or named 0..max), digested by every sample's key, label,
    payload size and file mtime, plus every file's name, size and mtime and the options that chose the fields."""
    check_codec(codec)
    if not samples.keys:
        raise SourceError(f"{root}: the dataset holds no samples")
    labels = samples.labels.astype(np.int64, copy=False)
    problems = dict(samples.problems)
    if classes is None:
        ok = np.ones(len(labels), bool)
        ok[list(problems)] = False
        big = np.flatnonzero(ok & (labels >= MAX_UNNAMED_CLASSES))
        if len(big):
            i = int(big[0])
            raise SourceError(f"{root}: sample {samples.keys[i]} has the label {int(labels[i]):,}: classes would be "
                              f"named 0..{int(labels[ok].max()):,}, over the {MAX_UNNAMED_CLASSES:,} made without "
                              f"names; pass --classes FILE naming them (or --label-field, if this field is not "
                              f"the labels)")
    classes = check_labels(labels, classes, problems, str(root))
    # a sample's inputs as the file table keeps them: its payload's size and its file's mtime (a rewritten
    # shard changes every sample of it); the files' own sizes go into the digest beside them
    mtimes = np.asarray([f.mtime_ns for f in samples.files], np.int64)
    stats = np.column_stack([samples.columns["size"].astype(np.int64), mtimes[samples.columns["file"]]])
    extra = {"format": source_format, "codec": codec, "classes": classes, **digest_extra,
             "files": [(f.name, f.size, f.mtime_ns) for f in [*index_files, *samples.files]]}
    return Plan(
        dataset=dataset,
        split=split,
        root=str(root),
        keys=samples.keys,
        labels=labels,
        classes=classes,
        source_digest=digest_stats(samples.keys, labels, stats, extra),
        reader=PeerReader(tuple(samples.files), codec, SampleTable(0, samples.columns, problems)),
        file_stats=stats,
        extra={"source_format": source_format, "files": len(samples.files)},
    )


@dataclass(frozen=True)
class PeerOptions(SourceOptions):
    """The options every peer format takes."""

    split: str | None = option(None, "Split: names the output sub-folder (MDS, LitData: and picks SRC/SPLIT where "
                                     "SRC holds a folder per split). Default: a split word in SRC's name, else "
                                     "train.")
    image_field: str | None = option(None, "Field holding the images. Default: image, else the one field of an "
                                           "image type.", metavar="NAME")
    label_field: str | None = option(None, "Field holding the class indices. Default: label, else the one "
                                           "integer field.", metavar="NAME")
    dataset: str | None = option(None, "Dataset name (default: from SRC).", flag="--name")


def first_payload_check(samples: Samples, codec: str, where: str, flag: str) -> None:
    """Read the first sample's image payload as the build will: a field whose payloads are not images (a float
    array, a 1-D vector) is refused here, naming it, instead of failing every sample of the build."""
    if codec == "encoded":
        return  # image files: the build's decoder judges each one
    c = samples.columns
    for i, key in enumerate(samples.keys):
        if i in samples.problems:
            continue
        data = read_at(samples.files[int(c["file"][i])], int(c["offset"][i]), int(c["size"][i]), key)
        extra = {k: int(c[k][i]) for k in ("mode", "width", "height") if k in c}
        try:
            to_image(codec, data, key, **extra)
        except DecodeError as e:
            raise SourceError(f"{where}: its first image, {key}, cannot be read: {e.reason}; pass {flag} with "
                              f"the field that holds the images") from None
        return
