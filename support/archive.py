"""Byte-stable ``.tar.gz`` of a folder (fixed mtimes and owners, sorted members, gzip mtime 0), as datasets are
downloaded (CIFAR's archives, ImageNet's devkit)."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

__all__ = ["write_tar_gz"]

_MTIME = 1244550000  # June 2009, when the CIFAR archives were made


def write_tar_gz(folder: Path, archive: Path) -> Path:
    """Write ``archive`` holding ``folder`` as its top directory (``folder.name/...``), recursively."""
    folder, archive = Path(folder), Path(archive)

    def fixed(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = _MTIME, 1000, 1000, "", ""
        return ti

    with (
        archive.open("wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        tar.addfile(fixed(tar.gettarinfo(str(folder), arcname=folder.name)))
        for path in sorted(folder.rglob("*")):
            arcname = f"{folder.name}/{path.relative_to(folder).as_posix()}"
            info = fixed(tar.gettarinfo(str(path), arcname=arcname))
            if path.is_file() and not path.is_symlink():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)
    return archive
