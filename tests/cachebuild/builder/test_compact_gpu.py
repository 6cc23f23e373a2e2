"""GPU paths of compact caches: the ``--decode-device cuda`` build and nvJPEG decoding in ``device_loader``.

Without a GPU the GPU build's code runs on the CPU (torchvision's CPU JPEG decoder standing in for
nvJPEG): batching, CPU fallbacks, geometry and its place in the pipeline are tested here. The tests
marked ``gpu`` run the same on CUDA (``.ci/gpu-checks``) and skip cleanly without it.
"""

from __future__ import annotations

import functools
import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import cachebuild.builder.gpu_build as gpu_build
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.builder.sample import ResizeSpec, decode_into, probe, reduction
from cachebuild.errors import DecodeError
from cachebuild.sources.imagenet import imagenet_plans
from cachebuild.storage.cache import open_cache, read_manifest
from loaders.dataset import CachedImageDataset, collate_batch
from loaders.device import device_loader
from tests.compact_fixtures import jpeg_index_cache, read_index

gpu = pytest.mark.gpu


def _psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(axis=1)
    return 10 * np.log10(255.0**2 / np.maximum(mse, 1e-12))


def _decode_all(fill, plan, spec):
    """Run ``fill`` (the pipeline's per-sample step) over a plan: pixels, placements, failures."""
    out = np.zeros((len(plan), spec.size, spec.size, 3), np.uint8)
    placed, failed = {}, {}
    for i, key in enumerate(plan.keys):
        try:
            placed[i] = fill(i, key, out[i])
        except DecodeError as e:
            failed[i] = e.reason
        except OSError as e:  # as the pipeline records it
            failed[i] = f"unreadable: {e.strerror}"
    return out, placed, failed


def _only_reduced_decodes_differ(plan, ok, psnr, spec) -> None:
    """Samples further than 35 dB apart are those the CPU path decoded at 1/2-1/8 scale by the JPEG DCT
    (the GPU path always decodes whole; without reduction the two agree within 45 dB: next test)."""
    for i, p in zip(ok, psnr, strict=True):
        if p < 35:
            h, w, fmt = probe(plan.reader(i, plan.keys[i]), spec.max_pixels)
            assert fmt == "JPEG" and reduction(h, w, spec) > 1, (plan.keys[i], p)


@pytest.mark.parametrize("fit", ["crop", "pad"])
def test_gpu_block_decoder_on_cpu_matches_the_cpu_path(imagenet_tree, fit):
    """Same files kept and refused (with the same reasons), same original sizes and boxes, and pixels
    within 40 dB of the CPU path; CMYK and PNG-named-JPEG go to the CPU fallback."""
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    spec = ResizeSpec(size=64, fit=fit)

    def cpu(i, key, slot):
        return decode_into(plan.reader(i, key), spec, slot, path=key)

    gpu_fill = gpu_build.GpuBlockDecoder(plan.reader, list(plan.keys), 0, spec, device="cpu", batch=16)
    ref, ref_placed, ref_failed = _decode_all(cpu, plan, spec)
    got, got_placed, got_failed = _decode_all(gpu_fill, plan, spec)
    assert got_failed == ref_failed and len(ref_failed) >= 5
    assert got_placed == ref_placed  # original (h, w) and the box, sample by sample
    ok = sorted(ref_placed)
    psnr = _psnr(got[ok], ref[ok])
    assert np.median(psnr) >= 40
    _only_reduced_decodes_differ(plan, ok, psnr, spec)
    assert gpu_fill.cpu_samples == 2 and gpu_fill.gpu_samples == len(ok) - 2  # the CMYK and the PNG


def test_without_dct_reduction_the_gpu_geometry_is_the_cpu_geometry(imagenet_clean):
    """With no DCT reduction on either side the two paths differ only by float vs uint8 resampling."""
    plan = imagenet_plans(imagenet_clean["root"], "train")[0]
    for fit in ("crop", "squash", "pad"):
        spec = ResizeSpec(size=48, fit=fit, reduced_decode=False)
        ref, ref_placed, _ = _decode_all(lambda i, k, s, spec=spec: decode_into(plan.reader(i, k), spec, s, path=k),
                                         plan, spec)
        got, got_placed, _ = _decode_all(gpu_build.GpuBlockDecoder(plan.reader, list(plan.keys), 0, spec,
                                                                   device="cpu"), plan, spec)
        assert got_placed == ref_placed
        diff = np.abs(got.astype(int) - ref.astype(int))
        assert np.median(_psnr(got, ref)) >= 45 and (diff > 3).mean() < 0.01, fit


def test_which_files_nvjpeg_is_given(imagenet_tree):
    q = imagenet_tree["quirks"]
    assert not gpu_build.nvjpeg_can_take(q["cmyk"]["path"].read_bytes())  # 4 components
    assert not gpu_build.nvjpeg_can_take(q["png"]["path"].read_bytes())
    assert gpu_build.nvjpeg_can_take(q["gray"]["path"].read_bytes())
    assert gpu_build.nvjpeg_can_take(q["exif"]["path"].read_bytes())
    buf = io.BytesIO()
    Image.fromarray(np.zeros((40, 30, 3), np.uint8)).save(buf, format="JPEG", progressive=True)
    assert gpu_build.nvjpeg_can_take(buf.getvalue())  # tried on the GPU; refused ones fall back
    assert not gpu_build.nvjpeg_can_take(b"\xff\xd8\xff\xd9")


def test_the_gpu_build_path_in_the_pipeline(imagenet_tree, tmp_path, monkeypatch):
    """The pipeline's GPU path end to end, with the decoder on the CPU: another build key than the CPU
    build, the same samples, labels, sizes and failures, and pixels within 40 dB of it."""
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    monkeypatch.setattr(gpu_build, "gpu_workers", lambda device: (1, ""))
    monkeypatch.setattr(gpu_build, "GpuBlockDecoder", functools.partial(gpu_build.GpuBlockDecoder, device="cpu"))
    cuda = build(plan, tmp_path / "gpu", BuildOptions(size=64, jobs=1, block_size=16, decode_device="cuda"))
    cpu = build(plan, tmp_path / "cpu", BuildOptions(size=64, jobs=1, block_size=16))
    a, b = open_cache(cuda.path), open_cache(cpu.path)
    assert a.manifest.build["decode_device"] == "cuda" and "decode_device" not in b.manifest.build
    assert a.manifest.build_key != b.manifest.build_key
    assert np.array_equal(a.labels, b.labels) and np.array_equal(a.sizes, b.sizes) and a.paths() == b.paths()
    assert a.manifest.failures == b.manifest.failures and a.verify() == []
    psnr = _psnr(a.gather(np.arange(len(a))), b.gather(np.arange(len(b))))
    assert np.median(psnr) >= 40


def test_the_nvjpeg_batch_path_on_cpu_gives_the_served_pixels(tmp_path):
    """loaders.cuda_decode run with torchvision's CPU decoder: one batched call, each sample in its place,
    NCHW channels_last like raw batches, exactly the pixels the CPU decode-on-read serves."""
    from loaders.cuda_decode import decode_on_cuda
    from loaders.encoded import EncodedImages

    root, _images, _ = jpeg_index_cache(tmp_path / "c", n=24)
    ds = CachedImageDataset(root)
    idx = np.random.default_rng(1).permutation(24)
    data, offsets = ds._images.read_encoded(idx)
    enc = EncodedImages(torch.from_numpy(data), torch.from_numpy(offsets), ds.shape)
    x = decode_on_cuda(enc.payloads(), enc.shape, torch.device("cpu"))
    assert x.shape == (24, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(x.permute(0, 2, 3, 1).numpy(), ds.gather(idx))
    assert np.array_equal(read_index(x.permute(0, 2, 3, 1).numpy()), idx)


# ---------------------------------------------------------------- on a GPU


@gpu
def test_cuda_build_matches_the_cpu_build(imagenet_tree, tmp_path):
    """The real thing: --decode-device cuda (nvJPEG, GPU resize) against the CPU build of the same files."""
    common = ["imagenet", str(imagenet_tree["root"]), "--split", "train", "--size", "224", "--no-progress"]
    for out, extra in (("gpu", ["--decode-device", "cuda"]), ("cpu", ["--jobs", "2"])):
        r = subprocess.run([sys.executable, "-m", "cachebuild", *common, "--out", str(tmp_path / out), *extra],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    a, b = open_cache(tmp_path / "gpu" / "train"), open_cache(tmp_path / "cpu" / "train")
    assert a.manifest.build["decode_device"] == "cuda"
    assert a.manifest.count == b.manifest.count and a.paths() == b.paths()
    assert np.array_equal(a.labels, b.labels) and np.array_equal(a.sizes, b.sizes)
    assert a.manifest.failures == b.manifest.failures
    psnr = _psnr(a.gather(np.arange(len(a))), b.gather(np.arange(len(b))))
    print(f"GPU build vs CPU build: median PSNR {np.median(psnr):.1f} dB, min {psnr.min():.1f}")
    assert np.median(psnr) >= 40
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    kept = [plan.keys.index(p) for p in a.paths()]
    low = [(k, p) for k, p in zip(kept, psnr, strict=True) if p < 35]
    _only_reduced_decodes_differ(plan, [k for k, _ in low], [p for _, p in low], ResizeSpec(size=224))


@gpu
def test_device_loader_decodes_with_nvjpeg(imagenet_tree, tmp_path):
    """Workers send the stored JPEGs; nvJPEG decodes them on the GPU: channels_last uint8 batches, each
    sample in its place, within 40 dB of the CPU decode of the same bytes (another IDCT)."""
    root, images, _ = jpeg_index_cache(tmp_path / "idx", n=64)
    ds = CachedImageDataset(root)
    order = np.random.default_rng(0).permutation(64)
    dl = DataLoader(ds, batch_size=16, sampler=order.tolist(), num_workers=2, collate_fn=collate_batch,
                    pin_memory=True)
    xs = [x for x, _ in device_loader(dl, device="cuda", decode="cuda")]
    assert ds.decode == "none"
    x = torch.cat(xs)
    assert x.is_cuda and x.dtype == torch.uint8 and x.shape == (64, 3, 32, 32)
    assert xs[0].is_contiguous(memory_format=torch.channels_last)
    nhwc = x.permute(0, 2, 3, 1).cpu().numpy()
    assert np.array_equal(read_index(nhwc), order)
    assert np.abs(nhwc.astype(int) - images[order]).max() <= 2  # flat blocks: nvJPEG's IDCT as exact as any

    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    photos = build(plan, tmp_path / "photos", BuildOptions(size=96, jobs=1, storage="jpeg")).path
    ds = CachedImageDataset(photos)
    cpu = ds.gather(np.arange(len(ds)))
    dl = DataLoader(ds, batch_size=16, num_workers=2, collate_fn=collate_batch, pin_memory=True)
    gpu_x = torch.cat([x for x, _ in device_loader(dl, device="cuda", decode="cuda")])
    psnr = _psnr(gpu_x.permute(0, 2, 3, 1).cpu().numpy(), cpu)
    print(f"nvJPEG vs libjpeg-turbo: median PSNR {np.median(psnr):.1f} dB, min {psnr.min():.1f}")
    assert np.median(psnr) >= 40
    assert read_manifest(photos).storage == "jpeg"
