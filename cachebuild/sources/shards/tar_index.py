"""Index one tar file: where each regular member's data starts and how long it is, from the headers alone.

Python's ``tarfile`` parses the headers (ustar, GNU long names, PAX), seeking over member data, so an index
costs one 512-byte read per member. Nothing is extracted: member names are only strings here, never paths.

``tarfile`` ends its iteration quietly at a damaged header or at the end of a cut file; this module does
not: a member whose data runs past the end of the file, or bytes after the last header that are not the
zero blocks that close a tar, are reported as damage, with the offset where it starts.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO

__all__ = ["TarIndex", "TarMember", "index_tar"]

_COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")  # gzip, bzip2, xz, zstd
_TAIL_CHECK = 1 << 16  # a well-closed tar ends in zero blocks, padded to its record size (10 KiB by default)


@dataclass(frozen=True)
class TarMember:
    name: str
    offset: int  # of the data, in the file
    size: int


@dataclass
class TarIndex:
    members: list[TarMember] = field(default_factory=list)  # regular files, in archive order
    truncated: list[TarMember] = field(default_factory=list)  # regular files whose data the file cuts short
    damage: str | None = None  # why the archive could not be read to its end, if it could not
    damage_offset: int = -1


def index_tar(f: BinaryIO, size: int) -> TarIndex:
    """Index the uncompressed tar ``f`` of ``size`` bytes (seekable)."""
    index = TarIndex()
    try:
        tar = tarfile.open(fileobj=f, mode="r:")  # noqa: SIM115  (closed below; f stays the caller's)
    except tarfile.ReadError as e:
        if _read_at(f, 0, 6).startswith(_COMPRESSED_MAGIC):
            index.damage = "compressed tar: shards must be plain .tar to be read by offset; decompress them"
        else:
            index.damage = f"not a tar file ({e})"
        index.damage_offset = 0
        return index
    end = 0
    header_error: str | None = None
    try:
        with tar:
            while (ti := tar.next()) is not None:
                tar.members.clear()  # type: ignore[attr-defined]  # keep memory flat on shards of many members
                end = tar.offset  # just past this member's (padded) data
                if not ti.isreg():
                    continue
                member = TarMember(ti.name, ti.offset_data, ti.size)
                (index.truncated if ti.offset_data + ti.size > size else index.members).append(member)
    except tarfile.TarError as e:  # tarfile checks that a member's data is all there before the next header
        header_error = str(e)
    if index.truncated:
        first = index.truncated[0]
        index.damage = f"the file ends at byte {size}, inside member {first.name!r} (a cut download?)"
        index.damage_offset = size
    elif header_error is not None:
        index.damage = f"damaged tar header at byte {end} ({header_error}); members after it are lost"
        index.damage_offset = end
    else:
        tail = _read_at(f, end, min(size - end, _TAIL_CHECK)) if end < size else b""
        if tail.strip(b"\0") or size - end > _TAIL_CHECK:
            at = end + (len(tail) - len(tail.lstrip(b"\0")))
            index.damage = (f"unreadable tar data from byte {at} of {size} (a damaged header or a cut file); "
                            f"members after it are lost")
            index.damage_offset = at
    return index


def _read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)
