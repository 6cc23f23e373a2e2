"""WebDataset tar shards (timm's ``imagenet1k-train-{0000..1023}.tar``: ``KEY.jpg`` + ``KEY.cls`` + ``KEY.json``).

Samples are grouped as webdataset groups them: consecutive regular members sharing a key (the name up to the
first dot of its last component), extensions lower-cased, ``__meta__`` members skipped. The image is the
first of ``image_keys`` a sample has (jpg, jpeg, png, webp by default; its content is sniffed when decoded);
the label is the integer in its ``.cls`` member, or field ``label_key`` of its ``.json`` member.

Order: shards by name, then samples in archive order. Each shard is indexed once, in parallel (one header
read per member, plus the small label members); workers then read each image by offset. A sample without
an image or a label, a cut member, or a damaged header (listed as ``shard.tar#@OFFSET``) stays in the plan
as a failure with its reason; the build lists it. Provenance: ``shard.tar#KEY``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan
from cachebuild.sources.sample_table import SampleTable
from cachebuild.sources.shards.files import Shard, open_shard, read_range
from cachebuild.sources.shards.plan import ShardPart, plan_shards, split_option
from cachebuild.sources.shards.tar_index import TarMember, index_tar

__all__ = ["IMAGE_KEYS", "TarSampleReader", "WdsLayout", "WdsOptions", "WdsSource", "index_wds_shard", "wds_plan"]

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
_MAX_LABEL_MEMBER = 1 << 20  # a .cls or .json member larger than this is not a label
_SPLIT_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta


@dataclass(frozen=True)
class WdsLayout:
    image_keys: tuple[str, ...] = IMAGE_KEYS  # first one present wins
    cls_key: str = "cls"  # member extension holding the class index as ASCII digits
    label_key: str | None = None  # when set: the label is this field of the json_key member
    json_key: str = "json"


def _groups(members: list[tuple[TarMember, bool]]) -> list[tuple[str, list[tuple[str, TarMember, bool]]]]:
    """[(key, [(extension, member, cut), ...])] as webdataset groups consecutive members."""
    out: list[tuple[str, list[tuple[str, TarMember, bool]]]] = []
    for m, cut in members:
        if ("/" not in m.name and m.name.startswith("__") and m.name.endswith("__")) or _META.match(m.name):
            continue
        match = _SPLIT_KEY.match(m.name)
        if match is None:  # no extension: not part of any sample (webdataset skips it too)
            continue
        key, ext = match.group(1), match.group(2).lower()
        if not out or out[-1][0] != key:
            out.append((key, []))
        out[-1][1].append((ext, m, cut))
    return out


def _label(f: Any, parts: dict[str, tuple[TarMember, bool]], layout: WdsLayout) -> int | str:
    """The label, or the reason there is none."""
    ext = layout.json_key if layout.label_key is not None else layout.cls_key
    if ext not in parts:
        return f"no label: the sample has no .{ext} member" + (
            f" (members: {', '.join(sorted(parts))})" if parts else "")
    member, cut = parts[ext]
    if cut:
        return f"its .{ext} member is cut short by the end of the shard"
    if member.size > _MAX_LABEL_MEMBER:
        return f"its .{ext} member ({member.size} bytes) is too large to be a label"
    f.seek(member.offset)
    data = f.read(member.size)
    try:
        if layout.label_key is None:
            return int(data.decode("ascii").strip())
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        what = "an integer" if layout.label_key is None else "JSON"
        return f"its .{ext} member is not {what}: {data[:40]!r}"
    if not isinstance(value, dict) or layout.label_key not in value:
        return f"no label: its .{ext} member has no field {layout.label_key!r}"
    label = value[layout.label_key]
    if isinstance(label, bool) or not isinstance(label, int):
        return f"field {layout.label_key!r} of its .{ext} member is not an integer: {label!r}"
    return label


def index_wds_shard(shard: Shard, layout: WdsLayout) -> ShardPart:
    """Index one shard (runs in a planning worker): its samples in archive order, their image offsets and
    sizes (-1 and 0 where there is none) and labels (-1: none), and why a sample cannot be one."""
    keys: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    labels: list[int] = []
    problems: dict[int, str] = {}

    def add(key: str, offset: int = -1, size: int = 0, label: int = -1, problem: str | None = None) -> None:
        if problem is not None:
            problems[len(keys)] = problem
        keys.append(key)
        offsets.append(offset)
        sizes.append(size)
        labels.append(label)

    with open_shard(shard) as f:
        index = index_tar(f, shard.size)
        if index.damage is not None and index.damage.startswith("compressed tar"):
            raise SourceError(f"{shard.url}: {index.damage}")
        members = [(m, False) for m in index.members] + [(m, True) for m in index.truncated]
        for key, group in _groups(members):
            parts: dict[str, tuple[TarMember, bool]] = {}
            dupes = []
            for ext, m, cut in group:
                if ext in parts:
                    dupes.append(ext)
                parts.setdefault(ext, (m, cut))
            image = next((k for k in layout.image_keys if k in parts), None)
            label = _label(f, parts, layout)
            member, cut = parts[image] if image is not None else (None, False)
            problem = None
            if dupes:
                problem = f"two members named {key}.{dupes[0]}: which one is the sample is ambiguous"
            elif member is None:
                problem = (f"no image: none of its members ({', '.join(sorted(parts))}) is "
                           f"{'/'.join('.' + k for k in layout.image_keys)}")
            elif cut:
                problem = (f"truncated: the shard ends at byte {shard.size}, inside its .{image} member (a cut "
                           f"download?)")
            elif isinstance(label, str):
                problem = label
            add(key, member.offset if member is not None else -1, member.size if member is not None else 0,
                label if isinstance(label, int) else -1, problem)
        if index.damage is not None and not index.truncated:
            add(f"@{index.damage_offset}", problem=index.damage)
    return ShardPart(keys, np.asarray(labels, np.int64), {"offset": np.asarray(offsets, np.int64),
                                                         "size": np.asarray(sizes, np.int64)}, problems)


@dataclass(frozen=True)
class TarSampleReader:
    """Reads a planned sample's image member by offset (picklable; runs in the build's workers)."""

    shards: tuple[Shard, ...]
    table: SampleTable  # columns: shard (int32), offset (int64), size (int64)

    def for_block(self, start: int, stop: int) -> TarSampleReader:
        shards, table = self.table.slice(start, stop).only_used("shard", self.shards)
        return TarSampleReader(shards, table)

    def __call__(self, index: int, key: str) -> bytes:
        row = self.table.row(index, key)
        c = self.table.columns
        return read_range(self.shards[int(c["shard"][row])], int(c["offset"][row]), int(c["size"][row]))


@dataclass(frozen=True)
class _WdsShards:
    """WebDataset tars for :func:`~cachebuild.sources.shards.plan.plan_shards`."""

    layout: WdsLayout
    suffix = ".tar"
    what = "WebDataset .tar shards"
    source_format = "webdataset"
    shard_column = "shard"
    threads = False
    nothing = "shard(s) hold no samples"

    def index(self, shard: Shard) -> ShardPart:
        return index_wds_shard(shard, self.layout)

    def found_classes(self, parts: list[ShardPart], src: str) -> list[str] | None:
        return None  # tars carry no class names: --classes FILE, else 0..max

    def digest_extra(self, parts: list[ShardPart], classes: list[str]) -> dict[str, Any]:
        return {"layout": self.layout.__dict__, "classes": classes}

    def reader(self, shards: tuple[Shard, ...], parts: list[ShardPart], table: SampleTable) -> TarSampleReader:
        return TarSampleReader(shards, table)


def wds_plan(src: str | os.PathLike[str], *, split: str | None = None, classes: list[str] | None = None,
             layout: WdsLayout = WdsLayout(), dataset: str | None = None, jobs: int = 1) -> Plan:
    """Plan the WebDataset shards at ``src`` (a brace pattern, glob, folder, prefix or file; local or URL)."""
    return plan_shards(_WdsShards(layout), src, split=split, classes=classes, dataset=dataset, jobs=jobs)


def _extensions(text: str) -> tuple[str, ...]:
    """``jpg,JPEG,.png`` -> ("jpg", "jpeg", "png")."""
    keys = tuple(k.strip().lower().lstrip(".") for k in text.split(",") if k.strip())
    if not keys:
        raise ValueError("name at least one extension")
    return keys


def _extension(text: str) -> str:
    return text.lower().lstrip(".")


@dataclass(frozen=True)
class WdsOptions(SourceOptions):
    split: str | None = split_option()
    label_key: str | None = option(None, "Take each label from this field of the sample's .json member instead "
                                         "of its .cls member.", metavar="FIELD")
    cls_key: str = option("cls", "Extension of the member holding the class index (ASCII digits).",
                          metavar="EXT", parse=_extension)
    image_keys: tuple[str, ...] = option(IMAGE_KEYS, "Extensions of the image member; the first one a sample has "
                                                     "is used (content is sniffed).", metavar="EXT,...",
                                         parse=_extensions)
    dataset: str | None = option(None, "Dataset name (default: from the shard names).", flag="--name")
    json_key: str = "json"  # no flag: webdataset's name for the member of per-sample JSON

    @property
    def layout(self) -> WdsLayout:
        return WdsLayout(self.image_keys, self.cls_key, self.label_key, self.json_key)

    def to_dict(self) -> dict[str, Any]:  # the recipe nests the layout
        return {"split": self.split, "dataset": self.dataset,
                "layout": {**self.layout.__dict__, "image_keys": list(self.image_keys)}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WdsOptions:
        layout = dict(data.get("layout") or {})
        return cls(split=data.get("split"), dataset=data.get("dataset"), label_key=layout.get("label_key"),
                   cls_key=layout.get("cls_key", "cls"), image_keys=tuple(layout.get("image_keys", IMAGE_KEYS)),
                   json_key=layout.get("json_key", "json"))


class WdsSource(SourceKind):
    name = "wds"
    options = WdsOptions
    help = ("WebDataset tar shards at SRC: a brace pattern (x-{0000..1023}.tar), a glob, a folder or prefix of .tar "
            "files, or one file; local or a URL (s3://, https://...). Shards in name order, samples in archive "
            "order.")
    pins_classes = True
    classes_flag = True

    def plan(self, src: str, options: WdsOptions, *, classes: list[str] | None = None, jobs: int = 1) -> list[Plan]:
        return [wds_plan(src, split=options.split, classes=classes, layout=options.layout, dataset=options.dataset,
                         jobs=jobs)]
