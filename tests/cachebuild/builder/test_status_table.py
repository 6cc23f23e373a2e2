"""``status`` of a stale cache compares the build's per-file table with the source's, file by file: by arrays,
so that its memory per file stays small at ImageNet's 1.28M files (a dict of tuples on each side took twice the
memory). Checked on 100k rows in a second."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np

from cachebuild.builder.status import _compare
from cachebuild.format.manifest import BUILD, FORMAT_VERSION
from cachebuild.storage import open_location
from cachebuild.storage.cache import load_source_inputs, save_source_inputs

N = 100_000


def _table(tmp_path):
    keys = [f"n{k // 100:08d}/n{k // 100:08d}_{k}.JPEG" for k in range(N)]
    labels = np.arange(N, dtype=np.int64) // 100
    stats = np.stack([np.full(N, 1500), np.arange(N) + 1_700_000_000_000_000_000], axis=1).astype(np.int64)
    ref = save_source_inputs(tmp_path, keys, labels, stats)
    return keys, labels, stats, SimpleNamespace(source={"inputs": ref}, format_version=FORMAT_VERSION, digest=BUILD)


def test_touched_files_are_found_with_little_memory_per_file(tmp_path):
    keys, labels, stats, manifest = _table(tmp_path)
    new_stats = stats.copy()
    new_stats[::10_000, 1] += 1  # 10 files touched
    tracemalloc.start()
    old = load_source_inputs(open_location(tmp_path), manifest)
    counts, examples = _compare(old, SimpleNamespace(keys=keys, labels=labels), new_stats)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert counts == {"added": 0, "removed": 0, "modified": 10, "touched": 0}
    assert examples["modified"] == sorted(keys[::10_000])[:5]
    # what is left is parsing the JSON (its bytes, the keys, the number lists: ~330 B a file); a dict of tuples
    # a side on top of that was ~610
    assert peak / N < 420, f"{peak / N:.0f} bytes a file"


def test_added_removed_and_relabelled_files(tmp_path):
    keys, labels, stats, manifest = _table(tmp_path)
    old = load_source_inputs(open_location(tmp_path), manifest)
    drop = {5, 70_000}
    new_keys = [k for i, k in enumerate(keys) if i not in drop] + ["n99999999/new.JPEG"]
    keep = np.array([i for i in range(N) if i not in drop])
    new_labels = np.append(labels[keep], 3)
    new_labels[0] += 1  # relabelled
    new_stats = np.vstack([stats[keep], [[10, 10]]])
    counts, examples = _compare(old, SimpleNamespace(keys=new_keys, labels=new_labels), new_stats)
    assert counts == {"added": 1, "removed": 2, "modified": 1, "touched": 0}
    assert examples == {"added": ["n99999999/new.JPEG"], "removed": sorted(keys[i] for i in drop),
                        "modified": [keys[0]]}


def _rewritten(tmp_path, manifest, **fields):
    """The table in ``tmp_path`` with ``fields`` changed, and a manifest entry of its new checksum."""
    import json

    from cachebuild.format.manifest import entry_key
    from cachebuild.storage.cache import SOURCE_INPUTS

    doc = json.loads((tmp_path / SOURCE_INPUTS).read_text())
    doc.update(fields)
    data = json.dumps(doc).encode()
    (tmp_path / SOURCE_INPUTS).write_bytes(data)
    ref = {"file": SOURCE_INPUTS, entry_key(FORMAT_VERSION): BUILD.of(data)}
    return SimpleNamespace(source={"inputs": ref}, format_version=FORMAT_VERSION, digest=BUILD)


def test_digests_round_trip_and_only_known_ones_are_used(tmp_path):
    """The digests of the source files' bytes are an optional field: written as hex (null: not read), read back as
    S16; a table without them, or of another algorithm (a later release's), reads as having none (every file is
    then compared by its stat, as before them); a damaged list is refused by name."""
    import pytest

    from cachebuild.errors import CacheCorruptError
    from cachebuild.format.manifest import SOURCE_DIGEST

    keys = ["a/1.jpg", "a/2.jpg", "b/3.jpg"]
    labels = np.array([0, 0, 1])
    stats = np.array([[10, 1], [20, 2], [-1, -1]], np.int64)
    digests = np.array([SOURCE_DIGEST.of(b"one"), SOURCE_DIGEST.of(b"two"), ""], dtype="S16")
    ref = save_source_inputs(tmp_path, keys, labels, stats, digests)
    manifest = SimpleNamespace(source={"inputs": ref}, format_version=FORMAT_VERSION, digest=BUILD)
    got = load_source_inputs(open_location(tmp_path), manifest)
    assert got.keys == keys and got.rows.tolist() == [[0, 10, 1], [0, 20, 2], [1, -1, -1]]
    assert got.digests.tolist() == digests.tolist() and got.digests[0].decode() == SOURCE_DIGEST.of(b"one")
    import json

    assert json.loads((tmp_path / "source_files.json").read_text())["digests"][2] is None
    other = _rewritten(tmp_path, manifest, digest="blake3")
    assert load_source_inputs(open_location(tmp_path), other).digests is None
    for bad in ([1, 2, 3], ["ab", None, None], [None, None]):
        damaged = _rewritten(tmp_path, manifest, digest=SOURCE_DIGEST.name, digests=bad)
        with pytest.raises(CacheCorruptError, match=r"not a valid source table.*digest"):
            load_source_inputs(open_location(tmp_path), damaged)
