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
    assert counts == {"added": 0, "removed": 0, "modified": 10}
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
    assert counts == {"added": 1, "removed": 2, "modified": 1}
    assert examples == {"added": ["n99999999/new.JPEG"], "removed": sorted(keys[i] for i in drop),
                        "modified": [keys[0]]}
