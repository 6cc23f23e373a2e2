"""Image files packed as WebDataset tar shards the way timm's ``imagenet-1k-wds`` is: ``KEY.cls`` (the class
index in ASCII), ``KEY.jpg`` (the original file's bytes, whatever their format) and ``KEY.json`` (filename,
label, class name), members in sorted extension order as webdataset's ``TarWriter`` writes them, samples
shuffled across shards, shards named ``<prefix>-{0000..N}.tar``.

``quirks=True`` adds what real shards hold that a reader must take in its stride (a ``.png`` and an upper-case
``.JPEG`` member, a key inside a folder, a key longer than 100 characters (a PAX header), a class index with
a newline, a folder member); ``broken=True`` adds what it must survive: an image without a label, a label
without an image, members named ``../../x`` and ``/etc/x``, and a last shard cut inside an image.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PackedImage", "pack_files", "write_wds"]

_MTIME = 1700000000


@dataclass(frozen=True)
class PackedImage:
    name: str  # the source file's name, e.g. n01440764_10026.JPEG: the key is its stem
    label: int
    data: bytes
    source: str = ""  # where it came from (for tests), e.g. its path in a class-folder tree


def pack_files(root: Path, keys: list[str], labels: list[int]) -> list[PackedImage]:
    """The files ``root/key`` with their labels (a class-folder tree's listing), those that can be read."""
    out = []
    for key, label in zip(keys, labels, strict=True):
        path = Path(root) / key
        if path.is_file():  # a dangling link has no bytes to pack
            out.append(PackedImage(path.name, int(label), path.read_bytes(), key))
    return out


def _member(tar: tarfile.TarFile, name: str, data: bytes, size: int | None = None) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data) if size is None else size
    ti.mtime, ti.mode, ti.uname, ti.gname = _MTIME, 0o444, "bigdata", "bigdata"
    tar.addfile(ti, io.BytesIO(data))


def _sample(tar: tarfile.TarFile, key: str, members: dict[str, bytes]) -> None:
    for ext in sorted(members):  # webdataset's TarWriter writes a sample's members in sorted order
        _member(tar, f"{key}.{ext}", members[ext])


def write_wds(images: list[PackedImage], dest: Path, *, prefix: str = "imagenet1k-train", per_shard: int = 16,
              class_names: list[str] | None = None, seed: int = 0, shuffle: bool = True, quirks: bool = False,
              broken: bool = False) -> dict[str, Any]:
    """Write ``images`` as shards ``dest/<prefix>-NNNN.tar``; deterministic from ``seed``.

    Returns ``shards`` (paths), ``pattern`` (their brace pattern), ``samples`` (one dict per sample in shard
    order: ``shard``, ``key``, ``ext`` of the image member, ``label`` (None when absent), ``image`` (the
    PackedImage, None when absent), ``kind`` (None, or the quirk or breakage it is)), ``quirks`` / ``broken``:
    kind -> that sample's dict, and with ``broken`` also ``lost``: the samples the cut removed entirely.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(images)) if shuffle else np.arange(len(images))
    plain = [images[i] for i in order.tolist()]
    specials: list[dict[str, Any]] = []
    # quirky and misnamed samples copy real photos (whole JPEGs), not the broken files a tree may hold
    donors = [im for im in plain if im.data[:3] == b"\xff\xd8\xff" and im.data[-2:] == b"\xff\xd9"
              and len(im.data) > 2000] or plain
    donor = donors[0]

    def special(kind: str, key: str, ext: str | None, image: PackedImage | None, label: int | None,
                cls_text: str | None = None) -> None:
        specials.append({"kind": kind, "key": key, "ext": ext, "image": image, "label": label, "cls_text": cls_text})

    if quirks:
        special("png", "quirk_png_sample", "png", donors[1 % len(donors)], donors[1 % len(donors)].label)
        special("upper_ext", "quirk_upper_ext", "JPEG", donors[2 % len(donors)], donors[2 % len(donors)].label)
        special("subdir", "extra/quirk_in_folder", "jpg", donors[3 % len(donors)], donors[3 % len(donors)].label)
        special("long_name", "quirk_" + "long" * 30, "jpg", donors[4 % len(donors)], donors[4 % len(donors)].label)
        special("cls_newline", "quirk_cls_newline", "jpg", donors[5 % len(donors)], donors[5 % len(donors)].label,
                f"{donors[5 % len(donors)].label}\n")
    if broken:
        special("no_label", "broken_no_label", "jpg", donor, None)
        special("no_image", "broken_no_image", None, None, donor.label)
        special("dotdot", "../../x", "jpg", donor, donor.label)
        special("absolute", "/etc/x", "jpg", donor, donor.label)

    samples: list[dict[str, Any]] = [
        {"kind": None, "key": Path(im.name).stem, "ext": "jpg", "image": im, "label": im.label, "cls_text": None}
        for im in plain
    ]
    for k, s in enumerate(specials):  # spread through the shards, at fixed places
        samples.insert(min(len(samples), (k * 7 + 3) % (len(samples) + 1)), s)
    n_shards = max(1, -(-len(samples) // per_shard))
    shards = [dest / f"{prefix}-{i:04d}.tar" for i in range(n_shards)]
    out: dict[str, Any] = {"shards": shards, "samples": [], "quirks": {}, "broken": {}}
    for i, shard in enumerate(shards):
        with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
            if quirks and i == 0:
                dir_info = tarfile.TarInfo("extra")
                dir_info.type, dir_info.mtime, dir_info.mode = tarfile.DIRTYPE, _MTIME, 0o755
                tar.addfile(dir_info)
            for s in samples[i * per_shard : (i + 1) * per_shard]:
                _sample(tar, s["key"], _members(s, class_names))
                entry = {"shard": shard, "key": s["key"], "ext": s["ext"], "label": s["label"], "image": s["image"],
                         "kind": s["kind"]}
                out["samples"].append(entry)
                if s["kind"] is not None:
                    out["quirks" if s["kind"] in ("png", "upper_ext", "subdir", "long_name", "cls_newline")
                        else "broken"][s["kind"]] = entry
    if broken:
        _cut_last_shard(out, shards[-1])
    out["pattern"] = str(dest / f"{prefix}-{{{0:04d}..{n_shards - 1:04d}}}.tar")
    return out


def _cut_last_shard(out: dict[str, Any], last: Path) -> None:
    """Cut ``last`` inside its last image member (a download that stopped): that sample becomes the
    ``truncated`` breakage, and the samples after it in that shard are ``lost``."""
    with tarfile.open(last) as tar:
        regular = [m for m in tar.getmembers() if m.isreg()]
    victim = next(m for m in reversed(regular) if m.name.endswith(".jpg") and m.size > 100)
    with open(last, "r+b") as f:
        f.truncate(victim.offset_data + victim.size // 2)
    cut_key = victim.name.rsplit(".", 1)[0]
    cut = next(e for e in out["samples"] if e["shard"] == last and e["key"] == cut_key)
    after = out["samples"].index(cut)
    out["broken"]["truncated"] = cut
    out["lost"] = [e for e in out["samples"][after + 1 :] if e["shard"] == last]
    out["samples"] = [e for e in out["samples"] if e not in out["lost"]]


def _members(s: dict[str, Any], class_names: list[str] | None) -> dict[str, bytes]:
    """One sample's tar members: the image, and with a label its ``.cls`` and ``.json`` (timm's layout)."""
    members: dict[str, bytes] = {}
    if s["image"] is not None:
        members[s["ext"]] = s["image"].data
    if s["label"] is not None:
        members["cls"] = (s["cls_text"] or str(s["label"])).encode("ascii")
        name = s["image"].name if s["image"] is not None else f"{s['key']}.JPEG"
        meta = {"filename": name, "label": s["label"]}
        if class_names is not None:
            meta["class_name"] = class_names[s["label"]]
        members["json"] = json.dumps(meta).encode()
    return members
