"""Format version 4: every file checksum is xxh3-128, named by the manifest; caches of versions 2 and 3 (sha256),
as the previous release wrote them (``legacy/``), still open, verify, find damage, take columns and travel."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheCorruptError, UnsupportedFormatError
from cachebuild.format.manifest import SHA256, XXH3_128, Manifest, manifest_bytes, parse_manifest
from cachebuild.storage.cache import open_cache, read_manifest, write_cache
from cachebuild.storage.columns import add_column, remove_column
from tests.legacy_caches import LEGACY, as_sha256_cache, legacy_copy, legacy_images, seal
from tests.manifest_edits import load_unsealed

KINDS = ("npy", "jpeg", "zarr")


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _flip(path: Path, at: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _v4(folder: Path, storage: str) -> Path:
    """The legacy caches' samples, labels and paths, written by this release."""
    write_cache(folder, legacy_images(), np.arange(10) % 3, ["a", "b", "c"], storage=storage, shard_size=4,
                paths=[f"img-{i}.png" for i in range(10)], dataset="legacy")
    return folder


@pytest.mark.parametrize("storage", KINDS)
def test_a_v4_cache_names_xxh3_and_every_checksum_is_one(tmp_path, storage):
    c = _v4(tmp_path / "c", storage)
    raw = json.loads((c / "manifest.json").read_text())
    assert raw["format_version"] == 4 and raw["digest_algorithm"] == "xxh3-128"
    assert "sha256" not in json.dumps({k: v for k, v in raw.items() if k not in ("source", "build", "checksum")})
    for s in raw["shards"]:
        if storage != "zarr":  # npy, jpeg: of the whole file
            assert s["digest"] == xxhash.xxh3_128_hexdigest((c / s["file"]).read_bytes())
    assert raw["arrays"]["paths"]["digest"] == xxhash.xxh3_128_hexdigest((c / "paths.json").read_bytes())
    assert raw["arrays"]["labels"]["digest"] == xxhash.xxh3_128_hexdigest(np.load(c / "labels.npy").tobytes())
    table = (c / "files.json").read_bytes()
    assert raw["files"]["digest"] == xxhash.xxh3_128_hexdigest(table)
    doc = json.loads(table)
    assert doc["digest"] == "xxh3-128"
    assert {n: d for n, _, d in doc["files"]} == {n: xxhash.xxh3_128_hexdigest((c / n).read_bytes())
                                                  for n, _, _ in doc["files"]}
    # the seal stays sha256 (FORMAT.md: one replace and one hash in any language)
    seal_hex = raw["checksum"]
    assert hashlib.sha256((c / "manifest.json").read_bytes().replace(seal_hex.encode(), b"0" * 64)).hexdigest() \
        == seal_hex
    reader = open_cache(c)
    assert reader.manifest.digest == XXH3_128 and reader.verify() == []
    assert "(format cachebuild v4, xxh3-128 checksums)" in _cli("info", c).output
    assert np.array_equal(reader.gather(np.arange(10)), legacy_images()) or storage == "jpeg"


@pytest.mark.parametrize("storage,victim", [("npy", "images-00001.npy"), ("jpeg", "images-00001.jpegs"),
                                            ("zarr", "images.zarr/c/1/0/0/0"), ("npy", "labels.npy"),
                                            ("npy", "paths.json")])
def test_a_flipped_byte_in_a_v4_cache_is_named_by_verify(tmp_path, storage, victim):
    c = _v4(tmp_path / "c", storage)
    _flip(c / victim, -3)
    problems = open_cache(c).verify()
    assert problems and all(victim.split("/")[0] in p for p in problems), problems
    assert _cli("verify", c).exit_code == 1


@pytest.mark.parametrize("name", ["v2-npy", "v2-jpeg", "v2-zarr", "v3-npy-columns"])
def test_a_cache_the_previous_release_wrote_reads_verifies_and_is_reserialised_byte_for_byte(tmp_path, name):
    c = legacy_copy(name, tmp_path / name)
    raw = (c / "manifest.json").read_bytes()
    m = parse_manifest(raw, name)
    assert m.format_version == int(name[1]) and m.digest == SHA256 and m.digest_algorithm == "sha256"
    assert manifest_bytes(m) == raw  # the same fields, keys and order: nothing of version 4 leaks into it
    reader = open_cache(c)
    assert reader.verify() == [] and _cli("verify", c).exit_code == 0
    assert f"(format cachebuild v{name[1]}, sha256 checksums)" in _cli("info", c).output
    if name != "v2-jpeg":
        assert np.array_equal(reader.gather(np.arange(10)), legacy_images())
    if name.startswith("v3"):
        np.testing.assert_array_equal(reader.column("soft"), np.linspace(0, 1, 30, dtype=np.float32).reshape(10, 3))


@pytest.mark.parametrize("name,victim", [("v2-npy", "images-00002.npy"), ("v2-jpeg", "images-00000.jpegs"),
                                         ("v2-zarr", "images.zarr/c/2/0/0/0"), ("v2-npy", "sizes.npy"),
                                         ("v3-npy-columns", "columns/soft-1cd23cf30086.npy")])
def test_a_flipped_byte_in_a_sha256_cache_is_still_named(tmp_path, name, victim):
    c = legacy_copy(name, tmp_path / name)
    _flip(c / victim, -2)
    problems = open_cache(c).verify()
    assert problems and all(victim.split("/")[0] in p for p in problems), problems


@pytest.mark.parametrize("storage", KINDS)
def test_the_hand_made_sha256_cache_of_the_tests_is_what_the_previous_release_wrote(tmp_path, storage):
    """``as_sha256_cache`` (what the update tests start from) against the real thing: same checksums, same
    file table bytes."""
    c = _v4(tmp_path / "c", storage)
    as_sha256_cache(c, 2)
    old = LEGACY / f"v2-{storage}"
    mine, theirs = (json.loads((p / "manifest.json").read_text()) for p in (c, old))
    for k in ("shards", "arrays", "files", "format_version", "build", "source"):
        assert mine[k] == theirs[k], k
    assert (c / "files.json").read_bytes() == (old / "files.json").read_bytes()
    assert open_cache(c).verify() == []


def test_columns_keep_a_caches_algorithm_and_version(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10) * 3)
    old = legacy_copy("v2-npy", tmp_path / "old")
    m = add_column(old, "a", tmp_path / "a.npy")
    data = (old / m.columns["a"].file).read_bytes()
    assert m.format_version == 3 and m.columns["a"].digest == hashlib.sha256(data).hexdigest()
    assert json.loads((old / "manifest.json").read_text())["columns"]["a"]["sha256"] == m.columns["a"].digest
    assert open_cache(old).verify() == []
    assert remove_column(old, "a").format_version == 2
    assert (old / "manifest.json").read_bytes() == (LEGACY / "v2-npy" / "manifest.json").read_bytes()  # as it was

    new = _v4(tmp_path / "new", "npy")
    m = add_column(new, "a", tmp_path / "a.npy")
    data = (new / m.columns["a"].file).read_bytes()
    assert m.format_version == 4 and m.columns["a"].digest == xxhash.xxh3_128_hexdigest(data)
    assert m.columns["a"].file.endswith(f"-{m.columns['a'].digest[:12]}.npy")
    _flip(new / m.columns["a"].file)
    assert open_cache(new).verify() == [f"{m.columns['a'].file}: checksum mismatch (column)"]
    assert remove_column(new, "a").format_version == 4


def test_the_manifest_must_name_an_algorithm_its_version_has(tmp_path):
    c = _v4(tmp_path / "c", "npy")
    d = load_unsealed(c / "manifest.json")
    with pytest.raises(UnsupportedFormatError, match="checksums are 'blake3', which this cachebuild does not know"):
        Manifest.from_dict({**d, "digest_algorithm": "blake3"})  # a newer release's: unsupported, not damaged
    with pytest.raises(CacheCorruptError, match="digest_algorithm"):
        Manifest.from_dict({k: v for k, v in d.items() if k != "digest_algorithm"})
    old = load_unsealed(LEGACY / "v2-npy" / "manifest.json")
    with pytest.raises(CacheCorruptError, match="names no digest algorithm"):  # an old reader would take it for sha256
        Manifest.from_dict({**old, "digest_algorithm": "xxh3-128"})
    with pytest.raises(CacheCorruptError, match="missing the field 'sha256'"):  # a version 2 entry keyed as in 4
        Manifest.from_dict({**old, "shards": [{"digest" if k == "sha256" else k: v for k, v in s.items()}
                                              for s in old["shards"]]})
    (c / "manifest.json").write_bytes(seal({**d, "format_version": 3}))  # v4 bytes under an older version
    with pytest.raises(CacheCorruptError):
        read_manifest(c)


def test_pull_and_push_check_each_file_by_the_caches_own_algorithm(tmp_path, s3):
    src = legacy_copy("v3-npy-columns", tmp_path / "src")
    url = s3.url("team/legacy")
    assert _cli("push", src, url, "--no-progress").exit_code == 0
    victim = "images-00001.npy"
    good = s3.fs.cat(s3.url(f"team/legacy/{victim}"))
    s3.fs.pipe(s3.url(f"team/legacy/{victim}"), good[:-1] + bytes([good[-1] ^ 1]))
    r = _cli("pull", url, tmp_path / "dest", "--no-progress")
    assert r.exit_code == 1 and victim in r.output and "sha256" in r.output and not (tmp_path / "dest").exists()
    s3.fs.pipe(s3.url(f"team/legacy/{victim}"), good)
    r = _cli("pull", url, tmp_path / "dest", "--no-progress")
    assert r.exit_code == 0, r.output
    for f in src.rglob("*"):  # byte for byte, the manifest too: a pull never rewrites an old cache
        if f.is_file():
            assert (tmp_path / "dest" / f.relative_to(src)).read_bytes() == f.read_bytes(), f
    assert open_cache(tmp_path / "dest").verify() == []
    # a damaged local file of a sha256 cache is not spread
    shutil.rmtree(tmp_path / "dest" / "columns")
    again = legacy_copy("v2-zarr", tmp_path / "z")
    _flip(again / "images.zarr" / "c" / "0" / "0" / "0" / "0")
    r = _cli("push", again, s3.url("team/z"), "--no-progress")
    assert r.exit_code == 1 and "images.zarr/c/0/0/0/0" in r.output and "not uploaded" in r.output
