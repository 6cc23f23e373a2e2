"""Finding and reading the ``index.json`` of a peer dataset folder (MDS and LitData both keep one beside their
shards, written last: a folder without one was never finished)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachebuild.errors import SourceError
from cachebuild.sources.peers.common import (
    PeerFile,
    PeerOptions,
    Samples,
    dataset_folder,
    peer_plan,
    pick_field,
    reason_of,
    split_of,
)
from cachebuild.sources.peers.labels import first_payload_check
from cachebuild.sources.plan import Plan

__all__ = ["INDEX", "dataset_dir", "index_fields", "index_plan", "read_index"]

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


def index_fields(found: dict[str, str], options: PeerOptions, image_codec: Callable[[str], Any],
                 label_kind: Callable[[str], Any], where: str) -> tuple[str, str]:
    """The image and label fields of an indexed dataset: ``found`` maps each field to its type in the peer's
    words; ``image_codec`` / ``label_kind`` raise ValueError for a type that cannot serve."""
    image = pick_field("image", options.image_field, found, lambda n: reason_of(image_codec, found[n]), where,
                       "--image-field")
    label = pick_field("label", options.label_field, found, lambda n: reason_of(label_kind, found[n]), where,
                       "--label-field")
    return image, label


def index_plan(samples: Samples, *, codec: str, folder: Path, options: PeerOptions, classes: list[str] | None,
               index_file: PeerFile, fields: tuple[str, str], source_format: str) -> Plan:
    """The plan of an indexed dataset's samples, once its first payload decodes as ``codec``."""
    first_payload_check(samples, codec, index_file.path, "--image-field")
    image, label = fields
    return peer_plan(samples, codec=codec, dataset=options.dataset or dataset_folder(folder),
                     split=split_of(folder.name, options.split), root=folder, classes=classes,
                     index_files=[index_file], digest_extra={"image": image, "label": label},
                     source_format=source_format)
