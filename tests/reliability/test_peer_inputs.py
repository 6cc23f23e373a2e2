"""The converters of other loaders' formats (``cachebuild ffcv``, ``mds``, ``litdata``) on hostile files: a FIFO,
a device or a folder where a shard, a chunk, an index or a ``.beton`` should be; an FFCV file cut by whole rows
of its allocation table; crafted FFCV headers and field arguments; MDS and LitData ``index.json`` files with
wrong types, NUL bytes in names, deep nesting, counts and sizes that point past their files; and random
mutations of each (a fixed seed: ``RELIABILITY_SEED`` changes it).

Every case ends in a plan of samples, or in one line naming the file and the fix (a ``SourceError``, exit 1,
nothing written), within a time bound: never a traceback, a hang, a memory blow-up or a sample silently lost.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachebuild.errors import CacheBuildError
from cachebuild.sources.registry import plan_source
from tests.cachebuild.sources.peer_files.make_peer_files import HERE
from tests.reliability.helpers import bounded, one_line_error, run_bounded

SPECIAL = "a FIFO, a device or a folder in place of a converter's file: one line, no hang"
CUT_BETON = "an FFCV file cut by whole allocation rows: refused, no sample skipped"
CRAFTED = "crafted FFCV headers, MDS and LitData index.json: a plan or one line"
FUZZED = "mutated {what}: a plan or one line, each sample read or skipped"

SEED = int(os.environ.get("RELIABILITY_SEED", "52"))


def _beton(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(HERE / "ffcv" / "photos.beton.gz") as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
    return dest


def _copy(kind: str, dest: Path) -> Path:
    if kind == "ffcv":
        return _beton(dest / "photos.beton")
    shutil.copytree(HERE / kind, dest / kind)
    return dest / kind


def _plan_or_refusal(kind: str, src: Path, timeout: float = 30) -> str:
    """Plan ``src`` as ``kind`` bounded in time: "planned N" or the refusal's text; anything else fails."""
    try:
        plans = bounded(lambda: plan_source(kind, src), timeout, f"planning {kind} {src}")
    except CacheBuildError as e:
        text = str(e)
        assert "\n" not in text and text, text
        return text
    plan = plans[0]
    assert len(plan.keys) == len(plan.labels) and len(plan.keys) > 0
    return f"planned {len(plan.keys)}"


def _refused_in_one_line(kind: str, src: Path, out: Path, *words: str) -> str:
    code, text = run_bounded(kind, src, "--size", "16", "--out", out, "--no-progress", timeout=60)
    line = one_line_error(text)
    assert code == 1 and not out.exists(), text
    for w in words:
        assert w in line, (w, line)
    return line


# ---------------------------------------------------------------- special files


def _make_special(path: Path, special: str) -> None:
    path.unlink()
    if special == "fifo":
        os.mkfifo(path)  # reading it would wait for a writer forever
    elif special == "dev-zero":
        path.symlink_to("/dev/zero")  # reading it would never end
    else:
        path.mkdir()


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "folder"])
@pytest.mark.parametrize("kind, victim", [("mds", "shard.00002.mds"), ("litdata", "chunk-0-3.bin"),
                                          ("mds", "index.json"), ("litdata", "index.json"), ("ffcv", None)])
def test_a_special_file_in_place_of_a_file_is_refused_unread(tmp_path: Path, ledger, kind: str, victim: str | None,
                                                              special: str) -> None:
    src = _copy(kind, tmp_path / "src")
    path = src if victim is None else src / victim
    if victim is not None and victim != "index.json":  # the index then says 0 bytes, as for an empty file
        index = json.loads((src / "index.json").read_text())
        for entry in index.get("shards", index.get("chunks", [])):
            if entry.get("raw_data", {}).get("basename") == victim:
                entry["raw_data"]["bytes"] = 0
            if entry.get("filename") == victim:
                entry["chunk_bytes"] = 0
        (src / "index.json").write_text(json.dumps(index))
    _make_special(path, special)
    with ledger.trial(SPECIAL, f"{kind} {victim or 'file'} as {special}"):
        if special == "folder" and victim is None:  # a folder named like the .beton: the folder message
            line = _refused_in_one_line(kind, path, tmp_path / "out", str(path), "is a folder")
        else:
            line = _refused_in_one_line(kind, src, tmp_path / "out", str(path))
            assert "not a regular file" in line, line


# ---------------------------------------------------------------- an FFCV file cut by whole rows


@pytest.mark.parametrize("rows", [1, 2, 10, 19])
def test_an_ffcv_file_cut_by_whole_allocation_rows_is_refused(tmp_path: Path, ledger, rows: int) -> None:
    """``head -c -240 x.beton``: the file still ends on a row boundary of its allocation table, so only the
    rows' count can tell: it is refused as truncated, never converted with samples "skipped"."""
    beton = _beton(tmp_path / "src" / "photos.beton")
    data = beton.read_bytes()
    beton.write_bytes(data[: len(data) - 24 * rows])
    with ledger.trial(CUT_BETON, f"{rows} row(s) of 24 bytes"):
        _refused_in_one_line("ffcv", beton, tmp_path / "out", str(beton), "truncated", "again")


# ---------------------------------------------------------------- crafted FFCV headers

_HEADER = struct.Struct("<HHIQQ")  # version, fields, page size, samples, allocation table offset
_FIELD = 1041  # one field descriptor (type id, 16-byte name, 1,024 bytes of arguments)


def _nd_arguments(shape: list[int], descr: bytes) -> bytes:
    head = struct.pack("<32Q", *(shape + [0] * (32 - len(shape)))) + struct.pack("<Q", len(descr))
    return (head + descr).ljust(1024, b"\0")[:1024]


def _ffcv_edits() -> dict[str, Callable[[bytearray], None]]:
    def header(**change: int) -> Callable[[bytearray], None]:
        def edit(data: bytearray) -> None:
            fields = dict(zip(("version", "fields", "page", "samples", "table"), _HEADER.unpack_from(data, 0),
                              strict=True))
            fields.update({k: (len(data) if v == -1 else v) for k, v in change.items()})
            _HEADER.pack_into(data, 0, *fields.values())
        return edit

    def field(k: int, type_id: int | None = None, arguments: bytes | None = None) -> Callable[[bytearray], None]:
        def edit(data: bytearray) -> None:
            at = 24 + k * _FIELD
            if type_id is not None:
                data[at] = type_id
            if arguments is not None:
                data[at + 17 : at + 17 + 1024] = arguments
        return edit

    def name(k: int, raw: bytes) -> Callable[[bytearray], None]:
        def edit(data: bytearray) -> None:
            data[24 + k * _FIELD + 1 : 24 + k * _FIELD + 17] = raw.ljust(16, b"\0")[:16]
        return edit

    garbage = bytes(random.Random(SEED).randrange(256) for _ in range(1024))
    return {
        "table pointer = file size": header(table=-1),
        "table pointer = 0": header(table=0),
        "table pointer inside the metadata": header(table=24 + 4 * _FIELD + 16),
        "table pointer past the end": header(table=2**63),
        "sample count 2**64-1": header(samples=2**64 - 1),
        "sample count 0": header(samples=0),
        "sample count one more": header(samples=11),
        "no fields": header(fields=0),
        "65,535 fields": header(fields=65535),
        "page size 0": header(page=0),
        "image field as an NDArrayField of garbage arguments": field(0, 4, garbage),
        "label field as an NDArrayField of garbage arguments": field(1, 4, garbage),
        "NDArrayField of shape 2**63 x 2": field(0, 4, _nd_arguments([2**63, 2], b'[["", "|u1"]]')),
        "NDArrayField of shape (2**32, 2**32, 3)": field(0, 4, _nd_arguments([2**32, 2**32, 3], b'[["", "|u1"]]')),
        "NDArrayField of a dtype that is not JSON": field(0, 4, _nd_arguments([4, 4, 3], b"\xff\xfe{")),
        "NDArrayField of an object dtype": field(0, 4, _nd_arguments([4, 4, 3], b'[["", "|O"]]')),
        "NDArrayField of descr length past its arguments": field(
            0, 4, (struct.pack("<32Q", 4, 4, 3, *([0] * 29)) + struct.pack("<Q", 2**40)).ljust(1024, b"\0")),
        "a field name of NUL and 0xff bytes": name(0, b"\xff\x00\xfe"),
        "two fields of one name": name(3, b"label"),
    }


@pytest.mark.parametrize("case", list(_ffcv_edits()))
def test_crafted_ffcv_headers_are_a_plan_or_one_line(tmp_path: Path, ledger, case: str) -> None:
    beton = _beton(tmp_path / "src" / "photos.beton")
    data = bytearray(beton.read_bytes())
    _ffcv_edits()[case](data)
    beton.write_bytes(bytes(data))
    with ledger.trial(CRAFTED, f"ffcv: {case}"):
        got = _plan_or_refusal("ffcv", beton)
        if not got.startswith("planned"):
            assert str(beton) in got, got
            _refused_in_one_line("ffcv", beton, tmp_path / "out", str(beton))


# ---------------------------------------------------------------- crafted index.json files


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _index_edits(kind: str) -> dict[str, Callable[[dict[str, Any]], Any]]:
    """Edits of an index (a dict, changed in place, or replaced by what the edit returns: text or an object)."""
    entries = "shards" if kind == "mds" else "chunks"

    def first(**change: Any) -> Callable[[dict[str, Any]], None]:
        def edit(index: dict[str, Any]) -> None:
            index[entries][0].update(change)
        return edit

    def every(**change: Any) -> Callable[[dict[str, Any]], None]:
        def edit(index: dict[str, Any]) -> None:
            for entry in index[entries]:
                entry.update(change)
        return edit

    def raw(**change: Any) -> Callable[[dict[str, Any]], None]:
        def edit(index: dict[str, Any]) -> None:
            index[entries][0]["raw_data"].update(change)
        return edit

    def config(**change: Any) -> Callable[[dict[str, Any]], None]:
        def edit(index: dict[str, Any]) -> None:
            index["config"].update(change)
        return edit

    common: dict[str, Callable[[dict[str, Any]], Any]] = {
        "a JSON list": lambda index: [index],
        "a JSON string": lambda index: "index",
        "100,000-deep nesting": lambda index: _deep(100_000),
        "1,000-deep nesting in a value": lambda index: json.dumps(index).replace(
            f'"{entries}": [', f'"{entries}": [{_deep(990)}, ', 1),
        "not UTF-8": lambda index: b"\xff\xfe" + json.dumps(index).encode(),
        f"{entries} not a list": lambda index: index.update({entries: {"0": index[entries][0]}}),
        f"an entry of {entries} not an object": lambda index: index[entries].insert(0, "shard.00000.mds"),
        f"{entries} empty": lambda index: index.update({entries: []}),
    }
    if kind == "mds":
        return {**common,
                "basename with a NUL": raw(basename="shard.00000\0.mds"),
                "basename '..'": raw(basename=".."),
                "basename absolute": raw(basename="/etc/passwd"),
                "basename a number": raw(basename=7),
                "bytes a string": raw(bytes="11635"),
                "bytes negative": raw(bytes=-1),
                "raw_data a list": first(raw_data=["shard.00000.mds", 11635]),
                "samples a string": first(samples="2"),
                "samples true": first(samples=True),
                "samples 2**40": first(samples=2**40),
                "samples 2**70": first(samples=2**70),
                "samples one more": first(samples=3),
                "column_names not a list": every(column_names="image"),
                "column_encodings of numbers": every(column_encodings=[1, 2, 3, 4]),
                "column_sizes of strings": every(column_sizes=["8", None, None, None]),
                "column_sizes of 2**64": every(column_sizes=[None, None, 2**64, None]),
                "column_sizes negative": every(column_sizes=[None, None, -8, None]),
                "ndarray of shape 2**40,2**40,3": every(column_encodings=["ndarray:uint8:1099511627776,"
                                                                          "1099511627776,3", "jpeg", "int", "pil"]),
                "ndarray of shape x,y": every(column_encodings=["ndarray:uint8:x,y", "jpeg", "int", "pil"]),
                "version 3": lambda index: index.update(version=3),
                "zip_data a string": first(zip_data="shard.00000.mds.zstd"),
                "two columns of one name": every(column_names=["array", "image", "label", "label"]),
                }
    return {**common,
            "filename with a NUL": first(filename="chunk-0-0\0.bin"),
            "filename '..'": first(filename=".."),
            "filename a list": first(filename=["chunk-0-0.bin"]),
            "chunk_bytes a string": first(chunk_bytes="11436"),
            "chunk_size a float": first(chunk_size=2.0),
            "chunk_size 2**40": first(chunk_size=2**40),
            "chunk_size one more": first(chunk_size=3),
            "config a list": lambda index: index.update(config=[]),
            "data_format a string": config(data_format="pil"),
            "data_format of numbers": config(data_format=[1, 2, 3, 4]),
            "data_spec a number": config(data_spec=7),
            "data_spec a list": config(data_spec=[1, {"type": None}]),
            "data_spec 100,000 deep": config(data_spec=_deep(100_000)),
            "data_spec nodes 2,000 deep": config(data_spec=f"[1, {_spec_chain(2000)}]"),
            "data_spec of a node without children": config(data_spec=json.dumps([1, {"type": "builtins.dict"}])),
            "data_spec context not JSON": config(data_spec=json.dumps(
                [1, {"type": "builtins.dict", "context": "[\"a\"", "children_spec": [
                    {"type": None, "context": None, "children_spec": []}]}])),
            "item_loader a list": config(item_loader=["PyTreeLoader"]),
            }


def _spec_chain(depth: int) -> str:
    """A pytree spec of ``depth`` nested one-element lists, as JSON text (too deep for json.dumps to write)."""
    leaf = '{"type": null, "context": null, "children_spec": []}'
    return '{"type": "builtins.list", "context": "null", "children_spec": [' * depth + leaf + "]}" * depth


def _write_index(folder: Path, edited: Any) -> None:
    if isinstance(edited, bytes):
        (folder / "index.json").write_bytes(edited)
    elif isinstance(edited, str) and edited.startswith(("[", "{")):
        (folder / "index.json").write_text(edited)
    else:
        (folder / "index.json").write_text(json.dumps(edited))


@pytest.mark.parametrize("kind, case", [(k, c) for k in ("mds", "litdata") for c in _index_edits(k)])
def test_crafted_index_files_are_a_plan_or_one_line(tmp_path: Path, ledger, kind: str, case: str) -> None:
    src = _copy(kind, tmp_path / "src")
    index = json.loads((src / "index.json").read_text())
    result = _index_edits(kind)[case](index)
    _write_index(src, index if result is None else result)
    with ledger.trial(CRAFTED, f"{kind}: {case}"):
        got = _plan_or_refusal(kind, src)
        if not got.startswith("planned"):
            assert str(src) in got, got
            _refused_in_one_line(kind, src, tmp_path / "out", str(src))


@pytest.mark.parametrize("kind", ["mds", "litdata"])
def test_short_payloads_are_a_recorded_skip_or_one_line(tmp_path: Path, ledger, kind: str) -> None:
    """Records whose field sizes point past their slot, or a payload shorter than its image needs: the sample is
    a failure naming why (the build goes on, as for a broken JPEG), or the plan is refused; never a traceback."""
    src = _copy(kind, tmp_path / "src")
    shard = sorted(p for p in src.iterdir() if p.suffix in (".mds", ".bin"))[1]
    data = bytearray(shard.read_bytes())
    n = struct.unpack_from("<I", data, 0)[0]
    offsets = struct.unpack_from(f"<{n + 1}I", data, 4)
    for i in range(n):  # every record's first size field claims far more than its slot
        struct.pack_into("<I", data, offsets[i], 2**31)
    shard.write_bytes(bytes(data))
    with ledger.trial(CRAFTED, f"{kind}: record sizes past their slots"):
        got = _plan_or_refusal(kind, src)
        if got.startswith("planned"):
            code, out = run_bounded(kind, src, "--size", "16", "--out", tmp_path / "out", "--no-progress", "-q")
            assert code == 0 and "Traceback" not in out, out
        else:
            assert str(src) in got, got


# ---------------------------------------------------------------- random mutations

_JUNK: list[Any] = [None, True, -1, 0, 2**31, 2**63, 2**64 + 1, -(2**70), 1.5, float("nan"), "", "x", "a\0b", "..",
                    "/etc/passwd", [], [None], {}, {"a": 1}, [[[[]]]], "[1, {}]"]


def _mutate(value: Any, rng: random.Random) -> Any:
    """``value`` with one leaf (or one whole sub-tree) replaced by junk."""
    if isinstance(value, dict) and value and rng.random() < 0.85:
        key = rng.choice(sorted(value))
        return {**value, key: _mutate(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.85:
        i = rng.randrange(len(value))
        return [*value[:i], _mutate(value[i], rng), *value[i + 1:]]
    return rng.choice(_JUNK)


@pytest.mark.parametrize("kind", ["mds", "litdata"])
def test_mutated_index_files_are_a_plan_or_one_line(tmp_path: Path, ledger, kind: str) -> None:
    src = _copy(kind, tmp_path / "src")
    index = json.loads((src / "index.json").read_text())
    rng = random.Random(f"{SEED}-{kind}")
    outcomes: dict[str, int] = {}
    lost: list[str] = []
    for trial in range(150):
        mutated = _mutate(_mutate(index, rng), rng) if trial % 3 == 0 else _mutate(index, rng)
        (src / "index.json").write_text(json.dumps(mutated))
        try:
            got = _plan_or_refusal(kind, src, timeout=20)
            outcomes["planned" if got.startswith("planned") else "refused"] = \
                outcomes.get("planned" if got.startswith("planned") else "refused", 0) + 1
        except AssertionError as e:
            lost.append(f"{json.dumps(mutated)[:300]}: {e}")
        except Exception as e:  # a traceback: what this row is about
            lost.append(f"{json.dumps(mutated)[:300]}: {type(e).__name__}: {e}")
    ledger.add(FUZZED.format(what=f"{kind} index.json"), 150, 150 - len(lost), len(lost), "; ".join(lost[:2]),
               detail=f"{outcomes}")
    assert lost == [], lost[:3]


def test_mutated_ffcv_headers_are_a_plan_or_one_line(tmp_path: Path, ledger) -> None:
    """Random bytes written over the header, the field descriptors and the allocation table's rows."""
    beton = _beton(tmp_path / "src" / "photos.beton")
    golden = beton.read_bytes()
    table = _HEADER.unpack_from(golden, 0)[4]
    rng = random.Random(f"{SEED}-ffcv")
    regions = [(0, 24), (24, 24 + 4 * _FIELD), (table, len(golden))]
    lost: list[str] = []
    outcomes: dict[str, int] = {}
    for _ in range(150):
        data = bytearray(golden)
        lo, hi = rng.choice(regions)
        for _ in range(rng.choice((1, 2, 8))):
            at = rng.randrange(lo, hi)
            width = rng.choice((1, 2, 4, 8))
            data[at : at + width] = bytes(rng.randrange(256) for _ in range(width))[: len(data) - at]
        beton.write_bytes(bytes(data))
        try:
            got = _plan_or_refusal("ffcv", beton, timeout=20)
            key = "planned" if got.startswith("planned") else "refused"
            outcomes[key] = outcomes.get(key, 0) + 1
        except AssertionError as e:
            lost.append(f"{e}")
        except Exception as e:
            lost.append(f"{type(e).__name__}: {e}")
    ledger.add(FUZZED.format(what="FFCV headers, field descriptors, allocation rows"), 150, 150 - len(lost),
               len(lost), "; ".join(lost[:2]), detail=f"{outcomes}")
    assert lost == [], lost[:3]


def test_the_goldens_still_plan(tmp_path: Path) -> None:
    """The cases above start from these: each plans every sample."""
    for kind in ("mds", "litdata", "ffcv"):
        src = _copy(kind, tmp_path / kind)
        assert _plan_or_refusal(kind, src) == f"planned {10}", kind
    assert np.iinfo(np.int64).max == 2**63 - 1


@pytest.mark.parametrize("kind", ["mds", "litdata", "ffcv"])
def test_mutated_shards_plan_and_read_to_a_sample_a_skip_or_one_line(tmp_path: Path, ledger, kind: str) -> None:
    """Random bytes over a shard's (a chunk's, the .beton's) header, record offsets, record size headers and
    payloads: planning ends in a plan or one line; then each planned sample reads as an image, or as a skip
    (a DecodeError naming it, what the build records), never another exception."""
    from cachebuild.errors import DecodeError

    src = _copy(kind, tmp_path / "src")
    victim = src if kind == "ffcv" else sorted(p for p in src.iterdir() if p.suffix in (".mds", ".bin"))[1]
    golden = victim.read_bytes()
    rng = random.Random(f"{SEED}-{kind}-shard")
    lost: list[str] = []
    outcomes = {"planned": 0, "refused": 0, "samples read": 0, "samples skipped": 0}
    for _ in range(60):
        data = bytearray(golden)
        n = struct.unpack_from("<I", golden, 0)[0] if kind != "ffcv" else 0
        head = 4 * (n + 2) if kind != "ffcv" else 24 + 4 * _FIELD + 10 * 64
        for _ in range(rng.choice((1, 3, 12))):
            at = rng.randrange(0, head) if rng.random() < 0.6 else rng.randrange(0, len(data))
            width = rng.choice((1, 2, 4))
            data[at : at + width] = bytes(rng.randrange(256) for _ in range(width))[: len(data) - at]
        victim.write_bytes(bytes(data))
        try:
            plans = bounded(lambda: plan_source(kind, src), 20, f"planning {kind}")
        except CacheBuildError as e:
            outcomes["refused"] += 1
            if "\n" in str(e):
                lost.append(f"several lines: {e}")
            continue
        except Exception as e:
            lost.append(f"planning: {type(e).__name__}: {e}")
            continue
        outcomes["planned"] += 1
        plan = plans[0]
        for i, key in enumerate(plan.keys):
            try:
                got = plan.reader(i, key)
                assert isinstance(got, bytes | np.ndarray)
                outcomes["samples read"] += 1
            except DecodeError:
                outcomes["samples skipped"] += 1
            except Exception as e:
                lost.append(f"reading {key}: {type(e).__name__}: {e}")
    ledger.add(FUZZED.format(what=f"{kind} shard bytes"), 60, 60 - min(60, len(lost)), min(60, len(lost)),
               "; ".join(lost[:2]), detail=f"{outcomes}")
    assert lost == [], lost[:3]
