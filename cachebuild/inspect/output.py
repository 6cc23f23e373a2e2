"""Where ``show`` and ``report`` write, and what they may replace: only files they wrote themselves.

- Never inside a cache: a cache folder holds what its build wrote (``show --out C/manifest.json`` would have
  replaced the manifest; a sheet or a report inside a cache would travel with it and fail nothing, but is
  not the build's).
- Never through a link: a name that is a symbolic link is not followed, replaced or deleted; nor is a folder
  a report reaches through one (``R/img`` a link out, or a name in its file list that passes through one).
- Never a special file: a FIFO, a device or a folder where a file goes is refused, never opened (a FIFO would
  wait for a writer forever); a report's file list is read only as a regular file of bounded size.
- Replaced only when recognisably their own: ``show`` replaces a PNG (and a layout JSON it wrote); a report
  replaces only the files its file list names *and* that carry a report's own names (``index.html``,
  ``classes-001.html``, ``img/class-00003.png``...): a list edited to name anything else deletes nothing.
- Written atomically (a temporary name, then a rename), so a killed command leaves the old file or the new.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from cachebuild.atomic import AtomicFile, is_temporary_name
from cachebuild.errors import OutputError
from cachebuild.format.manifest import FORMAT_NAME, MANIFEST_NAME

__all__ = ["FILE_LIST", "IMG", "REPORT_NAME", "ReportFolder", "check_file_target", "containing_cache",
           "write_file"]

FILE_LIST = ".cachebuild-report"  # the files a report wrote: the only ones a later report replaces
IMG = "img"
# Every name a report writes (and so the only names it ever deletes), relative to its folder.
REPORT_NAME = re.compile(r"index\.html|classes-\d{3,}\.html|img/(?:counts|histogram|samples|curves)\.png"
                         r"|img/class-\d{5,}\.png")
MAX_FILE_LIST = 16 << 20  # bytes: ~30 per name, so room for half a million pages and sheets
_MAX_MANIFEST = 64 << 20  # read to tell a cachebuild manifest from another file of that name
_PNG = b"\x89PNG\r\n\x1a\n"
_MAX_LAYOUT = 256 << 20


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _read_regular(path: Path, limit: int, *, head: bool = False) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link) of at most ``limit`` bytes (``head``: its first
    ``limit`` bytes, whatever its size), else None. Opened without following a link or waiting on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_size > limit and not head):
            return None
        return f.read(limit)


def containing_cache(path: Path) -> Path | None:
    """The cache folder (one holding a cachebuild ``manifest.json``) that ``path`` is, or lies inside, once
    links are resolved; None when it is in none."""
    for folder in (path.resolve(), *path.resolve().parents):
        manifest = folder / MANIFEST_NAME
        if not os.path.lexists(manifest):
            continue
        raw = _read_regular(manifest, _MAX_MANIFEST)
        if raw is None:
            return folder  # a manifest too large to read here, or not a plain file: not ours to write beside
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME:
            return folder
    return None


def _refuse_inside_cache(path: Path, what: str) -> None:
    cache = containing_cache(path)
    if cache is not None:
        raise OutputError(f"{path} is inside the cachebuild cache {cache}: a cache holds only what its build wrote; "
                          f"write the {what} elsewhere")


def _is_png(data: bytes) -> bool:
    return data.startswith(_PNG)


def _is_layout(data: bytes) -> bool:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(doc, dict) and {"scale", "columns", "tiles"} <= doc.keys()


def check_file_target(path: Path, what: str) -> None:
    """Refuse ``path`` as the file ``what`` ("png" or "layout") that ``show`` writes unless it is new, or a
    regular file of that kind (what an earlier ``show`` wrote), outside every cache."""
    _refuse_inside_cache(path, "sheet" if what == "png" else "layout")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{path} is {_kind(st.st_mode)}, not a file show wrote: show writes a new file or "
                          f"replaces its own; name another path")
    data = _read_regular(path, _MAX_LAYOUT) if what == "layout" else _read_regular(path, len(_PNG), head=True)
    ours = data is not None and (_is_png(data) if what == "png" else _is_layout(data))
    if not ours:
        kind = "a PNG" if what == "png" else "a layout show wrote (JSON with scale, columns, tiles)"
        raise OutputError(f"{path} exists and is not {kind}: show replaces only its own files; name another path")


def write_file(path: Path, write: Any) -> None:
    """``write(f)`` into ``path`` atomically: the old file or the new one, never half (links replaced, not
    followed: callers check the target first)."""
    with AtomicFile(path) as out:
        write(out.file)


class ReportFolder:
    """A report's folder: :meth:`prepare` checks it and deletes the previous report's files; each file is
    then listed in ``FILE_LIST`` before it is written (:meth:`open`), so an interrupted report is still
    replaced by the next one, and nothing else in the folder ever is."""

    def __init__(self, out: Path) -> None:
        self.out = out

    # ---------------------------------------------------------------- before anything is written
    def prepare(self) -> None:
        """Make ``out``, or check the earlier report there and delete its files; refuse anything else (without
        having changed a thing)."""
        out = self.out
        _refuse_inside_cache(out, "report")
        if os.path.lexists(out) and not out.is_dir():
            raise OutputError(f"{out} is {_kind(os.lstat(out).st_mode)}; pass a folder to --out")
        if out.is_dir() and any(out.iterdir()):
            own = self._previous()
            for name in sorted(own, reverse=True):  # img/... before the pages: an order that does not matter
                (out / name).unlink()
            img = out / IMG
            if img.is_dir() and not img.is_symlink() and not any(img.iterdir()):
                img.rmdir()
        (out / IMG).mkdir(parents=True, exist_ok=True)
        self._reset_list()

    def _previous(self) -> list[str]:
        """The files of the report in ``out`` to delete, after checking that every name a report writes is one
        of them (else OutputError, nothing deleted)."""
        out = self.out
        listing = out / FILE_LIST
        if not os.path.lexists(listing):
            raise OutputError(f"{out} is not empty and holds no cachebuild report: choose a new or empty --out "
                              f"folder (a report never overwrites files it did not write)")
        raw = _read_regular(listing, MAX_FILE_LIST)
        if raw is None:
            st = os.lstat(listing)
            what = (_kind(st.st_mode) if not stat.S_ISREG(st.st_mode)
                    else f"{st.st_size:,} bytes, over the {MAX_FILE_LIST:,} a report's file list holds")
            raise OutputError(f"{listing} is {what}: not the file list a report writes, so {out} is not taken for "
                              f"a report's folder; choose a new or empty --out folder")
        listed = {n for n in raw.decode("utf-8", "replace").splitlines() if REPORT_NAME.fullmatch(n)}
        img = out / IMG
        if os.path.lexists(img) and (img.is_symlink() or not img.is_dir()):
            raise OutputError(f"{img} is {_kind(os.lstat(img).st_mode)}, where a report keeps its images; a report "
                              f"writes only inside {out}: move it away or choose another --out")
        own, temporary = [], []
        for folder, prefix in ((out, ""), (img, f"{IMG}/")):
            if not folder.is_dir():
                continue
            with os.scandir(folder) as entries:
                found = list(entries)
            for entry in found:
                name = prefix + entry.name
                if is_temporary_name(entry.name) and entry.is_file(follow_symlinks=False):
                    temporary.append(name)  # a report killed while writing (the atomic write's temporary name)
                    continue
                if not REPORT_NAME.fullmatch(name):
                    continue  # not a name a report writes: never touched
                if entry.is_file(follow_symlinks=False) and name in listed:
                    own.append(name)
                    continue
                why = ("is not in its file list" if entry.is_file(follow_symlinks=False)
                       else f"is {_kind(entry.stat(follow_symlinks=False).st_mode)}")
                raise OutputError(f"{out / name} {why}, so it was not written by a report; a report replaces only "
                                  f"its own files: move it away or choose another --out")
        return own + [t for t in temporary if REPORT_NAME.fullmatch(_target_of(t))]

    def _reset_list(self) -> None:
        with AtomicFile(self.out / FILE_LIST, "w", encoding="utf-8") as f:
            f.file.write(f"{FILE_LIST}\n")

    # ---------------------------------------------------------------- writing
    def claim(self, name: str) -> Path:
        """List ``name`` (one of a report's names) before it is written; returns its path."""
        if not REPORT_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a name a report writes")  # a bug here, not bad input
        fd = os.open(self.out / FILE_LIST, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(f"{name}\n")
        return self.out / name

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """``name`` listed, then written atomically through the file yielded."""
        with AtomicFile(self.claim(name)) as out:
            yield out.file

    def write_text(self, name: str, text: str) -> None:
        with self.open(name) as f:
            f.write(text.encode("utf-8"))


def _target_of(temporary: str) -> str:
    """``img/counts.png`` of ``img/.counts.png.123.0a1b2c3d.tmp``."""
    folder, _, base = temporary.rpartition("/")
    name = base[1:].rsplit(".", 3)[0]
    return f"{folder}/{name}" if folder else name
