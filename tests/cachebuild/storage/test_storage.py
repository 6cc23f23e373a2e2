"""The storage seam: the registry takes a new kind as one class + one line, and the reliability rules
every backend keeps (names inside the cache, no fill values for missing chunks, replaced caches kept
for their readers)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from torch.utils.data import DataLoader

from cachebuild.errors import CacheCorruptError, CacheExistsError, UnsupportedFormatError
from cachebuild.format.manifest import BUILD
from cachebuild.storage import Backend, ImageStore, get_backend, register_backend
from cachebuild.storage.cache import open_cache, write_cache
from cachebuild.storage.kinds.base import one_file_per_block
from cachebuild.storage.kinds.npy import RowFiles, Segment
from cachebuild.storage.locations import replaced_folders
from loaders.dataset import CachedImageDataset, collate_batch
from tests.loaders_fixtures import decode_index, make_cache, make_images
from tests.manifest_edits import load_unsealed
from tests.repo import REPO

# ---------------------------------------------------------------- a new kind: one class, one registry line


class _RawImages(ImageStore):
    def __init__(self, location, manifest):
        self.manifest = manifest
        self.rows = RowFiles(location, [Segment(s.file, s.start, s.count, 0) for s in manifest.shards], manifest.shape)
        self.chunk_size = 4

    def gather(self, idx, out):
        self.rows.gather(idx, out)

    def verify(self):
        bad = []
        for s in self.manifest.shards:
            buf = np.empty((s.count, *self.manifest.shape), np.uint8)
            self.rows.gather(np.arange(s.start, s.start + s.count), buf)
            if self.manifest.digest.of(buf) != s.digest:  # the manifest's algorithm (format.manifest)
                bad.append(s.file)
        return bad


class _RawSink:
    """One block's rows appended to its file; the digest (the build's algorithm) covers the pixels (= the file)."""

    stored_bytes = None

    def __init__(self, path, sample_shape):
        self.path, self.file, self.digest = path, path.open("wb"), BUILD.new()
        self.slot = np.empty(sample_shape, np.uint8)

    def next_slot(self):
        return self.slot

    def commit(self):
        self.file.write(self.slot.tobytes())
        self.digest.update(self.slot)

    def abort(self):
        self.file.close()
        self.path.unlink()

    def close(self):
        self.file.close()
        return self.path.name, self.digest.hexdigest()


class _RawBackend(Backend):
    """Headerless ``.raw`` files of C-order rows: the smallest backend there is."""

    name = "raw-test"
    staging_names = r"part-\d+\.raw"

    def build_params(self, opts):
        return {"chunk_size": None, "compression": "none"}

    def sink(self, staging, block, start, planned, sample_shape, params):
        return _RawSink(staging / f"part-{block}.raw", sample_shape)

    def finish(self, staging, ordered, count, planned):
        return one_file_per_block(staging, ordered)

    def open(self, location, manifest, *, block_cache=None):
        return _RawImages(location, manifest)


def test_a_new_storage_kind_is_one_class_and_one_registry_line(tmp_path):
    register_backend("raw-test", _RawBackend())
    images = make_images(23, 8, 6)
    write_cache(tmp_path / "c", images, np.arange(23) % 3, ["a", "b", "c"], storage="raw-test", shard_size=5)
    assert sorted(p.name for p in (tmp_path / "c").glob("*.raw")) == [f"part-{i}.raw" for i in range(5)]
    ds = CachedImageDataset(tmp_path / "c")
    idx = np.random.default_rng(0).permutation(23)
    assert np.array_equal(ds.gather(idx), images[idx]) and ds.chunk_size == 4
    assert open_cache(tmp_path / "c").verify() == []
    dl = DataLoader(ds, batch_size=6, num_workers=2, collate_fn=collate_batch)
    assert np.array_equal(np.concatenate([x.numpy() for x, _ in dl]), images)


def test_a_kind_names_its_own_staging_files_and_destination_asks_it(tmp_path):
    """A staging folder holding a kind's files is the build's own only once that kind is registered: the
    destination rules know no kind's file names."""
    from cachebuild.builder.destination import is_own_staging

    staging = tmp_path / "out.partial"
    staging.mkdir()
    (staging / "part-3.raw").write_bytes(b"")
    (staging / "labels.npy").write_bytes(b"")
    register_backend("raw-names-test", "tests.cachebuild.storage.test_storage:_RawNamesBackend")
    assert is_own_staging(staging)
    (staging / "part-3.rawx").write_bytes(b"")  # not a name any kind writes: not provably ours
    assert not is_own_staging(staging)


class _RawNamesBackend(_RawBackend):
    name = "raw-names-test"
    staging_names = r"part-\d+\.raw"


def test_write_cache_writes_the_files_a_build_writes(tmp_path):
    """One write path: write_cache goes through the kind's sinks, so an npy cache of in-memory images has
    one shard per block, each hashed whole, as a build's."""
    images = make_images(10, 8, 6)
    m = write_cache(tmp_path / "c", images, np.arange(10) % 2, ["a", "b"], shard_size=4)
    assert [(s.file, s.start, s.count) for s in m.shards] == [
        ("images-00000.npy", 0, 4), ("images-00001.npy", 4, 4), ("images-00002.npy", 8, 2)]
    for s in m.shards:
        assert xxhash.xxh3_128_hexdigest((tmp_path / "c" / s.file).read_bytes()) == s.digest
        assert np.array_equal(np.load(tmp_path / "c" / s.file), images[s.start : s.start + s.count])


def test_a_block_record_reads_back_as_written():
    from cachebuild.storage.kinds.base import BlockFailure, BlockRecord

    rec = BlockRecord(2, 8, 4, 3, "images-00002.npy", "0" * 64, (8, 9, 11), ((5, 6), (7, 8), (9, 10)),
                      ((0, 0, 8, 8),) * 3, (BlockFailure(10, {"bytes": "bad_\\xff"}, "truncated"),), 123)
    assert BlockRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec
    assert "stored_bytes" not in BlockRecord(0, 0, 1, 1, "f", "0" * 64).to_json()  # raw kinds: as before


def test_an_unknown_storage_kind_is_a_named_error(tmp_path):
    with pytest.raises(UnsupportedFormatError, match="storage kind 'tar' is not known"):
        get_backend("tar")


# Backend file names (cachebuild/storage/*_backend.py): shard names, the zarr store and its metadata, the
# compaction journal. Side arrays (labels.npy, ...) and the manifest are the format's, named in format/.
_BACKEND_FILE_NAMES = re.compile(r"zarr\.json|images\.zarr|images-|\.jpegs\b|compacting\.json")

# (module, string constant or code) found outside storage/, each with its reason (the test names any stale line).
_ALLOWED = {
    # Not storage kinds: the same words for other things.
    ("cachebuild/sources/shards/wds.py", "'jpeg'"): "a WebDataset member's extension (IMAGE_KEYS)",
    ("cachebuild/sources/peers/litdata.py", "'jpeg'"): "a LitData leaf's type name and a file extension",
    ("cachebuild/sources/peers/mds.py", "'jpeg'"): "an MDS column encoding (its `column_encodings`)",
    ("loaders/encoded.py", "'jpeg'"): "the samples' codec (the manifest's `codec` field), not a kind",
}


def _kind_mentions(path: Path, kinds: set[str]) -> list[str]:
    """String constants (docstrings aside) that are a kind's name or a backend's file name (as the name they
    are assigned to at module level, if any), and (in)equality tests of a ``storage`` value with anything
    but ``DEFAULT_STORAGE``."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in kinds:
                found.append(repr(node.value))
            elif _BACKEND_FILE_NAMES.search(node.value):
                found.append(_assigned_name(tree, node) or repr(node.value))
        elif isinstance(node, ast.Compare) and all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn)
                                                   for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(_names_storage(o) for o in operands) and not all(
                    _names_storage(o) or (isinstance(o, ast.Name) and o.id == "DEFAULT_STORAGE") for o in operands):
                found.append(ast.unparse(node).replace('"', "'"))
    return found


def _names_storage(node) -> bool:
    import ast

    return (isinstance(node, ast.Name) and node.id == "storage") or (
        isinstance(node, ast.Attribute) and node.attr == "storage")


def _assigned_name(tree, constant) -> str | None:
    """The module-level name a constant is assigned to (inside a call or not), e.g. ``_STAGING_NAMES``."""
    import ast

    for stmt in tree.body:
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and any(n is constant for n in ast.walk(stmt)):
            target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
            return target.id if isinstance(target, ast.Name) else None
    return None


def test_nothing_outside_the_backends_asks_which_kind_a_cache_is():
    """The seam's rule, checked on the source: only cachebuild/storage names the kinds (their registry
    names, their file names) or compares a ``storage`` value with something other than the default."""
    from cachebuild.storage import backend_names

    root = REPO
    kinds = set(backend_names())
    seen: dict[tuple[str, str], int] = {}
    for path in sorted([*root.glob("cachebuild/**/*.py"), *root.glob("loaders/**/*.py")]):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("cachebuild", "storage"):
            continue
        for what in _kind_mentions(path, kinds):
            seen[(rel.as_posix(), what)] = seen.get((rel.as_posix(), what), 0) + 1
    offenders = sorted(f"{f}: {w}" for f, w in seen if (f, w) not in _ALLOWED)
    assert offenders == [], "storage kinds named outside cachebuild/storage"
    stale = sorted(f"{f}: {w}" for f, w in _ALLOWED if (f, w) not in seen)
    assert stale == [], "fixed: remove these lines from _ALLOWED"


def test_the_kind_check_sees_the_checks_it_is_for(tmp_path):
    """The scanner itself: each way a module can ask for a kind is caught; docstrings and the default are not."""
    src = tmp_path / "m.py"
    src.write_text('''"""A module about npy and zarr caches."""
from cachebuild.storage import DEFAULT_STORAGE
NAMES = ("images-00000.npy", "zarr.json")
def f(m, storage, codec):
    """'jpeg' in a docstring."""
    if m.storage == "zarr":
        return 1
    if storage in ("npy", "jpeg"):
        return 2
    if storage not in (DEFAULT_STORAGE, codec):
        return 3
    if m.storage is None:  # identity, not a kind test
        return 4
    return storage == DEFAULT_STORAGE
''')
    assert sorted(_kind_mentions(src, {"npy", "zarr", "jpeg"})) == sorted([
        "NAMES", "NAMES", "'zarr'", "'npy'", "'jpeg'", "m.storage == 'zarr'", "storage in ('npy', 'jpeg')",
        "storage not in (DEFAULT_STORAGE, codec)"])


# ---------------------------------------------------------------- names inside the cache


@pytest.mark.parametrize("field", ["shards", "labels", "paths"])
@pytest.mark.parametrize("bad", ["../elsewhere.npy", "/etc/passwd", "s3://bucket/x.npy", "sub/./x.npy"])
def test_manifest_names_outside_the_cache_are_refused(tmp_path, field, bad):
    """Even pointing at a valid file with a matching checksum: refused when the manifest is parsed."""
    root, _, _ = make_cache(tmp_path / "c")
    shutil.copy(root / "labels.npy", tmp_path / "elsewhere.npy")
    m = load_unsealed(root / "manifest.json")
    if field == "shards":
        m["shards"][0]["file"] = bad
    else:
        m["arrays"][field]["file"] = bad
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CacheCorruptError, match="not a plain relative name inside the cache"):
        open_cache(root)


# ---------------------------------------------------------------- zarr never serves fill values


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_missing_zarr_chunk_is_named_at_open_and_at_read(tmp_path, compression):
    root, _images, _ = make_cache(tmp_path / "c", n=50, storage="zarr", compression=compression)
    ds = CachedImageDataset(root)  # opened while every chunk was there
    chunk = root / "images.zarr" / "c" / "0" / "0" / "0" / "0"
    chunk.unlink()
    with pytest.raises(CacheCorruptError, match=r"c/0/0/0/0.*missing"):
        ds.gather(np.arange(3))
    with pytest.raises(CacheCorruptError, match=r"c/0/0/0/0.*missing"):
        CachedImageDataset(root)


def test_a_damaged_compressed_chunk_is_named_by_verify_and_by_the_reader(tmp_path):
    root, images, _ = make_cache(tmp_path / "c", n=50, storage="zarr", compression="zstd", h=16, w=16)
    chunk = root / "images.zarr" / "c" / "1" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:40])  # truncated
    problems = open_cache(root).verify()
    assert len(problems) == 1 and "c/1/0/0/0" in problems[0]
    ds = CachedImageDataset(root)
    assert np.array_equal(ds.gather(np.arange(16)), images[:16])  # chunk 0 is fine
    with pytest.raises(CacheCorruptError, match=r"c/1/0/0/0"):
        ds.gather(np.arange(14, 20))


def test_xarray_opens_a_zarr_cache(tmp_path):
    import xarray as xr

    root, images, _ = make_cache(tmp_path / "c", n=30, storage="zarr")
    ds = xr.open_zarr(root)
    assert ds["images.zarr"].dims == ("sample", "y", "x", "channel")
    assert np.array_equal(ds["images.zarr"].values, images)


# ---------------------------------------------------------------- a rebuild never changes what a reader returns


@pytest.mark.parametrize("storage", ["npy", "zarr"])
def test_force_rebuild_leaves_an_open_dataset_reading_the_old_cache_whole(tmp_path, storage):
    root, old, _ = make_cache(tmp_path / "c", n=48, storage=storage, shard_size=8)
    ds = CachedImageDataset(root)
    dl = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=collate_batch)
    first = next(iter(dl))[0].numpy()
    assert np.array_equal(first, old[decode_index(first)])
    new = make_images(40, 12, 10)[::-1].copy()  # another size, other pixels
    write_cache(root, new, np.zeros(40, int), ["x"], storage=storage, shard_size=8, replace=True)
    assert np.array_equal(open_cache(root).gather(np.arange(40)), new)  # the path now holds the new cache
    for _ in range(2):  # new worker processes each epoch open the shards they touch after the swap
        got = np.concatenate([x.numpy() for x, _ in dl])
        assert got.shape == old.shape and np.array_equal(np.sort(decode_index(got)), np.arange(48))
        assert np.array_equal(got, old[decode_index(got)])
    assert len(replaced_folders(root)) == 1  # kept while the dataset lives
    del ds, dl
    write_cache(root, old, np.zeros(48, int), ["x"], storage=storage, shard_size=8, replace=True)
    assert replaced_folders(root) == []  # no reader left: both old versions are gone


@pytest.mark.parametrize("storage,compression", [("npy", "none"), ("zarr", "none"), ("zarr", "zstd"),
                                                 ("jpeg", "none")])
def test_force_rebuild_with_the_same_layout_leaves_the_same_process_reading_the_old_pixels(tmp_path, storage,
                                                                                           compression):
    """The process that opened the dataset (and its chunk store, its shard maps) keeps reading the old cache
    after a --force rebuild: a compressed zarr cache used to read the new one's chunks by path."""
    n = 48
    old = make_images(n, 16, 12)
    write_cache(tmp_path / "c", old, np.zeros(n, int), ["x"], storage=storage, shard_size=16,
                compression=compression)
    ds = CachedImageDataset(tmp_path / "c")
    served = ds.gather(np.arange(n))  # every file opened here (jpeg: as its decoder serves them)
    write_cache(tmp_path / "c", 255 - old, np.zeros(n, int), ["x"], storage=storage, shard_size=16,
                compression=compression, replace=True)
    assert np.array_equal(ds.gather(np.arange(n)), served)
    assert not np.array_equal(CachedImageDataset(tmp_path / "c").gather(np.arange(n)), served)


def test_a_file_opened_while_a_rebuild_renames_the_folder_comes_from_the_pinned_folder(tmp_path, monkeypatch):
    """The race behind a flaky reader test: the folder is resolved, a rebuild renames it aside and puts the
    new cache at its path, then the file is opened by that path. The open must notice the swap and open the
    file again from where the pinned folder went."""
    from cachebuild.storage.locations import LocalLocation

    root, old, _ = make_cache(tmp_path / "c", n=32, storage="npy", shard_size=8)
    loc = LocalLocation(root).pinned()
    held = open_cache(root)  # a reader's shared lock: the rebuild keeps the old folder aside
    write_cache(root, 255 - old, np.zeros(32, int), ["x"], storage="npy", shard_size=8, replace=True)
    real = LocalLocation.folder
    stale = iter([root])  # the first resolution happened before the swap: it still names root

    def folder(self):
        return next(stale, None) or real(self)

    monkeypatch.setattr(LocalLocation, "folder", folder)
    with loc.open_file("images-00000.npy") as f:
        assert f.read() == (replaced_folders(root)[0] / "images-00000.npy").read_bytes()
    del held


def test_force_only_ever_replaces_a_cache(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "me.jpg").write_bytes(b"not ours")
    with pytest.raises(CacheExistsError, match="not a cachebuild cache"):
        write_cache(tmp_path / "photos", make_images(4), np.zeros(4, int), ["a"], replace=True)
    assert (tmp_path / "photos" / "me.jpg").read_bytes() == b"not ours"


def test_readers_never_mix_caches_while_rebuilds_run_concurrently(tmp_path):
    """Rebuilds with other parameters run in a thread while a DataLoader (2 workers, new ones every epoch)
    reads: every batch is whole and from the cache the dataset opened."""
    import threading

    root, old, _ = make_cache(tmp_path / "c", n=64, storage="npy", shard_size=8)
    ds = CachedImageDataset(root)
    stop = threading.Event()
    rebuilt = []

    def rebuild() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            imgs = make_images(32 + k % 3 * 8, 8 + k % 2 * 4, 6)[::-1].copy()
            write_cache(root, imgs, np.zeros(len(imgs), int), ["x"], shard_size=8, replace=True)
            rebuilt.append(k)

    t = threading.Thread(target=rebuild)
    t.start()
    try:
        dl = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=collate_batch)
        for _ in range(3):
            for x, _ in dl:
                b = x.numpy()
                assert b.shape[1:] == old.shape[1:] and np.array_equal(b, old[decode_index(b)])
    finally:
        stop.set()
        t.join()
    assert len(rebuilt) >= 2
