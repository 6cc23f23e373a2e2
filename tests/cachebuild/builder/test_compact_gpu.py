"""GPU paths of compact caches: the ``--decode-device cuda`` build and nvJPEG decoding in ``device_loader``.

Both decode through TorchCodec (``torchcodec.decoders.decode_jpeg``, the optional extra ``torchcodec``). Without a
GPU their code runs on the CPU, through TorchCodec's CPU decoder (libjpeg-turbo) in nvJPEG's place (the test extra
installs torchcodec): batching, CPU fallbacks, geometry, the pixels and its place in the pipeline are tested here.
The tests marked ``gpu`` run the same on CUDA (``.ci/gpu-checks``) and skip cleanly without it.
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
from tests.repo import REPO

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
    within 40 dB of the CPU path; CMYK, PNG-named-JPEG and the EXIF-rotated JPEG go to the CPU fallback."""
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
    assert gpu_fill.cpu_samples == 3 and gpu_fill.gpu_samples == len(ok) - 3  # the CMYK, the PNG, the EXIF one


@pytest.mark.parametrize("exif", ["ignore", "apply"])
def test_an_exif_rotated_jpeg_is_the_cpu_paths_in_a_gpu_build(imagenet_tree, exif):
    """TorchCodec turns a JPEG by its EXIF orientation, always: the GPU build leaves such a file to the CPU path,
    which turns it as --exif-orientation says; an upright one is TorchCodec's."""
    rotated, plain = imagenet_tree["quirks"]["exif"]["path"], imagenet_tree["train"][0]["path"]
    assert gpu_build.upright(plain.read_bytes()) and not gpu_build.upright(rotated.read_bytes())
    files = [rotated, plain]
    spec = ResizeSpec(size=48, exif_orientation=exif)
    fill = gpu_build.GpuBlockDecoder(lambda i, key: files[i].read_bytes(), ["r", "p"], 0, spec, device="cpu")
    got = np.zeros((2, 48, 48, 3), np.uint8)
    placed = [fill(i, k, got[i]) for i, k in enumerate(["r", "p"])]
    ref = np.zeros_like(got)
    assert placed[0] == decode_into(rotated.read_bytes(), spec, ref[0])
    assert np.array_equal(got[0], ref[0]) and (fill.cpu_samples, fill.gpu_samples) == (1, 1)


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
    """loaders.cuda_decode run with TorchCodec's CPU decoder: one batched call, each sample in its place,
    NCHW channels_last like raw batches, exactly the pixels the CPU decode-on-read (simplejpeg) serves."""
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


def test_both_gpu_paths_decode_through_torchcodec_and_never_torchvision(imagenet_tree, tmp_path, monkeypatch):
    """The GPU build and the compact cache's nvJPEG batches call TorchCodec's decode_jpeg, a batch per call, and
    nothing of ours calls torchvision's image decoders (deprecated since torchvision 0.29)."""
    import re
    import sys

    from loaders.cuda_decode import decode_on_cuda
    from loaders.encoded import EncodedImages

    decoders = sys.modules["torchcodec.decoders"]
    calls: list[int] = []
    real = decoders.decode_jpeg

    def counted(source, **kw):
        calls.append(len(source) if isinstance(source, list) else 1)
        return real(source, **kw)

    monkeypatch.setattr(decoders, "decode_jpeg", counted)
    plan = imagenet_plans(imagenet_tree["root"], "train")[0]
    fill = gpu_build.GpuBlockDecoder(plan.reader, list(plan.keys), 0, ResizeSpec(size=32), device="cpu", batch=16)
    _decode_all(fill, plan, ResizeSpec(size=32))
    assert sum(calls) == fill.gpu_samples and max(calls) > 1
    root, _images, _ = jpeg_index_cache(tmp_path / "c", n=12)
    ds = CachedImageDataset(root)
    data, offsets = ds._images.read_encoded(np.arange(12))
    calls.clear()
    decode_on_cuda(EncodedImages(torch.from_numpy(data), torch.from_numpy(offsets), ds.shape).payloads(), ds.shape,
                   torch.device("cpu"))
    assert calls == [12]
    ours = [p for folder in ("cachebuild", "loaders") for p in (REPO / folder).rglob("*.py")]
    assert not [p for p in ours if re.search(r"torchvision\.io|from torchvision import io", p.read_text())]


_WITHOUT_TORCHCODEC = """
import sys
sys.modules["torchcodec"] = None  # import torchcodec: ImportError, as where it is not installed
import torch
torch.cuda.is_available = lambda: True  # as on a GPU machine: the extra is what is missing
from click.testing import CliRunner
from torch.utils.data import DataLoader
from cachebuild.cli import main
from loaders import CachedImageDataset, collate_batch, device_loader
try:
    device_loader(DataLoader(CachedImageDataset(sys.argv[1]), batch_size=4, collate_fn=collate_batch), "cuda",
                  decode="cuda")
except ImportError as e:
    print(type(e).__name__, e)
r = CliRunner().invoke(main, ["folder", sys.argv[2], "--size", "16", "--out", sys.argv[3], "--decode-device", "cuda"])
print(r.exit_code)
print(r.output.strip())
"""


def test_without_torchcodec_both_gpu_paths_are_one_line_naming_the_extra(imagenet_clean, tmp_path):
    root, _, _ = jpeg_index_cache(tmp_path / "c", n=8)
    r = subprocess.run([sys.executable, "-c", _WITHOUT_TORCHCODEC, str(root), str(imagenet_clean["train_dir"]),
                        str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loader_error, code, *build_output = r.stdout.strip().splitlines()
    for line in (loader_error, *build_output):
        assert "pip install 'cachebuild[torchcodec]'" in line and "nvJPEG" in line, line
    assert loader_error.startswith("MissingExtraError")
    assert code == "1" and len(build_output) == 1 and not (tmp_path / "out").exists()


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
