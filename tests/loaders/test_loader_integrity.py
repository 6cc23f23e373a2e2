"""Loader-side integrity: a batch holds exactly the samples asked for, whatever path it takes.

Encoded (decode="none") batches through torch's default collate, batched indices with ``batch_size=None``,
indices that are not integers, batches kept across a fork, and encoded batches sent to CUDA on a machine
without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from cachebuild.storage.cache import read_manifest
from loaders import CachedImageDataset, DatasetOptions, collate_batch, device_loader
from loaders.encoded import EncodedImages
from tests.compact_fixtures import jpeg_index_cache, shard_payloads
from tests.loaders_fixtures import decode_index, make_cache
from tests.repo import REPO

# ---------------------------------------------------------------- encoded batches, default collate


@pytest.mark.parametrize("workers", [0, 2])
def test_encoded_batches_through_default_collate(tmp_path: Path, workers: int) -> None:
    """No collate_fn (Lightning, timm, HF Trainer): a decode="none" batch used to crash default_collate
    ('EncodedImages' object is not subscriptable), and len() of the batch was the image height."""
    root, images, labels = jpeg_index_cache(tmp_path / "c", n=40)
    stored = [p for s in read_manifest(root).shards for p in shard_payloads(root / s.file)]
    ds = CachedImageDataset(root, DatasetOptions(decode="none"))
    assert len(ds.__getitems__([0, 1, 2])) == 3
    order = np.random.default_rng(5).permutation(40)
    dl = DataLoader(ds, batch_size=8, sampler=order.tolist(), num_workers=workers)
    seen, ys = [], []
    for enc, y in dl:
        assert isinstance(enc, EncodedImages) and len(enc) == len(y) == 8
        seen += [p.numpy().tobytes() for p in enc.payloads()]
        ys.append(y)
    assert seen == [stored[i] for i in order]
    assert np.array_equal(torch.cat(ys).numpy(), labels[order])
    x = torch.cat([x for x, _ in device_loader(dl, device="cpu")])
    assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), images[order])


def test_encoded_decode_on_cuda_without_cuda_is_one_line(tmp_path: Path) -> None:
    """An encoded batch sent to "cuda" where there is no CUDA: a one-line error, and no CUDA path imported
    (it used to import nvJPEG's module and die inside torchvision with a C++ stack dump)."""
    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    root, _, _ = jpeg_index_cache(tmp_path / "c", n=8)
    code = f"""
import sys
from loaders import CachedImageDataset, DatasetOptions
from loaders.device import to_device
batch = CachedImageDataset({str(root)!r}, DatasetOptions(decode="none")).__getitems__([0, 1, 2])
try:
    to_device(batch, "cuda")
except RuntimeError as e:
    print(e)
print(sorted(m for m in sys.modules if m in ("loaders.cuda_decode",)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    message, imported = r.stdout.strip().splitlines()
    assert "CUDA is not available" in message and "decode='cpu'" in message
    assert imported == "[]" and "frame #" not in r.stderr


# ---------------------------------------------------------------- indices


def test_indices_that_are_not_integers_are_refused(tmp_path: Path) -> None:
    """A float index used to be truncated (2.7 -> sample 2), a boolean mask read as samples 1 and 0, and a
    uint64 index past the end wrapped round to the last sample: other samples than the ones asked for."""
    root, _, _ = make_cache(tmp_path / "c", n=50)
    ds = CachedImageDataset(root)
    for bad in ([1.9, 3.5], torch.tensor([1.0, 2.0]), np.array([True, False]), ["1"]):
        with pytest.raises(TypeError, match="sample indices must be integers"):
            ds.__getitems__(bad)
        with pytest.raises(TypeError, match="sample indices must be integers"):
            ds.gather(bad)
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__(np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(TypeError):
        ds[2.7]
    # every integer form still reads exactly those samples
    for good in ([4, -1], np.array([4, -1], dtype=np.int32), np.array([4, 49], dtype=np.uint64),
                 torch.tensor([4, -1]), [torch.tensor(4), np.int16(-1)]):
        assert np.array_equal(decode_index(ds.__getitems__(good).images.numpy()), [4, 49])
        assert np.array_equal(decode_index(ds.gather(good)), [4, 49])
    for one in (7, np.int64(7), torch.tensor(7), -43):
        assert int(decode_index(ds[one][0].numpy()[None])[0]) == 7
    assert len(ds.__getitems__([])) == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_batched_indices_with_batch_size_none(tmp_path: Path, workers: int) -> None:
    """torch's batched-loading pattern, ``batch_size=None`` with a ``BatchSampler`` as sampler, hands the
    dataset a list of indices; ``__getitem__`` used to crash on it (int() of a list)."""
    root, images, labels = make_cache(tmp_path / "c", n=50, boxes=True)
    ds = CachedImageDataset(root, DatasetOptions(return_boxes=True))
    x, y, b = ds[[3, 1, -1]]
    assert np.array_equal(x.numpy(), images[[3, 1, 49]]) and np.array_equal(y.numpy(), labels[[3, 1, 49]])
    assert np.array_equal(b.numpy(), ds.boxes[[3, 1, 49]])
    sampler = BatchSampler(SequentialSampler(ds), 8, drop_last=False)
    dl = DataLoader(ds, batch_size=None, sampler=sampler, num_workers=workers)
    ref = DataLoader(ds, batch_sampler=sampler, num_workers=workers, collate_fn=collate_batch)
    for (x, y, b), (rx, ry, rb) in zip(dl, ref, strict=True):
        assert x.numpy().tobytes() == rx.numpy().tobytes()
        assert torch.equal(y, ry) and torch.equal(b, rb)
    sub = Subset(ds, [9, 2, 30])  # Subset forwards a list to __getitems__: still the samples asked for
    assert np.array_equal(collate_batch(sub.__getitems__([2, 0]))[0].numpy(), images[[30, 9]])


# ---------------------------------------------------------------- kept batches and fork


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")
def test_a_kept_batch_reaches_a_forked_child(tmp_path: Path) -> None:
    """A batch the program keeps (a slot of a DataLoader worker's ring, mapped in this process) reaches a forked
    child with its pixels: a multiprocessing.Process, or a DataLoader whose forked workers read kept batches."""
    root, images, labels = make_cache(tmp_path / "c", n=96, h=32, w=32)
    dl = DataLoader(CachedImageDataset(root), batch_size=16, num_workers=2, collate_fn=collate_batch,
                    multiprocessing_context="fork")
    kept = [(x, y) for i, (x, y) in enumerate(dl) if i in (1, 4)]
    child = os.fork()
    if child == 0:
        ok = np.array_equal(kept[0][0].numpy(), images[16:32]) and np.array_equal(kept[1][0].numpy(), images[64:80])
        os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child saw other pixels in a kept batch"
    x, y = kept[1]
    over = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, num_workers=2,
                      multiprocessing_context="fork")
    got = list(over)
    assert np.array_equal(torch.cat([b for b, _ in got]).numpy(), images[64:80])
    assert np.array_equal(torch.cat([t for _, t in got]).numpy(), labels[64:80])
