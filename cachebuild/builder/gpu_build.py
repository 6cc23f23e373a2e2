"""The GPU build path (``--decode-device cuda``): source JPEGs decoded in batches by nvJPEG, resized on the GPU.

Each build worker owns one GPU (claimed for the worker's life with a lock, so several GPUs on a node get
one worker each). For a block it reads its files, checks each header exactly as the CPU path does
(``cachebuild.builder.sample.probe``: size limit, truncation), sends the JPEGs nvJPEG takes to TorchCodec's
``decode_jpeg(list, device="cuda")`` in batches (the optional extra ``torchcodec``: checked before the build
starts, one line without it), keeps the same window of each as the CPU path
(``cachebuild.builder.sample.window``), resizes it with torch's bilinear on the GPU (antialiased from the same
downscale on), and copies the samples back into the storage sink's slots. While the worker hashes and stores
one batch, a background thread prepares the next.

Files nvJPEG cannot take (CMYK or other non-YCbCr JPEGs, lossless or arithmetic-coded ones, PNGs named
``.JPEG``, a progressive file it refuses, CIFAR's decoded arrays), and JPEGs with an EXIF orientation (TorchCodec
always turns them by it; the CPU path turns them as ``--exif-orientation`` says), go through the CPU path
(``cachebuild.builder.sample.decode_into``) in the same worker. Pixels differ slightly from a CPU build (no DCT
reduction, another IDCT and float resampling): close (PSNR >= 40 dB), not byte-equal, so the build key
records the device. This module is imported only when a GPU build is asked for.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from cachebuild.builder.sample import (
    ANTIALIAS_FROM,
    Placement,
    ResizeSpec,
    decode_into,
    exif_orientation,
    letterbox,
    probe,
    scaled_window,
    window,
)
from cachebuild.errors import CacheBuildError, DecodeError

__all__ = ["BATCH", "GpuBlockDecoder", "check_decode_device", "fit_tensor", "gpu_workers", "nvjpeg_can_take",
           "upright"]

BATCH = 64  # sources per nvJPEG call: large enough to fill the GPU's decode, small enough to overlap

_CPU = object()  # marks a source the CPU path decodes


def check_decode_device(device: str) -> None:
    """A one-line error unless ``device`` is one a GPU build can use here."""
    if device != "cuda":
        raise CacheBuildError(f"unknown decode device {device!r}: expected 'cpu' or 'cuda'")
    import torch

    from cachebuild.storage.kinds.jpeg import jpeg_batch_decoder

    if not torch.cuda.is_available():
        raise CacheBuildError(
            f"--decode-device cuda needs a CUDA GPU, and torch {torch.__version__} sees none here; "
            f"build with --decode-device cpu (the default)")
    jpeg_batch_decoder()  # TorchCodec, an optional extra: without it, one line before anything is built


def gpu_workers(device: str) -> tuple[int, str]:
    """(workers, claim folder) for a GPU build: one worker per visible GPU. A one-line error without CUDA."""
    import torch

    check_decode_device(device)
    claim = tempfile.mkdtemp(prefix="cachebuild-gpu-")
    atexit.register(shutil.rmtree, claim, True)
    return torch.cuda.device_count(), claim


_CLAIMED: dict[str, tuple[int, int]] = {}  # claim folder -> (device, fd of the held lock)


def _claim_device(claim: str) -> int:
    """The GPU this worker process owns for the build: the first one whose lock it can take, held until
    the process ends (the kernel releases it). With more workers than GPUs, they share round-robin."""
    if claim in _CLAIMED:
        return _CLAIMED[claim][0]
    import torch

    n = torch.cuda.device_count()
    os.makedirs(claim, exist_ok=True)  # a worker on another host (Dask) has no folder made by the parent
    for k in range(n):
        fd = os.open(os.path.join(claim, f"gpu-{k}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _CLAIMED[claim] = (k, fd)
        return k
    k = os.getpid() % n
    _CLAIMED[claim] = (k, -1)
    return k


def nvjpeg_can_take(data: bytes) -> bool:
    """Whether a JPEG is one nvJPEG decodes to RGB: Huffman-coded baseline, extended or progressive, with
    1 (grey) or 3 (YCbCr) components. CMYK/YCCK (4), lossless and arithmetic-coded files are not."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker in (0xC0, 0xC1, 0xC2) and i + 9 < n and data[i + 9] in (1, 3)
        if marker in (0xDA, 0xD9):
            return False
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return False


_EXIF_SEARCH = 1 << 16  # an EXIF block sits in APP1, right after the start of the file


def upright(data: bytes) -> bool:
    """Whether a JPEG is shown as stored: no EXIF block, or one whose orientation is 1. TorchCodec turns a JPEG
    by its EXIF orientation, always; only upright files are hers to decode, so a sample is the same whatever
    ``--exif-orientation`` says (the others, and any whose EXIF cannot be read, go to the CPU path)."""
    return data.find(b"Exif\x00\x00", 0, _EXIF_SEARCH) < 0 or exif_orientation(data, "JPEG") == 1


def fit_tensor(img: Any, spec: ResizeSpec) -> tuple[Any, tuple[int, int, int, int]]:
    """The CPU path's fit (``cachebuild.builder.sample.decode_into``) of a (3, H, W) uint8 tensor on any device:
    (3, S, S), box. The same window, scale and filter policy, in float arithmetic."""
    import torch
    import torch.nn.functional as F

    h, w = int(img.shape[1]), int(img.shape[2])
    s = spec.size
    box = letterbox(h, w, s) if spec.fit == "pad" else (0, 0, s, s)
    oh, ow = box[2] - box[0], box[3] - box[1]
    win = window(h, w, spec)
    x = img[None].float()
    if spec.interpolation == "area" and oh <= h and ow <= w:  # of the window in whole pixels, as the CPU's
        y0, x0, y1, x1 = (round(v) for v in win)
        y = F.interpolate(x[:, :, y0:y1, x0:x1], size=(oh, ow), mode="area")[0]
    else:
        sy, sx, top, left = scaled_window(win, oh, ow)
        aa = spec.interpolation == "antialias" and max(1 / sy, 1 / sx) >= ANTIALIAS_FROM
        y = F.interpolate(x, scale_factor=(sy, sx), mode="bilinear", antialias=aa, recompute_scale_factor=False)
        y = y[0, :, top : top + oh, left : left + ow]
        if tuple(y.shape[1:]) != (oh, ow):  # an extent that rounds past the image's edge: its last row again
            y = F.pad(y[None], (0, ow - y.shape[2], 0, oh - y.shape[1]), mode="replicate")[0]
    pixels = y.round_().clamp_(0, 255).to(torch.uint8)
    if spec.fit != "pad":
        return pixels, box
    out = torch.zeros((3, s, s), dtype=torch.uint8, device=img.device)
    out[:, box[0] : box[2], box[1] : box[3]] = pixels
    return out, box


class GpuBlockDecoder:
    """``fill(i, key, slot) -> Placement`` for the sources of one block, decoded in batches on a GPU.

    ``device`` defaults to the GPU this worker claims in ``claim``; pass ``"cpu"`` to run the same code on
    the CPU (TorchCodec's CPU decoder standing in for nvJPEG), as the tests without a GPU do.
    """

    def __init__(self, plan_reader: Any, keys: list[str], start: int, spec: ResizeSpec, claim: str = "",
                 device: str | None = None, batch: int = BATCH) -> None:
        import torch

        if device is None:
            device = f"cuda:{_claim_device(claim)}"
            torch.cuda.set_device(torch.device(device))
        self.device = torch.device(device)
        self.reader, self.keys, self.start, self.spec, self.batch = plan_reader, keys, start, spec, batch
        self.done: dict[int, Any] = {}  # position -> (pixels (S, S, 3), Placement) | (_CPU, data) | exception
        self.pending: dict[int, Future[dict[int, Any]]] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="gpu-build")
        self.gpu_samples = self.cpu_samples = 0

    def __call__(self, i: int, key: str, slot: np.ndarray) -> Placement:
        if i not in self.done:
            lo = i - i % self.batch
            fut = self.pending.pop(lo, None) or self.pool.submit(self._decode_batch, lo)
            nxt = lo + self.batch
            if nxt < len(self.keys):  # the next batch decodes while this one is hashed and stored
                self.pending[nxt] = self.pool.submit(self._decode_batch, nxt)
            else:
                self.pool.shutdown(wait=False)
            self.done = fut.result()
        got = self.done.pop(i)
        if isinstance(got, BaseException):
            raise got
        first, second = got
        if first is _CPU:
            self.cpu_samples += 1
            return decode_into(second, self.spec, slot, path=key)
        slot[...] = first
        self.gpu_samples += 1
        return second

    def _decode_batch(self, lo: int) -> dict[int, Any]:
        import torch

        from cachebuild.storage.kinds.jpeg import decode_jpegs

        done: dict[int, Any] = {}
        gpu: list[tuple[int, bytes, int, int]] = []
        for i in range(lo, min(lo + self.batch, len(self.keys))):
            key = self.keys[i]
            try:
                data = self.reader(self.start + i, key)
                if isinstance(data, np.ndarray):  # already-decoded pixels (CIFAR)
                    done[i] = (_CPU, data)
                    continue
                h, w, fmt = probe(data, self.spec.max_pixels)
            except ValueError as e:
                done[i] = DecodeError(key, str(e))
                continue
            except OSError as e:
                done[i] = e
                continue
            if fmt == "JPEG" and nvjpeg_can_take(data) and upright(data):
                gpu.append((i, data, h, w))
            else:
                done[i] = (_CPU, data)
        if not gpu:
            return done
        tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for _, d, _, _ in gpu]
        try:
            images = decode_jpegs(tensors, self.device)
        except (RuntimeError, ValueError):  # one file nvJPEG refuses fails the batch: find it, one by one
            images = []
            for t in tensors:
                try:
                    images.append(decode_jpegs(t, self.device))
                except (RuntimeError, ValueError):
                    images.append(None)
        kept, out = [], []
        for (i, data, h, w), img in zip(gpu, images, strict=True):
            if img is None or tuple(img.shape) != (3, h, w):
                done[i] = (_CPU, data)  # refused, or not what its header declares: the CPU path decides
                continue
            pixels, box = fit_tensor(img, self.spec)
            kept.append((i, Placement(h, w, box)))
            out.append(pixels)
        if out:
            host = torch.stack(out).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # (B, S, S, 3)
            for (i, placed), pixels in zip(kept, host, strict=True):
                done[i] = (pixels, placed)
        return done
