"""Columns (format version 3, or 4): added and removed without touching a pixel, atomically, refused clearly when
wrong, carried by verify / pull / push / ls, read at a URL, and refused cleanly by a reader of version 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.errors import CacheCorruptError, UnsupportedFormatError
from cachebuild.format import manifest as spec
from cachebuild.storage import columns as cols
from cachebuild.storage.cache import open_cache, read_manifest
from cachebuild.storage.columns import add_column, remove_column
from loaders.dataset import CachedImageDataset, DatasetOptions
from tests.legacy_caches import as_sha256_cache
from tests.loaders_fixtures import make_cache
from tests.trees import tree_bytes


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return make_cache(tmp_path / "c", n=20, shard_size=8)[0]


def _pixels_and_arrays(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(folder).items() if not k.startswith("columns/") and k != "manifest.json"}


@pytest.mark.parametrize("old", [False, True])
def test_add_ls_rm_never_touch_pixels_and_version_follows_the_columns(cache: Path, tmp_path: Path, old: bool) -> None:
    """A sha256 cache (format 2, as the previous release wrote it) is 3 with columns and 2 without; a version 4
    cache stays 4."""
    if old:
        as_sha256_cache(cache, 2)
    plain_version, columns_version = (2, 3) if old else (4, 4)
    before = _pixels_and_arrays(cache)
    plain = (cache / "manifest.json").read_bytes()
    assert b'"columns"' not in plain and read_manifest(cache).format_version == plain_version
    soft = np.random.default_rng(0).random((20, 5)).astype(np.float32)
    np.save(tmp_path / "soft.npy", soft)
    res = _cli("columns", "add", cache, "soft", tmp_path / "soft.npy")
    assert res.exit_code == 0, res.output
    m = read_manifest(cache)
    assert m.format_version == columns_version and m.columns["soft"].shape == (20, 5)
    np.testing.assert_array_equal(open_cache(cache).column("soft"), soft)
    assert _pixels_and_arrays(cache) == before  # not one byte of pixels, labels, paths or the file table
    ls = _cli("columns", "ls", cache, "--json")
    assert json.loads(ls.output)["soft"]["dtype"] == "float32"
    assert _cli("verify", cache).exit_code == 0 and _cli("verify", "--quick", cache).exit_code == 0
    assert "soft" in _cli("ls", cache.parent).output  # the COLUMNS column of `cachebuild ls`
    assert _cli("columns", "rm", cache, "soft").exit_code == 0
    m = read_manifest(cache)
    assert not m.columns and m.format_version == plain_version and not (cache / "columns").exists()  # no reader
    assert (cache / "manifest.json").read_bytes() == plain  # held it: the manifest it had, byte for byte


def test_csv_and_json_keyed_by_source_path_land_in_sample_order(cache: Path, tmp_path: Path) -> None:
    paths = open_cache(cache).paths()
    order = list(reversed(range(20)))  # written out of order: the cache's order is by path
    (tmp_path / "re.csv").write_text("path,label\n" + "".join(f"{paths[i]},{i % 5}\n" for i in order))
    (tmp_path / "re.json").write_text(json.dumps({paths[i]: [i, i / 2] for i in order}))
    add_column(cache, "relabel", tmp_path / "re.csv")
    add_column(cache, "pair", tmp_path / "re.json")
    r = open_cache(cache)
    np.testing.assert_array_equal(r.column("relabel"), np.arange(20) % 5)
    assert r.column("relabel").dtype == np.int64 and r.column("pair").dtype == np.float32
    np.testing.assert_allclose(r.column("pair"), np.stack([np.arange(20), np.arange(20) / 2], 1))


@pytest.mark.parametrize("case, needle", [
    ("rows", "has 19 rows, the cache"),
    ("missing", "has no value for 1 of the cache's 20 samples"),
    ("builtin", "is a built-in array"),
    ("dtype", "a column is a numeric array"),
    ("suffix", "a column comes from an .npy"),
    ("twice", "already has a column 'x'; pass --replace"),
])
def test_bad_columns_are_refused_naming_the_file_and_the_fix(cache: Path, tmp_path: Path, case: str,
                                                             needle: str) -> None:
    name, file = "x", tmp_path / "x.npy"
    np.save(file, np.zeros(20, dtype=np.int64))
    if case == "rows":
        np.save(file, np.zeros(19, dtype=np.int64))
    elif case == "missing":
        file = tmp_path / "x.csv"
        paths = open_cache(cache).paths()
        file.write_text("".join(f"{p},1\n" for p in paths[1:]))
    elif case == "builtin":
        name = "labels"
    elif case == "dtype":
        np.save(file, np.zeros(20, dtype=np.complex64))
    elif case == "suffix":
        file = tmp_path / "x.txt"
        file.write_text("1\n")
    elif case == "twice":
        add_column(cache, "x", file)
    before = tree_bytes(cache)
    res = _cli("columns", "add", cache, name, file)
    assert res.exit_code == 1 and needle in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert tree_bytes(cache) == before  # nothing written


def test_a_crash_before_the_manifest_swap_leaves_the_old_cache_valid(cache: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    np.save(tmp_path / "a.npy", np.arange(20))
    old = (cache / "manifest.json").read_bytes()

    def killed(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt  # as if the process died between the column file and the manifest

    monkeypatch.setattr(cols, "manifest_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        add_column(cache, "a", tmp_path / "a.npy")
    monkeypatch.undo()
    assert (cache / "manifest.json").read_bytes() == old
    assert open_cache(cache).verify() == [] and _cli("verify", "--quick", cache).exit_code == 0
    add_column(cache, "a", tmp_path / "a.npy")  # the rerun completes
    assert read_manifest(cache).columns["a"].shape == (20,)


def test_a_reader_opened_before_a_change_keeps_serving_what_it_opened(cache: Path, tmp_path: Path) -> None:
    import pickle

    np.save(tmp_path / "v1.npy", np.arange(20))
    np.save(tmp_path / "v2.npy", np.arange(20) + 100)
    add_column(cache, "c", tmp_path / "v1.npy")
    ds = CachedImageDataset(cache, DatasetOptions(columns=["c"]))
    add_column(cache, "c", tmp_path / "v2.npy", replace=True)
    remove_column(cache, "c")
    copy = pickle.loads(pickle.dumps(ds))  # a DataLoader worker started after the change maps it again
    for d in (ds, copy):
        assert d[3][-1] == 3 and d.manifest.columns["c"].shape == (20,)
    assert len(list((cache / "columns").glob("c-*.npy"))) >= 1  # kept while a reader holds the old manifest
    del ds, copy, d
    import gc

    gc.collect()
    add_column(cache, "d", tmp_path / "v2.npy")  # the next change sweeps what no reader holds any more
    assert [p.name.split("-")[0] for p in (cache / "columns").glob("*.npy")] == ["d"]
    assert not list((cache / "columns").glob("held-*"))


def test_a_force_rebuild_may_replace_a_cache_with_columns(cache: Path, tmp_path: Path) -> None:
    from cachebuild.builder.destination import check_replaceable

    np.save(tmp_path / "a.npy", np.arange(20))
    add_column(cache, "a", tmp_path / "a.npy")
    check_replaceable(cache, None)  # the columns/ folder is provably ours
    (cache / "columns" / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="files its manifest does not name: columns"):
        check_replaceable(cache, None)


def test_a_reader_of_version_2_refuses_a_cache_with_columns_by_name(cache: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    np.save(tmp_path / "a.npy", np.arange(20))
    as_sha256_cache(cache, 2)  # a column makes it 3 (a version 4 cache stays 4, refused by version all the same)
    add_column(cache, "a", tmp_path / "a.npy")
    monkeypatch.setattr(spec, "READ_VERSIONS", (1, 2))  # the release before columns
    with pytest.raises(UnsupportedFormatError, match=r"version 3 is not supported: this cachebuild reads "
                                                     r"versions 1, 2"):
        read_manifest(cache)
    d = json.loads((cache / "manifest.json").read_text())
    d.pop("checksum")
    d["format_version"] = 2  # columns under a version that has none: damaged, said so
    monkeypatch.undo()
    with pytest.raises(CacheCorruptError, match="needs format version 3"):
        spec.Manifest.from_dict(d)


def test_columns_travel_with_push_and_pull_and_read_at_a_url(cache: Path, tmp_path: Path, s3,
                                                             http_server) -> None:
    np.save(tmp_path / "a.npy", np.arange(20) * 7)
    add_column(cache, "a", tmp_path / "a.npy")
    url = s3.url("team/c")
    assert _cli("push", cache, url).exit_code == 0
    ds = CachedImageDataset(url, DatasetOptions(columns=["a"]))
    assert int(ds[[2, 5]][-1][1]) == 35
    res = _cli("columns", "add", url, "b", tmp_path / "a.npy")
    assert res.exit_code == 1 and "local cache only" in res.output
    assert _cli("pull", url, tmp_path / "copy").exit_code == 0
    assert tree_bytes(tmp_path / "copy") == tree_bytes(cache)
    # a column added at the source after the copy: pull sees another cache, not "up to date"
    add_column(cache, "b", tmp_path / "a.npy")
    assert _cli("push", cache, url, "--force").exit_code == 0
    res = _cli("pull", url, tmp_path / "copy")
    assert res.exit_code == 1 and "--force" in res.output
    assert _cli("pull", url, tmp_path / "copy", "--force").exit_code == 0
    assert set(read_manifest(tmp_path / "copy").columns) == {"a", "b"}
    old = read_manifest(cache).columns["a"].file
    remove_column(cache, "a")
    assert _cli("push", cache, url, "--force").exit_code == 0
    assert not s3.fs.exists(s3.url(f"team/c/{old}"))  # the replaced cache's column went with it
    assert s3.fs.exists(s3.url(f"team/c/{read_manifest(cache).columns['b'].file}"))
    add_column(cache, "a", tmp_path / "a.npy")
    server = http_server(cache)
    assert _cli("columns", "ls", server.url).output.startswith("a ")
    (cache / read_manifest(cache).columns["a"].file).write_bytes(b"\x93NUMPY damaged")
    res = _cli("verify", cache)
    assert res.exit_code == 1 and "checksum mismatch (column)" in res.output


def test_a_replaced_cache_is_kept_while_a_reader_holds_its_manifest_from_before_a_column(cache: Path,
                                                                                      tmp_path: Path) -> None:
    """The reader's lock is on the manifest it opened; `columns add` swaps that file, so the sweep of a
    --force rebuild must also look at the old manifest kept as columns/held-*.json."""
    from cachebuild.storage.locations import set_aside, sweep_replaced

    np.save(tmp_path / "a.npy", np.arange(20))
    ds = CachedImageDataset(cache)
    add_column(cache, "a", tmp_path / "a.npy")
    aside = set_aside(cache)
    assert sweep_replaced(cache) == [aside] and aside.is_dir()
    assert ds[4][1] == int(np.load(aside / "labels.npy")[4])
    del ds
    import gc

    gc.collect()
    assert sweep_replaced(cache) == [] and not aside.exists()


def test_the_format_docs_column_snippet_reads_a_column_without_cachebuild(cache: Path, tmp_path: Path) -> None:
    import re

    from tests.repo import REPO

    section = (REPO / "docs" / "FORMAT.md").read_text(encoding="utf-8").split("\n## Columns", 1)[1].split("\n## ")[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    soft = np.random.default_rng(2).random((20, 3)).astype(np.float32)
    np.save(tmp_path / "soft.npy", soft)
    add_column(cache, "soft", tmp_path / "soft.npy")
    scope = {"cache": str(cache)}
    exec(compile(snippet, "FORMAT.md:columns", "exec"), scope)
    np.testing.assert_array_equal(scope["soft"], soft)


def test_a_version_1_cache_is_refused_with_the_fix(cache: Path, tmp_path: Path) -> None:
    """Version 3 is version 2 plus columns: a version 1 cache (another npy checksum meaning) is rebuilt first."""
    as_sha256_cache(cache, 1)
    np.save(tmp_path / "a.npy", np.arange(20))
    res = _cli("columns", "add", cache, "a", tmp_path / "a.npy")
    assert res.exit_code == 1 and "format version 1 cache; rebuild it with this release" in res.output
    assert not (cache / "columns").exists()
