"""The one way cachebuild writes a file that someone may be reading: a temporary name beside the target,
then ``os.replace``. Readers see the old file or the new one, never half of either; a killed writer leaves
at most a ``.<name>.<pid>.<random>.tmp`` behind, which the next writer of that name ignores.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["TEMPORARY_NAME", "AtomicFile", "fsync_dir", "is_temporary_name", "temporary_writer", "write_bytes_atomic",
           "write_json_atomic"]


def _tmp_name(path: Path) -> Path:
    # Random part: two processes writing the same target never share a temporary file.
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


TEMPORARY_NAME = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$")


def is_temporary_name(name: str) -> bool:
    """True for the temporary name of a write that never committed (a killed writer's leftover)."""
    return bool(TEMPORARY_NAME.match(name))


def temporary_writer(name: str) -> int | None:
    """The pid of the process that wrote the temporary file ``name`` (None: not a temporary name)."""
    m = TEMPORARY_NAME.match(name)
    return int(m.group(1)) if m else None


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (the directory entry, not only the file, reaches the disk)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file written under a temporary name and renamed to ``path`` by :meth:`commit`.

    ``durable=True`` fsyncs the file and its folder before returning from ``commit``, for the few files
    whose loss after a machine crash matters (manifests, checkpoints). As a context manager it commits on
    success and removes the temporary file on any exception.
    """

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb", *, durable: bool = False,
                 encoding: str | None = None) -> None:
        if mode not in ("wb", "w"):
            raise ValueError(f"AtomicFile writes whole files: mode must be 'wb' or 'w', got {mode!r}")
        self.path = Path(path)
        self.tmp = _tmp_name(self.path)
        self.durable = durable
        self.file: IO[Any] = open(self.tmp, mode, encoding=encoding)  # noqa: SIM115  (closed by commit/discard)

    def commit(self) -> Path:
        """Rename into place (the file may already be closed, e.g. after an in-place fix-up of ``tmp``)."""
        if not self.file.closed:
            self.file.flush()
            if self.durable:
                os.fsync(self.file.fileno())
            self.file.close()
        elif self.durable:
            with open(self.tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        if self.durable:
            fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes | memoryview, *, durable: bool = True) -> Path:
    """``data`` as the file ``path``, written under a temporary name and renamed (fsynced with its folder when
    ``durable``)."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, durable: bool = True) -> Path:
    """JSON (UTF-8, one-space indent, non-ASCII kept) written atomically."""
    data = json.dumps(obj, indent=1, ensure_ascii=False) + "\n"
    return write_bytes_atomic(path, data.encode("utf-8"), durable=durable)
