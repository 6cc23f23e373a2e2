"""Finding and reading the ``index.json`` of a peer dataset folder (MDS and LitData both keep one beside their
shards, written last: a folder without one was never finished)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachebuild.errors import SourceError
from cachebuild.sources.peers.common import PeerFile

__all__ = ["INDEX", "dataset_dir", "read_index"]

INDEX = "index.json"


def dataset_dir(src: str | Path, split: str | None, what: str) -> Path:
    """The folder holding the dataset's ``index.json``: ``SRC/SPLIT`` where ``--split`` names one, else SRC."""
    root = Path(src)
    if split is not None and (root / split / INDEX).is_file():
        return root / split
    if (root / INDEX).is_file():
        return root
    if not root.is_dir():
        raise SourceError(f"{root}: no such folder; name the {what} folder (the one holding {INDEX})")
    splits = sorted(p.name for p in root.iterdir() if (p / INDEX).is_file())
    if splits:
        raise SourceError(f"{root} holds one {what} per split ({', '.join(splits)})"
                          + (f" but none named {split!r}" if split is not None else "") + ": pass --split")
    raise SourceError(f"{root} holds no {INDEX}: not a {what} folder (the writer writes {INDEX} last, so a write "
                      f"that was interrupted leaves none; write it again)")


def read_index(folder: Path, what: str) -> tuple[PeerFile, dict[str, Any]]:
    f = PeerFile.stat(folder / INDEX, INDEX, f"{what} index")
    try:
        obj = json.loads(f.read(0, f.size))
    except (ValueError, UnicodeDecodeError) as e:
        raise SourceError(f"{f.path}: not JSON ({e}): not a {what} index, or damaged; write it again") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{f.path}: a JSON {type(obj).__name__}, not the object a {what} index is")
    return f, obj
