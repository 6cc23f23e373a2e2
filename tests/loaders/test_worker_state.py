"""What a DataLoader worker receives of a CachedImageDataset: nothing that grows with the sample count.

A worker gets the dataset by pickle (spawn, or torch's reductions); labels and sizes of a local cache are
memory-mapped there again from the cache's own files, so 8 workers of an ImageNet-sized cache do not each
hold (and unpickle) 20 MB of side arrays."""

from __future__ import annotations

import pickle

import numpy as np

from cachebuild.storage.cache import write_cache
from loaders import CachedImageDataset


def _cache(tmp_path, n: int) -> CachedImageDataset:
    rng = np.random.default_rng(n)
    images = rng.integers(0, 256, size=(n, 2, 2, 3), dtype=np.uint8)
    labels = rng.integers(0, 7, size=n)
    sizes = rng.integers(1, 500, size=(n, 2)).astype(np.int32)
    write_cache(tmp_path / f"c{n}", images, labels, [f"c{k}" for k in range(7)], shard_size=4096, sizes=sizes)
    return CachedImageDataset(tmp_path / f"c{n}")


def test_a_workers_copy_of_the_dataset_does_not_grow_with_n(tmp_path):
    small, large = _cache(tmp_path, 100), _cache(tmp_path, 40_000)
    grown = len(pickle.dumps(large)) - len(pickle.dumps(small))
    # 40k samples of int64 labels + int32 (h, w) sizes would be 640 KB; 10 shards more in the manifest are not
    assert grown < 8_000, f"the pickled dataset grew by {grown} bytes for 39,900 more samples"
    copy = pickle.loads(pickle.dumps(large))
    assert np.array_equal(copy.labels, large.labels) and np.array_equal(copy.sizes, large.sizes)
    images, labels = copy[[0, 39_999, 17]]
    assert labels.tolist() == large.labels[[0, 39_999, 17]].tolist()
    assert np.array_equal(images.numpy(), large[[0, 39_999, 17]][0].numpy())


def test_the_readers_side_arrays_are_mapped_not_read_whole(tmp_path):
    ds = _cache(tmp_path, 5000)
    on_disk = (tmp_path / "c5000" / "sizes.npy").read_bytes()
    for arr in (ds._labels, ds.sizes):
        assert not arr.flags.owndata and arr.base is not None  # a view of a map of the file, not a copy
    before = ds.sizes[0].tolist()
    ds.sizes[0] = (0, 0)  # copy-on-write (sizes are >= 1): this process's page only, never the file
    assert (tmp_path / "c5000" / "sizes.npy").read_bytes() == on_disk
    assert CachedImageDataset(tmp_path / "c5000").sizes[0].tolist() == before != [0, 0]
