"""The commands around a finished cache, attacked as a hostile or unlucky user would: ``push`` to a bucket that
is not there; ``info``/``verify``/``show``/``report``/``columns`` on a path that is not there; ``columns add``
with column files that say one thing twice, hold numbers no column dtype holds, or are not files at all;
``show --out`` and ``report --out`` aimed at a cache's own files, at links leaving the folder, at special files;
a report folder whose file list was edited to name other files.

Every trial checks the promise: one line naming the file and the fix, the documented exit code, and every
file the tool did not write unchanged (hashed before and after, links included).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cachebuild.storage.cache import open_cache, read_manifest
from tests.loaders_fixtures import make_cache
from tests.reliability.helpers import file_hashes, one_line_error, run_bounded

MISSING_BUCKET = "push/pull/ls/info of a bucket that does not exist: one line naming it"
MISSING_PATH = "a path that does not exist: one line saying so (not 'not a cache')"
COLUMNS_NO_TRACE = "columns add/rm on a path that is no cache: nothing made there (no .lock, no folders)"
COLUMN_VALUES = "column files: duplicate keys, numbers no dtype holds, special files: refused by name"
SHOW_TARGETS = "show --out/--layout on a cache's files, links, special files: refused, nothing replaced"
REPORT_LIST = "report: an edited file list, links and special files in --out: nothing outside touched"


def _tree(root: Path) -> dict[str, str]:
    return file_hashes(root)


# ---------------------------------------------------------------- push and friends: a missing bucket


def test_a_bucket_that_does_not_exist_is_one_line_naming_it(tmp_path: Path, s3, ledger) -> None:
    root, _, _ = make_cache(tmp_path / "c", n=20)
    bucket = "no-such-bucket-cb52"
    for command in (["push", root, f"s3://{bucket}/team/c", "--no-progress"],
                    ["pull", f"s3://{bucket}/team/c", tmp_path / "pulled", "--no-progress"],
                    ["ls", f"s3://{bucket}/team"], ["info", f"s3://{bucket}/team/c"],
                    ["verify", f"s3://{bucket}/team/c"]):
        with ledger.trial(MISSING_BUCKET, command[0]):
            code, out = run_bounded(*command)
            line = one_line_error(out)
            assert code == 1, (command, code, out)
            assert f"s3://{bucket}" in line and "bucket" in line and "does not exist" in line, line
            assert "another push" not in out and "push-in-progress" not in out, out
            assert not (tmp_path / "pulled").exists()


# ---------------------------------------------------------------- a path that is not there


@pytest.mark.parametrize("command", [["info", "{cache}"], ["verify", "{cache}"], ["verify", "--quick", "{cache}"],
                                     ["columns", "ls", "{cache}"], ["show", "{cache}", "--out", "{tmp}/s.png"],
                                     ["report", "{cache}", "--out", "{tmp}/r"]])
def test_a_missing_path_is_named_as_missing(tmp_path: Path, ledger, command: list[str]) -> None:
    missing = tmp_path / "no" / "such" / "cache"
    args = [a.replace("{cache}", str(missing)).replace("{tmp}", str(tmp_path)) for a in command]
    with ledger.trial(MISSING_PATH, " ".join(command[:2])):
        code, out = run_bounded(*args)
        line = one_line_error(out)
        assert code == 1 and str(missing) in line and "does not exist" in line, out
        assert "not a cachebuild cache" not in line, line
        assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing is made for a missing cache"


def test_columns_on_a_wrong_path_leave_nothing_behind(tmp_path: Path, ledger) -> None:
    values = tmp_path / "v.csv"
    values.write_text("a.jpg,1\n")
    plain = tmp_path / "photos"  # a user's folder, not a cache
    plain.mkdir()
    (plain / "a.jpg").write_bytes(b"x")
    before = _tree(tmp_path)
    for cache in (tmp_path / "no" / "such" / "cache", plain, plain / "a.jpg"):
        for command in (["columns", "add", cache, "soft", values], ["columns", "rm", cache, "soft"]):
            with ledger.trial(COLUMNS_NO_TRACE, f"{command[1]} {cache.name}"):
                code, out = run_bounded(*command)
                line = one_line_error(out)
                assert code == 1 and str(cache) in line, out
                assert _tree(tmp_path) == before, "a lock file or folder was made"
                assert sorted(p.name for p in tmp_path.iterdir()) == ["photos", "v.csv"]


# ---------------------------------------------------------------- column files


def _paths(cache: Path) -> list[str]:
    return open_cache(cache).paths()


@pytest.fixture
def small_cache(tmp_path: Path) -> Path:
    root, _, _ = make_cache(tmp_path / "c", n=6)
    return root


def _column_refused(cache: Path, file: Path, *words: str) -> None:
    before = _tree(cache)
    manifest = read_manifest(cache)
    code, out = run_bounded("columns", "add", cache, "col", file)
    line = one_line_error(out)
    assert code == 1 and str(file) in line, out
    for w in words:
        assert w in line, (w, line)
    assert read_manifest(cache) == manifest and _tree(cache) == before


def test_a_json_object_naming_a_path_twice_is_refused(small_cache: Path, tmp_path: Path, ledger) -> None:
    paths = _paths(small_cache)
    body = ", ".join(f"{json.dumps(p)}: {i}" for i, p in enumerate(paths))
    twice = tmp_path / "twice.json"
    twice.write_text("{" + body + f", {json.dumps(paths[2])}: 99" + "}")
    with ledger.trial(COLUMN_VALUES, "JSON key twice"):
        _column_refused(small_cache, twice, paths[2], "twice")


@pytest.mark.parametrize("value", ["9223372036854775808", "-9223372036854775809", "18446744073709551616",
                                   "1e39", "nan", "inf", "-Infinity"])
@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_numbers_no_column_dtype_holds_are_refused(small_cache: Path, tmp_path: Path, ledger, value: str,
                                                    suffix: str) -> None:
    """An integer outside int64 (it became float32 9.22e18), a float that float32 turns into infinity, NaN and
    infinities: refused, naming the file, the sample and the value."""
    paths = _paths(small_cache)
    file = tmp_path / f"col{suffix}"
    if suffix == ".csv":
        file.write_text("".join(f"{p},{value if i == 3 else i}\n" for i, p in enumerate(paths)))
    else:
        json_value = {"nan": "NaN", "inf": "Infinity"}.get(value, value)
        file.write_text("{" + ", ".join(f"{json.dumps(p)}: {json_value if i == 3 else i}"
                                        for i, p in enumerate(paths)) + "}")
    with ledger.trial(COLUMN_VALUES, f"{value} in {suffix}"):
        _column_refused(small_cache, file, paths[3])


def test_integers_at_the_edges_of_int64_are_kept_exactly(small_cache: Path, tmp_path: Path, ledger) -> None:
    paths = _paths(small_cache)
    edges = [2**63 - 1, -(2**63), 0, 2**53 + 1, -1, 7]
    file = tmp_path / "edges.json"
    file.write_text(json.dumps(dict(zip(paths, edges, strict=True))))
    with ledger.trial(COLUMN_VALUES, "int64 edges kept exactly"):
        code, out = run_bounded("columns", "add", small_cache, "big", file)
        assert code == 0, out
        col = open_cache(small_cache).column("big")
        assert col.dtype == np.int64 and col.tolist() == edges


@pytest.mark.parametrize("special", ["fifo", "directory", "dev-zero"])
def test_a_column_file_that_is_not_a_regular_file_is_refused_without_reading(small_cache: Path, tmp_path: Path,
                                                                              ledger, special: str) -> None:
    file = tmp_path / "col.npy"
    if special == "fifo":
        os.mkfifo(file)  # np.load of it waits for a writer forever
    elif special == "directory":
        file.mkdir()
    else:
        file.symlink_to("/dev/zero")
    with ledger.trial(COLUMN_VALUES, special):
        if special == "directory":  # the command line's own check: a usage error (exit 2) naming it
            before = _tree(small_cache)
            code, out = run_bounded("columns", "add", small_cache, "col", file)
            assert code == 2 and f"'{file}' is a directory" in out, out
            assert _tree(small_cache) == before
        else:
            _column_refused(small_cache, file, "not a regular file")


# ---------------------------------------------------------------- show: where the sheet goes


def test_show_never_replaces_what_it_did_not_write(small_cache: Path, tmp_path: Path, ledger) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "sheet.png").write_text("not a png of ours")
    link = tmp_path / "link.png"
    link.symlink_to(elsewhere / "sheet.png")
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    before = _tree(tmp_path)
    targets = {"the manifest": ["--out", small_cache / "manifest.json"],
               "a shard": ["--out", small_cache / "images-00000.npy"],
               "a new file inside the cache": ["--out", small_cache / "sheet.png"],
               "a file below the cache": ["--out", small_cache / "more" / "sheet.png"],
               "--layout on the manifest": ["--out", tmp_path / "ok.png", "--layout", small_cache / "manifest.json"],
               "a user's text file": ["--out", mine],
               "a link to a file elsewhere": ["--out", link],
               "a FIFO": ["--out", fifo],
               "a folder": ["--out", elsewhere]}
    for what, args in targets.items():
        with ledger.trial(SHOW_TARGETS, what):
            code, out = run_bounded("show", small_cache, *args, "--n", "4")
            if what == "a folder":  # the command line's own check: a usage error (exit 2) naming it
                assert code == 2 and f"'{elsewhere}' is a directory" in out, out
            else:
                one_line_error(out)
                assert code == 1, (what, out)
            assert _tree(tmp_path) == before, what
            assert not (tmp_path / "ok.png").exists()
    with ledger.trial(SHOW_TARGETS, "its own PNG and layout are replaced"):
        for _ in range(2):
            code, out = run_bounded("show", small_cache, "--out", tmp_path / "s.png", "--layout", tmp_path / "s.json",
                             "--n", "4")
            assert code == 0, out
        assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(json.loads((tmp_path / "s.json").read_text())["tiles"]) == 4


# ---------------------------------------------------------------- report: its own files only


def _report(cache: Path, out: Path) -> tuple[int, str]:
    return run_bounded("report", cache, "--out", out, "--stats-sample", "4")


def test_report_deletes_only_its_own_files_and_follows_no_link(small_cache: Path, tmp_path: Path, ledger) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "img").mkdir(parents=True)
    for name in ("precious.txt", "index.html", "img/counts.png", "classes-001.html"):
        (elsewhere / name).write_text(f"the user's {name}")
    r = tmp_path / "r"
    assert _report(small_cache, r)[0] == 0
    listing = r / ".cachebuild-report"
    (r / "lnk").symlink_to(elsewhere)
    (r / "mine.txt").write_text("the user's own notes")
    with open(listing, "a") as f:  # a list edited to name what no report writes
        f.write("lnk/precious.txt\nlnk/index.html\nlnk/img/counts.png\nmine.txt\n../elsewhere/precious.txt\n"
                f"{elsewhere / 'precious.txt'}\nlnk\n")
    before_elsewhere = _tree(elsewhere)
    with ledger.trial(REPORT_LIST, "a file list naming files through a link"):
        code, out = _report(small_cache, r)
        assert code == 0, out
        assert _tree(elsewhere) == before_elsewhere
        assert (r / "mine.txt").read_text() == "the user's own notes" and (r / "lnk").is_symlink()
        assert (r / "index.html").is_file() and not (r / "index.html").is_symlink()


@pytest.mark.parametrize("trap", ["img is a link out", "index.html is a link out", "file list is a link out",
                                  "file list is a FIFO", "a user's index.html", "file list is huge"])
def test_report_follows_no_link_and_waits_on_no_special_file(small_cache: Path, tmp_path: Path, ledger,
                                                              trap: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("the user's")
    (elsewhere / "counts.png").write_text("the user's png")
    r = tmp_path / "r"
    assert _report(small_cache, r)[0] == 0
    listing = r / ".cachebuild-report"
    if trap == "img is a link out":
        for p in (r / "img").iterdir():
            p.unlink()
        (r / "img").rmdir()
        (r / "img").symlink_to(elsewhere)
    elif trap == "index.html is a link out":
        (r / "index.html").unlink()
        (r / "index.html").symlink_to(elsewhere / "precious.txt")
    elif trap == "file list is a link out":
        listing.unlink()
        listing.symlink_to(elsewhere / "precious.txt")
    elif trap == "file list is a FIFO":
        listing.unlink()
        os.mkfifo(listing)
    elif trap == "a user's index.html":
        lines = [n for n in listing.read_text().splitlines() if n != "index.html"]
        listing.write_text("".join(f"{n}\n" for n in lines))
        (r / "index.html").write_text("the user's own page")
    else:
        with open(listing, "a") as f:
            f.truncate(64 << 20)  # sparse: reading it whole would be 64 MB of NULs
    before = _tree(tmp_path)
    with ledger.trial(REPORT_LIST, trap):
        code, out = _report(small_cache, r)
        line = one_line_error(out)
        assert code == 1 and str(r) in line, out
        assert _tree(tmp_path) == before, "a file was changed or deleted"


def test_report_out_inside_a_cache_is_refused(small_cache: Path, tmp_path: Path, ledger) -> None:
    before = _tree(small_cache)
    with ledger.trial(REPORT_LIST, "--out inside the cache"):
        code, out = _report(small_cache, small_cache / "report")
        line = one_line_error(out)
        assert code == 1 and "cache" in line, out
        assert _tree(small_cache) == before


# ---------------------------------------------------------------- damaged zarr metadata

ZARR_META = "damaged zarr metadata: named once, not every chunk failing"


def _zarr_damage(meta: dict, text: str, how: str) -> str:
    codec = next(c for c in meta["codecs"] if c["name"] != "bytes")
    edits = {
        "cut short": lambda: text[: len(text) // 2],
        "a JSON list": lambda: "[]",
        "unknown codec": lambda: json.dumps({**meta, "codecs": [meta["codecs"][0], {**codec, "name": "zstf"}]}),
        "codec setting of another type": lambda: json.dumps(
            {**meta, "codecs": [meta["codecs"][0], {**codec, "configuration": {**codec["configuration"],
                                                                               "level": "x"}}]}),
        "fill value not a number": lambda: json.dumps({**meta, "fill_value": "z"}),
        "bytes codec gone": lambda: json.dumps({**meta, "codecs": [codec]}),
        "checksum flag flipped": lambda: json.dumps(
            {**meta, "codecs": [meta["codecs"][0], {**codec, "configuration": {
                **codec["configuration"], "checksum": not codec["configuration"]["checksum"]}}]}),
    }
    return edits[how]()


@pytest.mark.parametrize("how", ["cut short", "a JSON list", "unknown codec", "codec setting of another type",
                                 "fill value not a number", "bytes codec gone", "checksum flag flipped"])
def test_damaged_zarr_metadata_is_named_once(tmp_path: Path, ledger, how: str) -> None:
    root, _, _ = make_cache(tmp_path / "c", n=64, storage="zarr", shard_size=16, h=8, w=8, compression="zstd")
    meta_file = root / "images.zarr" / "zarr.json"
    text = meta_file.read_text()
    meta = json.loads(text)
    assert meta["codecs"][0]["name"] == "bytes" and len(meta["codecs"]) == 2
    meta_file.write_text(_zarr_damage(meta, text, how))
    with ledger.trial(ZARR_META, how):
        code, out = run_bounded("verify", root)
        assert code == 1 and "Traceback" not in out, out
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) == 1 and "images.zarr/zarr.json" in lines[0], out
        assert "chunk" not in lines[0] or "no chunk" in lines[0], out  # the metadata, not a chunk, is named
        assert "rebuild or re-fetch" in lines[0], out
        code, out = run_bounded("info", root)
        assert "Traceback" not in out and (code == 0 or "images.zarr/zarr.json" in one_line_error(out)), out


# ---------------------------------------------------------------- replaced versions left by a build

REPLACED = "a rebuild that no reader holds leaves no *.replaced-* folder"


@pytest.mark.parametrize("storage", ["zarr", "npy"])
def test_an_update_leaves_no_replaced_folder_when_no_reader_holds_it(photo_tree: Path, tmp_path: Path, ledger,
                                                                     storage: str) -> None:
    """``--update --jobs 2`` of a zarr cache copies the old samples in worker processes (each keeps a reader of
    the old cache, with its shared lock): once the command exits, nothing holds the replaced cache, so nothing
    of it may stay on disk. The same for a source copied with ``cp -r`` (every file new by its mtime)."""
    import shutil

    from tests.reliability.helpers import cli

    src = tmp_path / "src"
    shutil.copytree(photo_tree, src)
    for p in src.rglob("*"):
        os.utime(p, (1.6e9, 1.6e9))  # long before the build: an update may trust their stats
    out = tmp_path / "c"
    args = ["folder", str(src), "--size", "16", "--out", str(out), "--format", storage, "--jobs", "2",
            "--no-progress", "-q"]
    assert cli(*args).returncode == 0
    next(src.rglob("*.JPEG")).touch()  # one file newer: the update decodes it and copies the others
    with ledger.trial(REPLACED, f"{storage}: --update of one changed file"):
        r = cli(*args, "--update")
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in out.iterdir()) == ["train", "train.lock"], sorted(os.listdir(out))
        assert open_cache(out / "train").verify() == []


def test_a_columns_folder_that_links_out_is_never_written_or_swept(small_cache: Path, tmp_path: Path,
                                                                   ledger) -> None:
    """``columns/`` replaced by a link to another folder: adding or removing a column must neither write there
    nor delete what is there (files named like column files included)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "soft-0123456789ab.npy").write_bytes(b"the user's")
    (elsewhere / "held-1-0123abcd.json").write_text("the user's")
    values = tmp_path / "v.npy"
    np.save(values, np.arange(6, dtype=np.int64))
    (small_cache / "columns").symlink_to(elsewhere)
    before = {p: _tree(p) for p in (elsewhere, small_cache)}  # (the writer lock beside the cache is the tool's)
    manifest = read_manifest(small_cache)
    for command in (["columns", "add", small_cache, "col", values], ["columns", "rm", small_cache, "soft"]):
        with ledger.trial(COLUMN_VALUES, f"columns/ a link out: {command[1]}"):
            code, out = run_bounded(*command)
            line = one_line_error(out)
            assert code == 1 and str(small_cache) in line, out
            assert {p: _tree(p) for p in before} == before and read_manifest(small_cache) == manifest
