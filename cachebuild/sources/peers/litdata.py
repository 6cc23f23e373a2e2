"""LitData ``optimize`` output (``index.json`` + ``chunk-R-I.bin`` ...), read from its layout; litdata is not
imported.

``index.json`` lists the chunks in order (``filename``, ``chunk_size`` samples, ``chunk_bytes``) and a
``config``: ``data_format`` (one serializer name per leaf of a sample), ``data_spec`` (the sample's pytree as
torch's JSON: the names of the leaves), ``item_loader``, ``compression``, ``encryption``. A chunk is uint32 ``n``,
``n + 1`` uint32 item offsets, then the items; an item is one uint32 size per leaf, then the leaves' bytes
(:mod:`~cachebuild.sources.peers.records`).

Leaves are named by their path in the sample (``image``; ``0``, ``1`` for a tuple; ``meta.label`` when nested).
Images: ``pil`` (raw pixels and mode), ``jpeg``, ``image:*``, ``bytes`` or ``file:*`` (image files' bytes),
``numpy`` or ``tensor`` of uint8 (HWC; a tensor's CHW too). Labels: ``int``. ``pickle`` leaves are never
unpickled; compressed or encrypted chunks and the token and Parquet item loaders are refused.

Order: chunks in index order, then items in chunk order. Provenance: ``chunk-0-0.bin#INDEX``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachebuild.errors import SourceError
from cachebuild.sources.kind import SourceKind
from cachebuild.sources.peers.common import PeerFile, PeerOptions
from cachebuild.sources.peers.indexed import (
    count_of,
    dataset_dir,
    entries,
    index_fields,
    index_plan,
    plain_name,
    read_index,
    shard_samples,
)
from cachebuild.sources.plan import Plan

__all__ = ["LitdataSource", "leaf_names", "litdata_plan"]

_WHAT = "LitData optimize output"
_IMAGE_FILES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
_CODECS = {"pil": "pil", "jpeg": "encoded", "bytes": "encoded", "numpy": "litdata-numpy",
           "tensor": "litdata-tensor"}


def image_codec(fmt: str) -> str:
    """The codec of a LitData image leaf; ValueError saying why a serializer's output is not one."""
    if fmt in _CODECS:
        return _CODECS[fmt]
    if fmt.startswith("image:") or fmt in ("file", "image"):
        return "encoded"
    if fmt.startswith("file:"):
        if fmt[5:].lower() not in _IMAGE_FILES:
            raise ValueError(f"files of type .{fmt[5:]}: not images")
        return "encoded"
    if fmt.startswith(("no_header_numpy", "no_header_tensor")):
        raise ValueError("a 1-D array: not an image")
    if fmt in ("pickle", "graph", "graph:pickle"):
        raise ValueError("pickled objects: cachebuild never unpickles")
    if fmt == "jpeg_array":
        raise ValueError("several images per sample: not read (one image a sample)")
    raise ValueError("not an image (pil, jpeg, image, bytes, file, numpy or tensor of uint8)")


def _label_kind(fmt: str) -> str:
    if fmt != "int":
        raise ValueError("not an int (class indices)")
    return "<i8"


def leaf_names(spec_text: Any, n_leaves: int, where: str) -> list[str]:
    """The path of every leaf of the samples' pytree spec, in leaf order."""
    try:
        if not isinstance(spec_text, str):
            raise TypeError(f"a {type(spec_text).__name__}, not the JSON text of a pytree spec")
        version, root = json.loads(spec_text)
        if version != 1:
            raise ValueError(f"pytree spec version {version}")
        names: list[str] = []
        _walk(root, "", names)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise SourceError(f"{where}: its data_spec cannot be read ({e}): damaged, or of a newer LitData") from None
    except RecursionError:
        raise SourceError(f"{where}: its data_spec is nested deeper than a sample could be: damaged") from None
    if len(names) != n_leaves:
        raise SourceError(f"{where}: its data_spec has {len(names)} leaves, its data_format {n_leaves}: damaged")
    if len(set(names)) != len(names):
        raise SourceError(f"{where}: its data_spec names two leaves alike ({sorted(names)}): damaged")
    return names


def _walk(node: dict[str, Any], path: str, out: list[str]) -> None:
    children = node["children_spec"]
    if not isinstance(children, list):
        raise TypeError(f"children_spec is a {type(children).__name__}, not a list")
    if node["type"] is None:
        out.append(path or "item")
        return
    context = json.loads(node["context"]) if isinstance(node.get("context"), str) else node.get("context")
    keys = [str(k) for k in context] if isinstance(context, list) and len(context) == len(children) else \
        [str(i) for i in range(len(children))]
    for key, child in zip(keys, children, strict=True):
        _walk(child, f"{path}.{key}" if path else key, out)


def _config(index: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    chunks, config = index.get("chunks"), index.get("config")
    if not isinstance(chunks, list) or not isinstance(config, dict):
        raise SourceError(f"{where}: not a LitData index (no chunks and config)")
    chunks = entries(index, "chunks", where, "chunk")
    loader = config.get("item_loader")
    if not isinstance(loader, str) or loader != "PyTreeLoader":
        raise SourceError(f"{where}: items of LitData's {loader}: only the PyTreeLoader's samples (what optimize "
                          f"writes for a function returning a sample) are read"
                          + ("; the Parquet files themselves build with `cachebuild parquet`"
                             if loader == "ParquetLoader" else ""))
    if config.get("compression"):
        raise SourceError(f"{where}: chunks compressed with {config['compression']}: write them again with "
                          f"optimize(..., compression=None)")
    if config.get("encryption"):
        raise SourceError(f"{where}: encrypted chunks: cachebuild holds no keys; write them again unencrypted")
    if not chunks:
        raise SourceError(f"{where}: the index lists no chunks")
    return chunks, config


def _chunk_file(folder: Path, chunk: dict[str, Any], where: str) -> PeerFile:
    name = plain_name(chunk.get("filename"), where, "chunk")
    count_of(chunk.get("chunk_size"), where, f"the item count of chunk {name}")
    want = count_of(chunk.get("chunk_bytes"), where, f"the size of chunk {name}")
    f = PeerFile.stat(folder / name, name, "LitData chunk")
    if f.size != want:
        state = "truncated" if f.size < want else "not the file the index describes"
        raise SourceError(f"{f.path}: {f.size:,} bytes where index.json says {want!r}: {state}; copy the dataset "
                          f"again or optimize it again")
    return f


def litdata_plan(src: str | Path, options: PeerOptions, classes: list[str] | None = None) -> Plan:
    """Plan the samples of the LitData optimize output at ``src``."""
    folder = dataset_dir(src, options.split, _WHAT)
    index_file, index = read_index(folder, _WHAT)
    where = index_file.path
    chunks, config = _config(index, where)
    formats = config.get("data_format")
    if not isinstance(formats, list) or not formats or not all(isinstance(x, str) for x in formats):
        raise SourceError(f"{where}: its data_format is not a list of serializer names: damaged index; optimize "
                          f"it again")
    names = leaf_names(config.get("data_spec"), len(formats), where)
    found = dict(zip(names, formats, strict=True))
    image, label = index_fields(found, options, image_codec, _label_kind, where)
    codec, i_img, i_lab = image_codec(found[image]), names.index(image), names.index(label)
    files = [_chunk_file(folder, c, where) for c in chunks]
    counted = [(f, int(c["chunk_size"])) for c, f in zip(chunks, files, strict=True)]
    samples = shard_samples(counted, [None] * len(formats), i_img, i_lab, "<i8", "LitData chunk")
    return index_plan(samples, codec=codec, folder=folder, options=options, classes=classes, index_file=index_file,
                      fields=(image, label), source_format="litdata")


class LitdataSource(SourceKind):
    name = "litdata"
    options = PeerOptions
    help = ("LitData optimize output at SRC (the folder of index.json and chunk-*.bin; or a folder of split folders, "
            "with --split), read without litdata. Images: a pil, jpeg, image, bytes, file, numpy or tensor leaf of "
            "uint8; labels: an int leaf. Decoded and resized as any build; provenance CHUNK#INDEX.")
    url_src = False
    pins_classes = True
    classes_flag = True

    def plan(self, src: str, options: PeerOptions, *, classes: list[str] | None = None, jobs: int = 1) -> list[Plan]:
        return [litdata_plan(src, options, classes)]
