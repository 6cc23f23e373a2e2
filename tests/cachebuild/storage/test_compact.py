"""Compact caches (storage ``jpeg``): built like raw caches, read back decoded (CPU threads) or as stored
JPEGs (for nvJPEG), deterministic, resumable, and never serving a damaged sample."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
import simplejpeg
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader

import cachebuild.storage.kinds.jpeg as jpeg_backend
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.errors import CacheCorruptError, CacheExistsError, OptionError
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache, read_manifest
from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from loaders.device import device_loader
from loaders.encoded import EncodedImages
from loaders.sampler import CacheSampler
from tests.compact_fixtures import jpeg_index_cache, read_index, shard_payloads
from tests.kill_helpers import build_killed_after_blocks
from tests.repo import REPO

SIZE = 64


def _plan(info):
    return imagenet_plans(info["root"], "train")[0]


def _psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-sample PSNR (dB) of two (N, H, W, 3) uint8 batches."""
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
    return 10 * np.log10(255.0**2 / np.maximum(mse, 1e-12))


def _all(path: Path) -> np.ndarray:
    c = open_cache(path)
    return c.gather(np.arange(len(c)))


def _image_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("images-*"))}


@pytest.fixture(scope="module")
def builds(imagenet_tree, tmp_path_factory):
    """The same plan (with ImageNet's quirks and broken files) built raw, and as jpeg with 1 and 2 jobs."""
    root = tmp_path_factory.mktemp("compact")
    plan = _plan(imagenet_tree)
    raw = build(plan, root / "raw", BuildOptions(size=SIZE, jobs=1, block_size=8))
    j1 = build(plan, root / "j1", BuildOptions(size=SIZE, jobs=1, block_size=8, storage="jpeg"))
    j2 = build(plan, root / "j2", BuildOptions(size=SIZE, jobs=2, block_size=8, storage="jpeg"))
    return {"plan": plan, "raw": raw.path, "j1": j1.path, "j2": j2.path, "root": root}


# ---------------------------------------------------------------- build


def test_round_trip_on_real_photos(builds):
    raw, jpg = open_cache(builds["raw"]), open_cache(builds["j1"])
    m = jpg.manifest
    assert m.storage == "jpeg" and m.shape == (SIZE, SIZE, 3) and m.count == raw.manifest.count > 40
    assert m.build["codec"] == "jpeg" and m.build["quality"] == 90 and m.build["subsampling"] == "420"
    assert np.array_equal(jpg.labels, raw.labels) and np.array_equal(jpg.sizes, raw.sizes)
    assert jpg.paths() == raw.paths() and m.failures == raw.manifest.failures and len(m.failures) >= 5
    pixels, ref = _all(builds["j1"]), _all(builds["raw"])
    psnr = _psnr(pixels, ref)
    # 64 px samples of photos hold more detail per pixel than 224 px ones: ~35 dB here, ~39 at 224 (bench)
    assert np.median(psnr) >= 34 and psnr.min() >= 29, np.round(np.sort(psnr)[:5], 1)
    stored = sum(p.stat().st_size for p in builds["j1"].glob("images-*"))
    assert stored * 5 <= ref.nbytes  # 64 px photos: ~7x smaller (224 px: see bench/scripts/compact.py)


def test_served_pixels_are_a_plain_decode_of_the_stored_bytes(builds):
    """What the reader serves = any libjpeg-turbo decoding the stored bytes (read with plain numpy)."""
    m = read_manifest(builds["j1"])
    pixels = _all(builds["j1"])
    for s in m.shards:
        for j, data in enumerate(shard_payloads(builds["j1"] / s.file)):
            assert np.array_equal(pixels[s.start + j], simplejpeg.decode_jpeg(data))
            assert np.array_equal(pixels[s.start + j],
                                  cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB))


def test_jobs_do_not_change_a_byte(builds):
    a, b = read_manifest(builds["j1"]), read_manifest(builds["j2"])
    assert a.shards == b.shards and a.build["key"] == b.build["key"]
    assert _image_files(builds["j1"]) == _image_files(builds["j2"])
    assert len(a.shards) > 4 and open_cache(builds["j2"]).verify() == []


def test_a_build_stopped_part_way_resumes_byte_identical(builds, tmp_path, monkeypatch):
    """A build dying while a worker writes its 4th shard (a half-written temporary file left behind, as
    after a kill) resumes with the same command and ends byte-identical to an uninterrupted build."""
    real = jpeg_backend.JpegShardSink.close
    closed = []

    def dying(self):
        if len(closed) == 3:
            with open(self.path.with_name(f".{self.path.name}.0.deadbeef.tmp"), "wb") as f:  # AtomicFile naming
                f.write(b"\x93NUMPY half a shard")
            raise KeyboardInterrupt
        closed.append(self.path.name)
        return real(self)

    opts = BuildOptions(size=SIZE, jobs=1, block_size=8, storage="jpeg")
    monkeypatch.setattr(jpeg_backend.JpegShardSink, "close", dying)
    with pytest.raises(KeyboardInterrupt):
        build(builds["plan"], tmp_path / "c", opts)
    monkeypatch.undo()
    assert not (tmp_path / "c").exists() and len(list((tmp_path / "c.partial" / "blocks").glob("*.json"))) == 3
    resumed = build(builds["plan"], tmp_path / "c", opts)
    assert resumed.status == "built"
    assert _image_files(resumed.path) == _image_files(builds["j1"])
    assert read_manifest(resumed.path).shards == read_manifest(builds["j1"]).shards
    assert not list(resumed.path.glob(".*"))  # the dead writer's temporary file did not travel into the cache


@pytest.mark.slow
def test_sigkill_then_resume_is_byte_identical(imagenet_tree, tmp_path):
    src = imagenet_tree["root"]
    common = ["--split", "train", "--size", "64", "--shard-size", "4", "--jobs", "1", "--no-progress",
              "--format", "jpeg"]
    cli = [sys.executable, "-m", "cachebuild", "imagenet", str(src)]
    assert subprocess.run([*cli, "--out", str(tmp_path / "ref"), *common], capture_output=True).returncode == 0
    out = tmp_path / "killed"
    n_done = build_killed_after_blocks([*cli[3:], "--out", str(out), *common], out / "train.partial" / "blocks")
    assert 3 <= n_done < 14, "the kill must land part way"
    resumed = subprocess.run([*cli, "--out", str(out), *common, "-v"], capture_output=True, text=True)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr
    assert _image_files(out / "train") == _image_files(tmp_path / "ref" / "train")


def test_quality_and_subsampling_shape_the_bytes_and_the_build_key(imagenet_clean, tmp_path):
    plan = _plan(imagenet_clean)
    low = build(plan, tmp_path / "c", BuildOptions(size=48, jobs=1, storage="jpeg"))
    with pytest.raises(CacheExistsError):  # another quality is another cache
        build(plan, tmp_path / "c", BuildOptions(size=48, jobs=1, storage="jpeg", quality=97, subsampling="444"))
    high = build(plan, tmp_path / "h", BuildOptions(size=48, jobs=1, storage="jpeg", quality=97, subsampling="444"))
    m = read_manifest(high.path)
    assert (m.build["quality"], m.build["subsampling"]) == (97, "444")
    assert high.bytes_written > 1.5 * low.bytes_written
    raw = _all(build(plan, tmp_path / "raw", BuildOptions(size=48, jobs=1)).path)
    assert np.median(_psnr(_all(high.path), raw)) > np.median(_psnr(_all(low.path), raw)) + 3


def test_fit_pad_keeps_boxes(imagenet_clean, tmp_path):
    plan = _plan(imagenet_clean)
    raw = build(plan, tmp_path / "raw", BuildOptions(size=48, fit="pad", jobs=1))
    jpg = build(plan, tmp_path / "jpg", BuildOptions(size=48, fit="pad", jobs=1, storage="jpeg"))
    boxes = open_cache(jpg.path).boxes
    assert boxes is not None and np.array_equal(boxes, open_cache(raw.path).boxes)
    assert (boxes[:, 2] - boxes[:, 0] < 48).any() or (boxes[:, 3] - boxes[:, 1] < 48).any()
    ds = CachedImageDataset(jpg.path, DatasetOptions(return_boxes=True))
    x, _y, b = ds[0]
    assert tuple(b.tolist()) == tuple(boxes[0]) and x.shape == (48, 48, 3)


# ---------------------------------------------------------------- damage


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["entropy", "quant-table"])
def test_a_damaged_sample_is_named_by_verify_and_by_the_reader(builds, tmp_path, where):
    """A flipped byte in a stored JPEG: verify names the shard and the sample; reading it raises an error
    naming the sample and its source file (also in a DataLoader worker); its neighbours still read. A
    flipped byte in a quantisation table decodes without any error in libjpeg: the crc32 catches it."""
    cache = tmp_path / "c"
    shutil.copytree(builds["j1"], cache)
    m = read_manifest(cache)
    s = m.shards[2]
    victim = s.start + 3
    with open(cache / s.file, "rb") as f:
        offsets = np.load(f)
        np.load(f)  # crc32
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        payload_start = f.tell()
    data = shard_payloads(cache / s.file)[3]
    at = len(data) // 2 if where == "entropy" else data.index(b"\xff\xdb") + 10  # inside the DQT segment
    _flip(cache / s.file, payload_start + int(offsets[3]) + at)
    if where == "quant-table":  # what the crc32 is for: libjpeg decodes this silently, wrongly
        bad = bytearray(data)
        bad[at] ^= 0xFF
        assert simplejpeg.decode_jpeg(bytes(bad)).shape == (SIZE, SIZE, 3)

    problems = open_cache(cache).verify()
    assert len(problems) == 1 and s.file in problems[0] and f"samples {victim} fail their crc32" in problems[0]
    r = CliRunner().invoke(main, ["verify", str(cache)])
    assert r.exit_code == 1 and f"samples {victim} fail" in r.output

    ds = CachedImageDataset(cache)
    path = ds.paths[victim]
    with pytest.raises(CacheCorruptError, match=rf"sample {victim} \({path}\) of .*{s.file} is damaged"):
        ds.gather([victim - 1, victim])
    assert np.array_equal(ds.gather([victim - 1, victim + 1]), _all(builds["j1"])[[victim - 1, victim + 1]])
    if where == "entropy":  # (torch's DataLoader then takes 5 s to stop a worker that raised: once is enough)
        dl = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=collate_batch)
        with pytest.raises(CacheCorruptError, match=rf"sample {victim} "):
            list(dl)


def test_a_truncated_or_inconsistent_shard_is_refused_at_open(builds, tmp_path):
    cache = tmp_path / "c"
    shutil.copytree(builds["j1"], cache)
    shard = cache / read_manifest(cache).shards[1].file
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-10])
    with pytest.raises(CacheCorruptError, match=rf"{shard.name} is {len(whole) - 10} bytes.*truncated"):
        CachedImageDataset(cache)
    head = bytearray(whole)
    head[128 + 8 * 2 : 128 + 8 * 3] = (10**9).to_bytes(8, "little")  # offsets[2] past the payload
    shard.write_bytes(bytes(head))
    with pytest.raises(CacheCorruptError, match="offsets do not tile its payload"):
        CachedImageDataset(cache)
    shard.unlink()
    with pytest.raises(CacheCorruptError, match=f"{shard.name}.*missing"):
        CachedImageDataset(cache)


# ---------------------------------------------------------------- loaders


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_decode_shuffled_batches(tmp_path, context):
    root, images, labels = jpeg_index_cache(tmp_path / "c", n=70)
    ds = CachedImageDataset(root)
    assert ds.encoded and ds.manifest.storage == "jpeg"
    sampler = CacheSampler(ds, shuffle=True, seed=4)
    sampler.set_epoch(0)  # the test says the epoch: every pass of this sampler is epoch 0
    order = np.fromiter(iter(sampler), dtype=np.int64)
    dl = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2 if context == "fork" else 1,
                    collate_fn=collate_batch, multiprocessing_context=context)
    got = [(x.numpy().copy(), y.numpy()) for x, y in dl]
    x = np.concatenate([g[0] for g in got])
    assert np.array_equal(read_index(x), order)  # every sample where the sampler put it
    assert np.array_equal(x, ds.gather(order)) and np.array_equal(x, images[order])
    assert np.array_equal(np.concatenate([g[1] for g in got]), labels[order])


def test_decode_threads_give_the_same_pixels(builds, monkeypatch):
    idx = np.random.default_rng(0).permutation(open_cache(builds["j1"]).manifest.count)
    one = CachedImageDataset(builds["j1"], DatasetOptions(decode_threads=1)).gather(idx)
    three = CachedImageDataset(builds["j1"], DatasetOptions(decode_threads=3))
    assert np.array_equal(three.gather(idx), one)
    assert three._images._pool is not None and three._images._pool._max_workers == 3
    assert jpeg_backend.decode_threads(2) == 2  # the one rule: DatasetOptions(decode_threads=) wins
    assert np.array_equal(CachedImageDataset(builds["j1"]).gather(idx), one)


def test_the_retired_decode_threads_variable_is_a_one_line_error_naming_the_option(builds, monkeypatch):
    monkeypatch.setenv("CACHEBUILD_DECODE_THREADS", "2")
    with pytest.raises(OptionError, match=r"^CACHEBUILD_DECODE_THREADS is no longer read: pass "
                                          r"DatasetOptions\(decode_threads=N\)") as e:
        CachedImageDataset(builds["j1"], DatasetOptions(decode_threads=2))
    assert "\n" not in str(e.value)
    r = CliRunner().invoke(main, ["info", str(builds["j1"])])
    assert r.exit_code == 1 and "CACHEBUILD_DECODE_THREADS is no longer read" in r.output
    monkeypatch.setenv("CACHEBUILD_DECODE_THREADS", "")  # unset or empty: nothing to say
    assert CachedImageDataset(builds["j1"]).manifest.storage == "jpeg"


def test_encoded_batches_carry_the_stored_bytes_to_the_device(tmp_path):
    """decode="none": workers hand over the stored JPEGs (checked), and device_loader decodes them where
    the batch lands (on CPU here: the same pixels as decoding in the workers)."""
    root, images, _labels = jpeg_index_cache(tmp_path / "c", n=40)
    stored = [p for s in read_manifest(root).shards for p in shard_payloads(root / s.file)]
    ds = CachedImageDataset(root, DatasetOptions(decode="none"))
    order = np.random.default_rng(2).permutation(40)
    dl = DataLoader(ds, batch_size=8, sampler=order.tolist(), num_workers=2, collate_fn=collate_batch)
    seen = []
    for enc, _y in dl:
        assert isinstance(enc, EncodedImages) and enc.shape == (32, 32, 3)
        seen += [p.numpy().tobytes() for p in enc.payloads()]
    assert seen == [stored[i] for i in order]
    decoded = [x for x, _ in device_loader(dl, device="cpu")]
    x = torch.cat(decoded)
    assert x.shape == (40, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), images[order])


def test_decode_cuda_needs_cuda_and_raw_caches_pass_through(tmp_path):
    root, _images, _ = jpeg_index_cache(tmp_path / "c", n=8)
    dl = DataLoader(CachedImageDataset(root), batch_size=4, collate_fn=collate_batch)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"decode='cuda' decodes on a CUDA device.*use decode='cpu'"):
            device_loader(dl, device="cuda", decode="cuda")
    with pytest.raises(ValueError, match="decode='cuda' decodes on a CUDA device"):
        device_loader(dl, device="cpu", decode="cuda")


# ---------------------------------------------------------------- CLI, imports


def test_cli_codec_options(imagenet_clean, tmp_path, monkeypatch):
    runner = CliRunner()
    monkeypatch.setenv("CACHEBUILD_HOME", str(tmp_path / "home"))
    r = runner.invoke(main, ["imagenet", str(imagenet_clean["root"]), "--split", "val", "--size", "40",
                             "--format", "jpeg", "--quality", "95", "--subsampling", "444", "-j", "1"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "home" / "imagenet-40-jpeg" / "val"
    m = json.loads((out / "manifest.json").read_text())
    assert (m["storage"], m["build"]["quality"], m["build"]["subsampling"]) == ("jpeg", 95, "444")
    assert "storage: jpeg" in runner.invoke(main, ["info", str(out)]).output
    assert runner.invoke(main, ["verify", str(out)]).exit_code == 0
    for args, message in [(["--codec", "jpeg"], "a compact cache is --format jpeg"),
                          (["--format", "jpeg", "--compression", "zstd"], "take no chunk compression"),
                          (["--format", "jpeg", "--quality", "101"], "101 is not in the range")]:
        r = runner.invoke(main, ["imagenet", str(imagenet_clean["root"]), "--out", str(tmp_path / "x"), *args])
        assert r.exit_code == 2 and message in r.output, r.output
        assert not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_decode_device_cuda_without_cuda_is_one_line(imagenet_clean, tmp_path):
    r = CliRunner().invoke(main, ["imagenet", str(imagenet_clean["root"]), "--out", str(tmp_path / "x"),
                                  "--decode-device", "cuda"])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--decode-device cuda needs a CUDA GPU" in lines[0] and "--decode-device cpu" in lines[0]
    assert not (tmp_path / "x").exists()


def test_cpu_only_machines_never_import_cuda_paths(tmp_path):
    """Building, reading (threads, DataLoader workers, encoded batches decoded on the CPU) never imports
    the GPU build path or the nvJPEG decode module."""
    root, _, _ = jpeg_index_cache(tmp_path / "c", n=20)
    code = f"""
import sys, numpy as np
from torch.utils.data import DataLoader
from loaders import CachedImageDataset, DatasetOptions, collate_batch, device_loader
ds = CachedImageDataset({str(root)!r}, DatasetOptions(decode_threads=2))
ds.gather(np.arange(20))
list(DataLoader(ds, batch_size=8, num_workers=1, collate_fn=collate_batch))
list(device_loader(DataLoader(CachedImageDataset({str(root)!r}, DatasetOptions(decode="none")), batch_size=8,
                              collate_fn=collate_batch), device="cpu"))
print(sorted(m for m in sys.modules if m in ("cachebuild.builder.gpu_build", "loaders.cuda_decode")))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_stored_index_matches_its_checksums(builds):
    """The index FORMAT.md describes: offsets tile the payload; crc32 of every sample as stored."""
    m = read_manifest(builds["j1"])
    for s in m.shards:
        with open(builds["j1"] / s.file, "rb") as f:
            offsets, crc, payload = np.load(f), np.load(f), np.load(f)
            assert f.read() == b""
        assert offsets.dtype == np.int64 and crc.dtype == np.uint32 and payload.dtype == np.uint8
        assert len(crc) == s.count and offsets[0] == 0 and offsets[-1] == len(payload)
        assert [zlib.crc32(payload[a:z]) for a, z in itertools.pairwise(offsets)] == crc.tolist()


class _DecodeThreadsHere(torch.utils.data.Dataset):
    """What the decode-thread rule says in the process that loads item i."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int]:
        return jpeg_backend.decode_threads(), jpeg_backend.decode_threads(3)


def test_decode_threads_is_one_rule_for_the_main_process_and_dataloader_workers(tmp_path, monkeypatch):
    """The CPUs divided among the DataLoader's workers (at most 4), all of them in the main process; the option
    wins in both; with a crop too, every way of decoding gives the pixels of one decoding thread."""
    from loaders.worker_crop import RandomResizedCrop

    monkeypatch.delenv("CACHEBUILD_DECODE_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert jpeg_backend.decode_threads() == min(jpeg_backend.MAX_DECODE_THREADS, cpus)
    assert jpeg_backend.decode_threads(3) == 3
    seen = DataLoader(_DecodeThreadsHere(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert {(int(a), int(b)) for a, b in seen} == {(max(1, min(jpeg_backend.MAX_DECODE_THREADS, cpus // 2)), 3)}
    root = jpeg_index_cache(tmp_path / "c", n=40)[0]
    for crop in (None, RandomResizedCrop(16)):
        plain = CachedImageDataset(root, DatasetOptions(crop=crop, seed=3, decode_threads=1))
        order = np.asarray(list(CacheSampler(plain, seed=1)))
        want = plain.load_batch(order, torch.empty((40, *plain.output_shape), dtype=torch.uint8)).images.numpy()
        for options in (DatasetOptions(crop=crop, seed=3), DatasetOptions(crop=crop, seed=3, decode_threads=3)):
            ds = CachedImageDataset(root, options)
            for workers in (0, 2):
                dl = DataLoader(ds, batch_size=8, sampler=CacheSampler(ds, seed=1), num_workers=workers,
                                collate_fn=collate_batch)
                assert np.array_equal(np.concatenate([b[0].numpy() for b in dl]), want), (crop, options, workers)
        assert ds._images._pool is not None and ds._images._pool._max_workers == 3  # the option won here too
