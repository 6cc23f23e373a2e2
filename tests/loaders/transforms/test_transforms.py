"""Tests for loaders.transforms: one harness for every kernel (torchvision's check_kernel idea),
per-sample independence, torchvision-matching distributions and values, bad input, presets.

CUDA tests carry ``@pytest.mark.gpu``: deselected by default, skipped without CUDA (tests/conftest.py).
"""

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TVF
from torch import Tensor

from loaders.transforms import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    cifar_eval,
    cifar_train,
    imagenet_eval,
    imagenet_train,
)
from loaders.transforms import functional as TF
from tests.box_checks import assert_same_distribution, torchvision_boxes


def make_images(n: int, h: int, w: int, dtype: torch.dtype = torch.uint8, device: str = "cpu", seed: int = 0) -> Tensor:
    """A channels_last (N, 3, H, W) batch, viewed from an NHWC buffer as the loader delivers it.
    Sample i carries i in its first pixel (FFCV's trick) so a mix-up of samples shows."""
    g = torch.Generator().manual_seed(seed)
    nhwc = torch.randint(0, 256, (n, h, w, 3), generator=g, dtype=torch.uint8)
    nhwc[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)
    x = nhwc.permute(0, 3, 1, 2)
    if dtype != torch.uint8:
        x = x.to(dtype) / 255
    return x.to(device)


def scripted(fn: Any) -> Any:
    return torch.jit.script(fn)  # TorchScript deprecation warnings are filtered in pyproject.toml


# --------------------------------------------------------------------------------------------------
# one harness for every kernel


class KernelCase:
    """A kernel call: images, per-sample tensor args (leading N), static args, expected out dtype."""

    def __init__(
        self,
        name: str,
        kernel: Callable[..., Tensor],
        make: Callable[[int, str], tuple[Tensor, dict[str, Tensor | None], dict[str, Any]]],
        out_dtype: torch.dtype | None = None,
        atol: float = 0.0,
        cuda_atol: float = 0.0,
    ) -> None:
        self.name, self.kernel, self.make = name, kernel, make
        self.out_dtype, self.atol, self.cuda_atol = out_dtype, atol, cuda_atol

    def __repr__(self) -> str:
        return self.name


def _crops(n: int) -> Tensor:
    # Up- and down-scaling boxes, some touching the border, one degenerate (clipped to 1 px).
    base = torch.tensor([[0, 0, 40, 30], [5, 7, 12, 9], [20, 10, 20, 38], [39, 47, 1, 1], [3, 0, 30, 48]])
    return base[torch.arange(n) % len(base)]


def _flips(n: int) -> Tensor:
    return torch.arange(n) % 3 == 1


def _rc(method: str, dtype: torch.dtype, antialias: bool = False) -> Callable[[int, str], Any]:
    def make(n: int, device: str) -> Any:
        return (
            make_images(n, 40, 48, dtype, device),
            {"crops": _crops(n).to(device), "flips": _flips(n).to(device)},
            {"size": [24, 20], "antialias": antialias, "method": method},
        )

    return make


KERNEL_CASES = [
    # uint8 per-sample (CPU path) vs batched float (GPU path) differ by rounding only: 1 level.
    KernelCase("resized_crop-auto-uint8", TF.resized_crop, _rc("auto", torch.uint8), cuda_atol=1),
    KernelCase("resized_crop-batched-uint8", TF.resized_crop, _rc("batched", torch.uint8), cuda_atol=1),
    KernelCase("resized_crop-per_sample-uint8", TF.resized_crop, _rc("per_sample", torch.uint8), cuda_atol=1),
    KernelCase(
        "resized_crop-batched-float",
        TF.resized_crop,
        _rc("batched", torch.float32),
        atol=1e-6,
        cuda_atol=1e-5,
    ),
    KernelCase(
        "resized_crop-per_sample-float",
        TF.resized_crop,
        _rc("per_sample", torch.float32),
        atol=1e-6,
        cuda_atol=1e-5,
    ),
    KernelCase("resized_crop-antialias-uint8", TF.resized_crop, _rc("auto", torch.uint8, True), cuda_atol=1),
    KernelCase(
        "horizontal_flip",
        TF.horizontal_flip,
        lambda n, d: (make_images(n, 9, 7, device=d), {"flips": _flips(n).to(d)}, {}),
    ),
    KernelCase(
        "padded_crop",
        TF.padded_crop,
        lambda n, d: (
            make_images(n, 32, 32, device=d),
            {"offsets": (torch.arange(2 * n).view(n, 2) * 3 % 9).to(d), "flips": _flips(n).to(d)},
            {"size": [32, 32], "padding": 4},
        ),
    ),
    KernelCase("center_crop", TF.center_crop, lambda n, d: (make_images(n, 30, 41, device=d), {}, {"size": [20, 44]})),
    KernelCase(
        "resize-uint8",
        TF.resize,
        lambda n, d: (make_images(n, 30, 41, device=d), {}, {"size": [20]}),
        cuda_atol=1,
    ),
    KernelCase(
        "resize-float",
        TF.resize,
        lambda n, d: (make_images(n, 30, 41, torch.float32, d), {}, {"size": [33, 17], "antialias": False}),
        atol=1e-6,
        cuda_atol=1e-5,
    ),
    KernelCase(
        "normalize-float32",
        TF.normalize,
        lambda n, d: (
            make_images(n, 9, 7, device=d),
            {},
            {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        ),
        out_dtype=torch.float32,
        atol=1e-6,
        cuda_atol=1e-5,
    ),
    KernelCase(
        "normalize-bfloat16",
        TF.normalize,
        lambda n, d: (
            make_images(n, 9, 7, device=d),
            {},
            {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "dtype": torch.bfloat16},
        ),
        out_dtype=torch.bfloat16,
        atol=1e-2,
        cuda_atol=2e-2,
    ),
]


def _call(
    case: KernelCase,
    kernel: Callable[..., Tensor],
    images: Tensor,
    per: dict[str, Any],
    static: dict[str, Any],
) -> Tensor:
    return kernel(images, **per, **static)


def _assert_close(a: Tensor, b: Tensor, atol: float) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if atol == 0:
        assert torch.equal(a.cpu(), b.cpu())
    else:
        diff = (a.cpu().double() - b.cpu().double()).abs().max().item() if a.numel() else 0.0
        assert diff <= atol, f"max abs diff {diff} > {atol}"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=repr)
def test_kernel_harness(case: KernelCase) -> None:
    n = 7
    images, per, static = case.make(n, "cpu")
    before = images.clone()
    out = _call(case, case.kernel, images, per, static)
    # no in-place mutation; dtype and device kept (normalize: the requested dtype); channels_last
    assert torch.equal(images, before)
    assert out.dtype == (case.out_dtype or images.dtype)
    assert out.device == images.device
    assert out.shape[:2] == (n, 3)
    assert out.is_contiguous(memory_format=torch.channels_last)
    # batched equals one-by-one
    for i in range(n):
        one = _call(case, case.kernel, images[i : i + 1], {k: v[i : i + 1] for k, v in per.items()}, static)
        _assert_close(out[i : i + 1], one, case.atol)
    # empty batch
    empty = _call(case, case.kernel, images[:0], {k: v[:0] for k, v in per.items()}, static)
    assert empty.shape == (0, *out.shape[1:]) and empty.dtype == out.dtype
    # NCHW-contiguous input gives the same values as the channels_last view
    _assert_close(_call(case, case.kernel, images.contiguous(), per, static), out, case.atol)
    # scripted equals eager (TorchScript may fuse a multiply-add: 1 ulp on floats)
    _assert_close(_call(case, scripted(case.kernel), images, per, static), out, case.atol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES, ids=repr)
def test_kernel_cuda_equals_cpu(case: KernelCase) -> None:
    images, per, static = case.make(7, "cpu")
    cpu = _call(case, case.kernel, images, per, static)
    cuda_images = images.cuda()
    before = cuda_images.clone()
    out = _call(case, case.kernel, cuda_images, {k: v.cuda() for k, v in per.items()}, static)
    assert torch.equal(cuda_images, before)
    assert out.device.type == "cuda" and out.dtype == cpu.dtype
    _assert_close(out, cpu, max(case.atol, case.cuda_atol))
    _assert_close(
        _call(case, scripted(case.kernel), cuda_images, {k: v.cuda() for k, v in per.items()}, static),
        out,
        case.atol,
    )


# --------------------------------------------------------------------------------------------------
# values against torchvision


BOXES = [(0, 0, 40, 48), (5, 7, 12, 9), (20, 10, 20, 38), (3, 0, 30, 48), (0, 17, 40, 5)]


@pytest.mark.parametrize("method", ["per_sample", "batched"])
def test_resized_crop_matches_torchvision_uint8(method: str) -> None:
    # torchvision's CPU uint8 bilinear kernel uses fixed-point weights: we match within 1 level.
    images = make_images(len(BOXES), 40, 48)
    crops = torch.tensor(BOXES)
    for size in ([24, 20], [64, 80]):  # downscale and upscale
        out = TF.resized_crop(images, crops, size, method=method)
        for i, (t, l, h, w) in enumerate(BOXES):
            ref = TVF.resized_crop(images[i], t, l, h, w, size, antialias=False)
            diff = (out[i].int() - ref.int()).abs()
            assert diff.max() <= 1 and diff.float().mean() < 0.3, (size, BOXES[i], diff.float().mean())


@pytest.mark.parametrize("method", ["per_sample", "batched"])
def test_resized_crop_matches_torchvision_float(method: str) -> None:
    images = make_images(len(BOXES), 40, 48, torch.float32)
    flips = torch.tensor([True, False, True, False, True])
    out = TF.resized_crop(images, torch.tensor(BOXES), [24, 52], flips, method=method)
    for i, (t, l, h, w) in enumerate(BOXES):
        ref = TVF.resized_crop(images[i], t, l, h, w, [24, 52], antialias=False)
        ref = ref.flip(-1) if flips[i] else ref
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=0)


def test_resized_crop_antialias_difference() -> None:
    # Default antialias=False = torchvision's resized_crop(antialias=False). antialias=True low-pass
    # filters on downscale: far from the default there, and matches torchvision's antialias=True.
    images = make_images(2, 200, 200)
    crops = torch.tensor([[0, 0, 200, 200], [10, 20, 150, 120]])
    plain = TF.resized_crop(images, crops, [32, 32])
    smooth = TF.resized_crop(images, crops, [32, 32], antialias=True)
    for i in range(2):
        t, l, h, w = crops[i].tolist()
        ref = TVF.resized_crop(images[i], t, l, h, w, [32, 32], antialias=True)
        assert (smooth[i].int() - ref.int()).abs().max() <= 1
    assert (plain.float() - smooth.float()).abs().mean() > 10  # random pixels: aliasing is large


def test_normalize_matches_torchvision() -> None:
    images = make_images(4, 9, 11)
    ref = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(T.ConvertImageDtype(torch.float32)(images))
    out = TF.normalize(images, list(IMAGENET_MEAN), list(IMAGENET_STD))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    floats = images.float() / 255  # float input is taken to be in [0, 1], as torchvision does
    torch.testing.assert_close(TF.normalize(floats, list(IMAGENET_MEAN), list(IMAGENET_STD)), ref, atol=1e-5, rtol=0)
    half = TF.normalize(images, list(IMAGENET_MEAN), list(IMAGENET_STD), torch.bfloat16)
    torch.testing.assert_close(half.float(), ref, atol=2e-2, rtol=1e-2)


def test_padded_crop_center_crop_resize_match_torchvision() -> None:
    images = make_images(3, 32, 32)
    offsets = torch.tensor([[0, 8], [4, 4], [7, 1]])
    out = TF.padded_crop(images, offsets, [32, 32], 4)
    for i, (t, l) in enumerate(offsets.tolist()):
        assert torch.equal(out[i], TVF.crop(TVF.pad(images[i], [4]), t, l, 32, 32))
    odd = make_images(2, 30, 41)
    for size in ([20, 44], [25, 25], [30, 41]):
        assert torch.equal(TF.center_crop(odd, size), TVF.center_crop(odd, size))
    for size in ([20], [33, 17]):
        ref = TVF.resize(odd, size, antialias=True)
        assert (TF.resize(odd, size).int() - ref.int()).abs().max() <= 1


# --------------------------------------------------------------------------------------------------
# per-sample randomness


def _binomial_ok(k: int, n: int, p: float) -> bool:
    return abs(k - n * p) <= 5 * math.sqrt(n * p * (1 - p))  # 5 sigma: a false alarm is ~1e-6


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_flip_is_per_sample(p: float) -> None:
    one = make_images(1, 6, 8)
    batch = one.expand(1024, -1, -1, -1)
    out = RandomHorizontalFlip(p, generator=torch.Generator().manual_seed(1))(batch)
    flipped = (out == one.flip(-1)).flatten(1).all(1)
    same = (out == one).flatten(1).all(1)
    assert bool((flipped ^ same).all())  # every sample is either flipped or untouched
    k = int(flipped.sum())
    assert 0 < k < 1024 and _binomial_ok(k, 1024, p), k


def test_fused_flip_is_per_sample() -> None:
    batch = make_images(1, 16, 16).expand(1024, -1, -1, -1)
    g = torch.Generator().manual_seed(2)
    rrc = RandomResizedCrop(8, flip_p=0.5, generator=g)
    crops, flips = rrc.get_params(batch)
    assert _binomial_ok(int(flips.sum()), 1024, 0.5)
    assert len({tuple(c) for c in crops.tolist()}) > 500  # boxes differ per sample
    g.manual_seed(2)
    out = rrc(batch)
    ref = TF.resized_crop(batch, crops, [8, 8], None).flip(-1)
    assert torch.equal(out[flips], ref[flips])
    offsets, cflips = RandomCrop(32, 4, flip_p=0.5, generator=torch.Generator().manual_seed(3)).get_params(
        make_images(1, 32, 32).expand(1024, -1, -1, -1)
    )
    assert len({tuple(o) for o in offsets.tolist()}) == 81 and _binomial_ok(int(cflips.sum()), 1024, 0.5)


# (50, 1000): the 10 tries mostly fail and the centre-crop fallback (too wide) triggers.
@pytest.mark.parametrize(
    "hw",
    [
        (256, 256),
        (50, 1000),
        pytest.param((1000, 50), marks=pytest.mark.slow),
        pytest.param((375, 500), marks=pytest.mark.slow),
    ],
)
def test_rrc_distribution_matches_torchvision(hw: tuple[int, int]) -> None:
    h, w = hw
    n = 20_000
    theirs = torchvision_boxes(h, w, n, seed=0)
    images = torch.empty(1, 3, h, w, dtype=torch.uint8).expand(n, -1, -1, -1)  # only the shape is read
    ours, _ = RandomResizedCrop(224, generator=torch.Generator().manual_seed(0)).get_params(images)
    assert bool((ours[:, 0] >= 0).all() and (ours[:, 0] + ours[:, 2] <= h).all())
    assert bool((ours[:, 1] >= 0).all() and (ours[:, 1] + ours[:, 3] <= w).all())
    assert_same_distribution(ours, theirs, h, w)


def test_rrc_draws_inside_valid_boxes() -> None:
    # --fit pad: the real image is a box inside the padded sample; crops behave as if it were the image.
    n = 20_000
    images = torch.empty(1, 3, 64, 80, dtype=torch.uint8).expand(n, -1, -1, -1)
    boxes = torch.tensor([[8, 0, 56, 80], [0, 10, 64, 70]]).repeat(n // 2, 1)  # (y0, x0, y1, x1)
    crops, _ = RandomResizedCrop(32, generator=torch.Generator().manual_seed(4)).get_params(images, boxes)
    assert bool((crops[:, 0] >= boxes[:, 0]).all() and (crops[:, 0] + crops[:, 2] <= boxes[:, 2]).all())
    assert bool((crops[:, 1] >= boxes[:, 1]).all() and (crops[:, 1] + crops[:, 3] <= boxes[:, 3]).all())
    first = crops[0::2] - torch.tensor([8, 0, 0, 0])  # box-local coords of a 48x80 image
    assert_same_distribution(first, torchvision_boxes(48, 80, 5_000, seed=1), 48, 80)
    # preset path: boxes flow through Compose to the crop. Outside its box every sample is white, inside
    # black: a crop that strayed outside (boxes dropped on the way) would carry white into the output.
    padded = torch.full((8, 64, 80, 3), 255, dtype=torch.uint8)
    for i, (y0, x0, y1, x1) in enumerate(boxes[:8].tolist()):
        padded[i, y0:y1, x0:x1] = 0
    out = imagenet_train(16, generator=torch.Generator().manual_seed(0))(padded.permute(0, 3, 1, 2), boxes[:8])
    black = torch.tensor(IMAGENET_MEAN).neg().div(torch.tensor(IMAGENET_STD))[None, :, None, None]
    assert out.shape == (8, 3, 16, 16)
    torch.testing.assert_close(out, black.expand_as(out), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------
# modules: determinism, scripting, presets


def _modules() -> list[tuple[str, Callable[[torch.Generator | None], torch.nn.Module], tuple[int, int]]]:
    return [
        ("RandomResizedCrop", lambda g: RandomResizedCrop(24, flip_p=0.5, generator=g), (40, 48)),
        (
            "RandomResizedCrop-batched",
            lambda g: RandomResizedCrop(24, method="batched", generator=g),
            (40, 48),
        ),
        ("RandomHorizontalFlip", lambda g: RandomHorizontalFlip(generator=g), (40, 48)),
        ("RandomCrop", lambda g: RandomCrop(32, padding=4, flip_p=0.5, generator=g), (32, 32)),
        ("imagenet_train", lambda g: imagenet_train(24, generator=g), (40, 48)),
        ("imagenet_train-bf16", lambda g: imagenet_train(24, torch.bfloat16, generator=g), (40, 48)),
        ("imagenet_eval", lambda g: imagenet_eval(24), (40, 48)),
        ("cifar_train", lambda g: cifar_train(generator=g), (32, 32)),
        ("cifar_eval", lambda g: cifar_eval(), (32, 32)),
    ]


@pytest.mark.parametrize("name,factory,hw", _modules(), ids=[m[0] for m in _modules()])
def test_module_seeded_eager_and_scripted(name: str, factory: Any, hw: tuple[int, int]) -> None:
    images = make_images(16, *hw)
    before = images.clone()
    g = torch.Generator()
    module = factory(g)
    script = scripted(factory(g))  # same generator object, shared by both
    g.manual_seed(7)
    a = module(images)
    g.manual_seed(7)
    b = module(images)
    g.manual_seed(7)
    c = script(images)
    assert torch.equal(a, b)  # same seed, same batch
    torch.testing.assert_close(c, a, atol=1e-6, rtol=0)  # scripted = eager (1 ulp: fused multiply-add)
    assert torch.equal(images, before)
    # global RNG
    plain = factory(None)
    torch.manual_seed(3)
    d = plain(images)
    torch.manual_seed(3)
    assert torch.equal(plain(images), d)
    assert plain(images[:0]).shape[0] == 0


def test_presets_output() -> None:
    out = imagenet_train(32)(make_images(5, 48, 40))
    assert out.shape == (5, 3, 32, 32) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert imagenet_train(32, torch.bfloat16)(make_images(2, 48, 40)).dtype == torch.bfloat16
    ev = imagenet_eval(224)(make_images(2, 256, 256))
    ref = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(
        T.ConvertImageDtype(torch.float32)(TVF.center_crop(make_images(2, 256, 256), [224, 224]))
    )
    torch.testing.assert_close(ev, ref, atol=1e-5, rtol=0)  # a 256 cache: resize is a no-op
    c = cifar_eval()(make_images(2, 32, 32))
    ref = T.Normalize(CIFAR10_MEAN, CIFAR10_STD)(T.ConvertImageDtype(torch.float32)(make_images(2, 32, 32)))
    torch.testing.assert_close(c, ref, atol=1e-5, rtol=0)


def test_compose_passes_boxes_until_first_geometric() -> None:
    seen: list[Tensor | None] = []

    class Spy(RandomHorizontalFlip):
        def forward(self, images: Tensor, boxes: Tensor | None = None) -> Tensor:
            seen.append(boxes)
            return images

    spy1, spy2 = Spy(), Spy()
    spy1.geometric = False
    boxes = torch.tensor([[0, 0, 4, 4]])
    Compose([spy1, CenterCrop(4), spy2])(make_images(1, 6, 6), boxes)
    assert seen[0] is boxes and seen[1] is None
    with pytest.raises(TypeError, match="BatchTransform"):
        Compose([torch.nn.Identity()])


# --------------------------------------------------------------------------------------------------
# bad input: clear TypeError/ValueError naming what was expected and what was received


BAD_CALLS = [
    (
        "int32 images",
        lambda: RandomResizedCrop(8)(torch.zeros(2, 3, 8, 8, dtype=torch.int32)),
        TypeError,
        "int32",
    ),
    (
        "3-D images",
        lambda: RandomResizedCrop(8)(torch.zeros(3, 8, 8, dtype=torch.uint8)),
        ValueError,
        r"\[3, 8, 8\]",
    ),
    (
        "NHWC images",
        lambda: imagenet_train(8)(torch.zeros(2, 8, 8, 3, dtype=torch.uint8)),
        ValueError,
        "3 channels",
    ),
    (
        "1 channel",
        lambda: Normalize([0.5] * 3, [0.5] * 3)(torch.zeros(2, 1, 8, 8, dtype=torch.uint8)),
        ValueError,
        "3 channels",
    ),
    ("size 0", lambda: RandomResizedCrop(0), ValueError, "> 0"),
    ("size -1", lambda: CenterCrop([-1, 4]), ValueError, "> 0"),
    ("size float", lambda: RandomCrop(3.5), TypeError, "int"),
    (
        "kernel size",
        lambda: TF.resized_crop(make_images(1, 8, 8), torch.zeros(1, 4, dtype=torch.int64), [0, 4]),
        ValueError,
        "> 0",
    ),
    ("scale order", lambda: RandomResizedCrop(8, scale=(1.0, 0.08)), ValueError, r"\(1.0, 0.08\)"),
    ("ratio order", lambda: RandomResizedCrop(8, ratio=(4 / 3, 3 / 4)), ValueError, "min <= max"),
    ("scale <= 0", lambda: RandomResizedCrop(8, scale=(0.0, 1.0)), ValueError, "0 < min"),
    ("flip p", lambda: RandomHorizontalFlip(1.5), ValueError, r"\[0, 1\]"),
    (
        "boxes shape",
        lambda: RandomResizedCrop(8)(make_images(2, 8, 8), torch.zeros(2, 2, dtype=torch.int64)),
        ValueError,
        r"\[2, 4\]",
    ),
    (
        "boxes float",
        lambda: RandomResizedCrop(8)(make_images(2, 8, 8), torch.zeros(2, 4)),
        TypeError,
        "integer",
    ),
    (
        "crops shape",
        lambda: TF.resized_crop(make_images(2, 8, 8), torch.zeros(3, 4, dtype=torch.int64), [4, 4]),
        ValueError,
        r"\[2, 4\]",
    ),
    ("flips dtype", lambda: TF.horizontal_flip(make_images(2, 8, 8), torch.zeros(2)), ValueError, "bool"),
    ("std 0", lambda: Normalize([0.5] * 3, [0.5, 0.0, 0.5]), ValueError, "> 0"),
    ("norm dtype", lambda: Normalize([0.5] * 3, [0.5] * 3, dtype=torch.int64), TypeError, "int64"),
    ("method", lambda: RandomResizedCrop(8, method="fast"), ValueError, "fast"),
    ("generator", lambda: RandomHorizontalFlip(generator=0), TypeError, "Generator"),
    ("crop too big", lambda: RandomCrop(48, padding=4)(make_images(1, 32, 32)), ValueError, "40, 40"),
]


@pytest.mark.parametrize("what,call,exc,match", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input(what: str, call: Callable[[], Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match) as info:
        call()
    msg = str(info.value)
    assert "expected" in msg and "got" in msg, msg


def test_bad_input_scripted() -> None:
    # TorchScript re-raises as torch.jit.Error; the message keeps the original type and text.
    with pytest.raises(torch.jit.Error, match="ValueError: images: expected 3 channels"):
        scripted(imagenet_train(8))(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------------
# torch.compile (slow: each compile takes 10-30 s on 2 cores) and CUDA modules


@pytest.mark.slow
def test_compiled_preset_matches_eager() -> None:
    images = make_images(8, 40, 48)
    g = torch.Generator()
    eager, compiled = imagenet_train(24, generator=g), torch.compile(imagenet_train(24, generator=g))
    g.manual_seed(5)
    a = eager(images)
    g.manual_seed(5)
    b = compiled(images)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    batched = torch.compile(RandomResizedCrop(24, flip_p=0.5, method="batched", generator=g))
    g.manual_seed(5)
    c = batched(images)
    g.manual_seed(5)
    ref = RandomResizedCrop(24, flip_p=0.5, method="batched", generator=g)(images)
    assert (c.int() - ref.int()).abs().max() <= 1
    ev = make_images(3, 40, 48)
    torch.testing.assert_close(torch.compile(imagenet_eval(24))(ev), imagenet_eval(24)(ev), atol=1e-5, rtol=0)
    flip = torch.compile(RandomHorizontalFlip(generator=g))
    g.manual_seed(6)
    e = flip(ev)
    g.manual_seed(6)
    assert torch.equal(e, RandomHorizontalFlip(generator=g)(ev))
    plain = torch.compile(cifar_train())
    torch.manual_seed(1)
    d = plain(make_images(4, 32, 32))
    torch.manual_seed(1)
    assert torch.equal(plain(make_images(4, 32, 32)), d)


@pytest.mark.gpu
@pytest.mark.parametrize("name,factory,hw", _modules(), ids=[m[0] for m in _modules()])
def test_module_cuda(name: str, factory: Any, hw: tuple[int, int]) -> None:
    images = make_images(16, *hw)
    cuda_images = images.cuda()
    # A CPU generator drives a CUDA batch with the same draws as on CPU.
    g = torch.Generator()
    g.manual_seed(9)
    cpu = factory(g)(images)
    g.manual_seed(9)
    out = factory(g)(cuda_images)
    assert out.device.type == "cuda"
    # uint8: CPU per-sample vs CUDA batched kernel round differently (1 level); floats: that level
    # (1 / (255 * 0.225) = 0.017) plus one bf16 step (0.016 near 2.5).
    tol = 1.0 if cpu.dtype == torch.uint8 else 4e-2
    torch.testing.assert_close(out.cpu().double(), cpu.double(), atol=tol, rtol=0)
    # A CUDA generator: same seed, same batch; scripted = eager.
    gc = torch.Generator(device="cuda")
    module, script = factory(gc), scripted(factory(gc))
    gc.manual_seed(4)
    a = module(cuda_images)
    gc.manual_seed(4)
    b = script(cuda_images)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_resize_module_follows_torchvision_size_rule() -> None:
    # A 1-element sequence is the shorter side, as torchvision's Resize([s]) (the TorchScript-friendly
    # spelling of Resize(s)); it used to give a square [s, s], squashing non-square batches.
    images = make_images(2, 30, 60)
    for size in (20, [20], (20,), [20, 25]):
        ref = T.Resize(size, antialias=True)(images)
        out = Resize(size)(images)
        assert out.shape == ref.shape, (size, out.shape, ref.shape)
        assert (out.int() - ref.int()).abs().max() <= 1
    assert scripted(Resize([20]))(images).shape == (2, 3, 20, 40)


def test_compiled_random_transforms_take_a_short_last_batch() -> None:
    """An epoch's short last batch makes torch.compile retrace with a symbolic batch size; drawing with an
    explicit ``generator=None`` then failed ('SymIntArrayRef expected to contain only concrete integers')
    in every random transform without a private generator, the README's recommended path."""
    tf = torch.compile(RandomHorizontalFlip())
    for n in (8, 8, 3):
        images = make_images(n, 12, 10)
        out = tf(images)
        flipped = torch.flip(images, dims=[3])
        assert out.shape == images.shape
        assert all(torch.equal(o, i) or torch.equal(o, f) for o, i, f in zip(out, images, flipped, strict=True))
