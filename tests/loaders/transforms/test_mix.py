"""Tests for loaders.transforms.mix: torchvision v2 MixUp/CutMix value for value (same seed, and the same
lambda and box forced), label smoothing, MixUpCutMix's per-batch switch, eager = scripted = compiled
(short last batch included), dtype/device kept, and named errors for bad input.

timm's Mixup is compared in tests/test_timm_recipe.py.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision.transforms.v2 as v2
from torch import Tensor

from loaders.transforms import CutMix, MixUp, MixUpCutMix
from loaders.transforms import mix as M


def make_batch(n: int, h: int = 12, w: int = 10, dtype: torch.dtype = torch.float32, seed: int = 0) -> Tensor:
    """channels_last (N, 3, H, W), as the loader delivers it; sample i carries i in its first pixel."""
    g = torch.Generator().manual_seed(seed)
    nhwc = torch.randint(0, 256, (n, h, w, 3), generator=g, dtype=torch.uint8)
    nhwc[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)
    x = nhwc.permute(0, 3, 1, 2)
    return x if dtype == torch.uint8 else x.to(dtype) / 255


def labels_for(n: int, c: int = 5) -> Tensor:
    return (torch.arange(n) * 3) % c


# --------------------------------------------------------------------------------------------------
# torchvision v2, value for value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [7, 8, 1])
@pytest.mark.parametrize("alpha", [0.2, 1.0, 3.0])
@pytest.mark.parametrize("kind", ["MixUp", "CutMix"])
def test_same_seed_same_batch_as_torchvision(kind: str, alpha: float, n: int, dtype: torch.dtype) -> None:
    """With the global RNG, ours draws exactly what torchvision's draws: same images, same targets."""
    ours = (MixUp if kind == "MixUp" else CutMix)(alpha, num_classes=5)
    theirs = getattr(v2, kind)(alpha=alpha, num_classes=5)
    x, y = make_batch(n, 13, 17, dtype), labels_for(n)
    before = x.clone()
    for seed in range(12):
        torch.manual_seed(seed)
        a, ta = ours(x, y)
        torch.manual_seed(seed)
        b, tb = theirs(x, y)
        assert a.dtype == dtype and ta.dtype == torch.float32 and ta.shape == (n, 5)
        assert torch.equal(a, b), (seed, (a - b).abs().max())
        assert torch.equal(ta, tb), seed
    assert torch.equal(x, before)  # never in place


@pytest.mark.parametrize("centre", [(0, 0), (12, 16), (6, 8), (0, 16), (3, 1)])
@pytest.mark.parametrize("lam", [0.05, 0.37, 0.9, 1.0 - 1e-9])
def test_cutmix_kernels_match_torchvision_for_a_given_box(lam: float, centre: tuple[int, int]) -> None:
    """The same lam and centre forced on both: our box is torchvision's (clipped at the border), the lam we
    recompute from the clipped box is its lam_adjusted, and images and targets agree exactly."""
    x, y = make_batch(6, 13, 17), labels_for(6)
    h, w = 13, 17
    lam_t = torch.tensor(lam, dtype=torch.float64)
    box = M.cutmix_box(lam_t, torch.tensor(centre[0]), torch.tensor(centre[1]), h, w)
    # torchvision's make_params with r_y, r_x = centre
    r = 0.5 * (1.0 - lam) ** 0.5
    rh, rw = int(r * h), int(r * w)
    x1, y1 = max(centre[1] - rw, 0), max(centre[0] - rh, 0)
    x2, y2 = min(centre[1] + rw, w), min(centre[0] + rh, h)
    assert box.tolist() == [y1, x1, y2, x2]
    lam_adj = float(1.0 - (x2 - x1) * (y2 - y1) / (w * h))
    assert M.box_lambda(box, h, w).item() == lam_adj
    tv = v2.CutMix(num_classes=5)
    params = {"box": (x1, y1, x2, y2), "lam_adjusted": lam_adj, "labels": y, "batch_size": 6}
    ours = M.mix_images(x, M.box_weight(box, h, w))
    assert torch.equal(ours, tv.transform(x, params))
    assert torch.equal(M.mix_targets(y, 5, M.box_lambda(box, h, w)), tv.transform(y, params))


def test_cutmix_box_area_is_one_minus_lambda_inside_the_image() -> None:
    h, w = 48, 64
    g = torch.Generator().manual_seed(0)
    cut = CutMix(1.0, 5, generator=g)
    x = make_batch(2, h, w)
    for _ in range(30):
        state = g.get_state()
        box, lam = cut.get_box(x)
        y0, x0, y1, x1 = box.tolist()
        assert 0 <= y0 <= y1 <= h and 0 <= x0 <= x1 <= w
        assert lam.item() == pytest.approx(1 - (y1 - y0) * (x1 - x0) / (h * w))
        g.set_state(state)  # the same draws again: the forward pass uses that box
        out, t = cut(x, labels_for(2))
        inside = torch.zeros(h, w, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert torch.equal(out[0][:, inside], x[1][:, inside])  # the partner's pixels (rolled by one)
        assert torch.equal(out[0][:, ~inside], x[0][:, ~inside])  # its own outside
        assert t[0, 0].item() == pytest.approx(lam.item())  # labels 0 and 3: own share = lam


def test_cutmix_box_unclipped_has_torchvision_side() -> None:
    # centred, nothing clipped: sides are 2 * int(0.5 * sqrt(1 - lam) * H), so the area is (1 - lam) H W up to
    # the rounding of those half-sides
    for lam in (0.1, 0.5, 0.75, 0.96):
        box = M.cutmix_box(torch.tensor(lam, dtype=torch.float64), torch.tensor(100), torch.tensor(100), 200, 200)
        side = 2 * int(0.5 * (1 - lam) ** 0.5 * 200)
        assert (box[2] - box[0]).item() == side and (box[3] - box[1]).item() == side
        assert abs(side * side / 200**2 - (1 - lam)) < 2 * 2 / 200


def test_mixup_lambda_is_beta_distributed() -> None:
    from scipy.stats import kstest

    g = torch.Generator().manual_seed(1)
    m = MixUp(0.4, 5, generator=g)
    x = make_batch(2)
    lams = [m.get_params(x)[1].item() for _ in range(400)]
    assert kstest(lams, "beta", args=(0.4, 0.4)).pvalue > 1e-3


# --------------------------------------------------------------------------------------------------
# dtypes, devices, smoothing, pairing


def test_uint8_is_rounded_float_mix_and_low_precision_floats_mix_in_float32() -> None:
    g = torch.Generator()
    x8, y = make_batch(5, dtype=torch.uint8), labels_for(5)
    m = MixUp(1.0, 5, generator=g)
    g.manual_seed(2)
    out, t = m(x8, y)
    g.manual_seed(2)
    ref, tref = m(x8.float(), y)
    assert out.dtype == torch.uint8 and torch.equal(t, tref)
    assert torch.equal(out, ref.round().clamp(0, 255).to(torch.uint8))
    assert out.is_contiguous(memory_format=torch.channels_last)
    xb = make_batch(5, dtype=torch.bfloat16)
    g.manual_seed(2)
    ob, _ = m(xb, y)
    g.manual_seed(2)
    of, _ = m(xb.float(), y)
    assert ob.dtype == torch.bfloat16 and torch.equal(ob, of.to(torch.bfloat16))  # one rounding
    # CutMix copies pixels: exact in any dtype
    c = CutMix(1.0, 5, generator=g)
    g.manual_seed(3)
    o8, _ = c(x8, y)
    g.manual_seed(3)
    of, _ = c(x8.float(), y)
    assert torch.equal(o8.float(), of)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("factory", [lambda s, g: MixUp(1.0, 7, s, generator=g),
                                     lambda s, g: CutMix(1.0, 7, s, generator=g),
                                     lambda s, g: MixUpCutMix(7, label_smoothing=s, generator=g)])
def test_soft_targets_sum_to_one_and_smooth_as_timm(factory: Callable[..., Any], smoothing: float) -> None:
    g = torch.Generator().manual_seed(4)
    m = factory(smoothing, g)
    x, y = make_batch(9), labels_for(9, 7)
    for _ in range(5):
        _, t = m(x, y)
        torch.testing.assert_close(t.sum(1), torch.ones(9), atol=1e-6, rtol=0)
        assert t.min() >= smoothing / 7 - 1e-7
        # each row mixes its own (smoothed) one-hot with its partner's (rolled by one) and nothing else
        lam = t[torch.arange(9), y] - smoothing / 7
        lam_partner = t[torch.arange(9), y.roll(1)] - smoothing / 7
        same = y == y.roll(1)
        torch.testing.assert_close((lam + lam_partner)[~same], torch.full_like(lam[~same], 1 - smoothing),
                                   atol=1e-6, rtol=0)
    # a batch of one is its own partner: unchanged image, smoothed one-hot target
    one, t1 = m(x[:1], y[:1])
    torch.testing.assert_close(one, x[:1], atol=1e-6, rtol=0)
    expect = torch.full((1, 7), smoothing / 7)
    expect[0, y[0]] = 1 - smoothing + smoothing / 7
    torch.testing.assert_close(t1, expect, atol=1e-6, rtol=0)


def test_pairing_flip_mixes_sample_i_with_n_minus_1_minus_i() -> None:
    g = torch.Generator()
    x, y = make_batch(6), labels_for(6)
    g.manual_seed(0)
    out, t = MixUp(1.0, 5, pairing="flip", generator=g)(x, y)
    g.manual_seed(0)
    lam = MixUp(1.0, 5, generator=g).get_params(x)[1].item()
    torch.testing.assert_close(out, lam * x + (1 - lam) * x.flip(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(t[0, y[5]] + t[0, y[0]] * (y[0] != y[5]), torch.tensor(1.0), atol=1e-6, rtol=0)


def _is_cut(w: Tensor) -> bool:
    """A CutMix weight map: 0 in a box, 1 elsewhere (a MixUp one holds one lam everywhere)."""
    return bool(((w == 0) | (w == 1)).all()) and w.min().item() == 0.0


def test_mixupcutmix_switches_per_batch() -> None:
    x, y = make_batch(4, 16, 16), labels_for(4)
    g = torch.Generator().manual_seed(0)
    always_cut = MixUpCutMix(5, switch_prob=1.0, label_smoothing=0.0, generator=g)
    never_cut = MixUpCutMix(5, switch_prob=0.0, label_smoothing=0.0, generator=g)
    off = MixUpCutMix(5, p=0.0, label_smoothing=0.1, generator=g)
    kinds = []
    for _ in range(30):
        w, lam = always_cut.get_params(x)
        assert set(w.unique().tolist()) <= {0.0, 1.0} and w.shape == (1, 1, 16, 16)
        assert lam.item() == pytest.approx(w.mean().item())  # lam = share of the image outside the box
        w, lam = never_cut.get_params(x)
        assert torch.equal(w, torch.full_like(w, lam.item()))  # MixUp: one lam for every pixel
        out, t = off(x, y)
        assert torch.equal(out, x.contiguous(memory_format=torch.channels_last))
        assert torch.allclose(t.max(1).values, torch.full((4,), 0.9 + 0.02))
        w, _ = MixUpCutMix(5, generator=g).get_params(x)
        kinds.append(_is_cut(w))
    assert 5 < sum(kinds) < 25  # both kinds chosen, per batch
    only_cut = MixUpCutMix(5, mixup_alpha=0.0, generator=g)
    assert all(_is_cut(only_cut.get_params(x)[0]) for _ in range(5))


# --------------------------------------------------------------------------------------------------
# eager = scripted = compiled, seeded


def _factories() -> list[tuple[str, Callable[[Any], torch.nn.Module]]]:
    return [
        ("MixUp", lambda g: MixUp(0.8, 5, 0.1, generator=g)),
        ("CutMix", lambda g: CutMix(1.0, 5, 0.1, generator=g)),
        ("MixUpCutMix", lambda g: MixUpCutMix(5, generator=g)),
        ("MixUpCutMix-flip", lambda g: MixUpCutMix(5, pairing="flip", generator=g)),
    ]


@pytest.mark.parametrize("name,factory", _factories(), ids=[f[0] for f in _factories()])
def test_seeded_eager_equals_scripted(name: str, factory: Callable[[Any], torch.nn.Module]) -> None:
    g = torch.Generator()
    eager, script = factory(g), torch.jit.script(factory(g))
    for n in (8, 3, 0):
        x, y = make_batch(n), labels_for(n)
        for seed in range(6):
            g.manual_seed(seed)
            a, ta = eager(x, y)
            g.manual_seed(seed)
            b, tb = script(x, y)
            g.manual_seed(seed)
            c, tc = eager(x, y)
            assert torch.equal(a, b) and torch.equal(ta, tb) and torch.equal(a, c) and torch.equal(ta, tc)
            assert a.shape == x.shape and ta.shape == (n, 5)
    plain = factory(None)
    x, y = make_batch(8), labels_for(8)
    torch.manual_seed(3)
    d = plain(x, y)
    torch.manual_seed(3)
    e = plain(x, y)
    assert torch.equal(d[0], e[0]) and torch.equal(d[1], e[1])


@pytest.mark.slow  # one compile, 15 s; the device transforms' short-last-batch compile test runs by default
def test_compiled_equals_eager_with_a_short_last_batch() -> None:
    """One compile (~10 s on 2 cores): full batches, then the epoch's short last one (a symbolic batch size)."""
    g = torch.Generator()
    eager, compiled = MixUpCutMix(5, generator=g), torch.compile(MixUpCutMix(5, generator=g))
    seen_cut = seen_mix = False
    for seed, n in enumerate((8, 8, 3, 8, 5)):
        x, y = make_batch(n, seed=seed), labels_for(n)
        g.manual_seed(seed)
        a, ta = eager(x, y)
        g.manual_seed(seed)
        b, tb = compiled(x, y)
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        torch.testing.assert_close(tb, ta, atol=1e-6, rtol=0)
        g.manual_seed(seed)
        w = eager.get_params(x)[0]
        seen_cut |= _is_cut(w)
        seen_mix |= not _is_cut(w)
    assert seen_cut and seen_mix, "seeds should exercise both branches"


@pytest.mark.slow
@pytest.mark.parametrize("name,factory", _factories(), ids=[f[0] for f in _factories()])
def test_compiled_equals_eager_every_module(name: str, factory: Callable[[Any], torch.nn.Module]) -> None:
    g = torch.Generator()
    eager, compiled = factory(g), torch.compile(factory(g))
    for seed, (n, dtype) in enumerate([(8, torch.float32), (8, torch.float32), (3, torch.float32),
                                       (6, torch.uint8)]):
        x, y = make_batch(n, dtype=dtype), labels_for(n)
        g.manual_seed(seed)
        a, ta = eager(x, y)
        g.manual_seed(seed)
        b, tb = compiled(x, y)
        assert b.dtype == a.dtype
        torch.testing.assert_close(b.double(), a.double(), atol=1e-6 if dtype != torch.uint8 else 1, rtol=0)
        torch.testing.assert_close(tb, ta, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name,factory", _factories(), ids=[f[0] for f in _factories()])
def test_cuda_batch(name: str, factory: Callable[[Any], torch.nn.Module]) -> None:
    x, y = make_batch(8), labels_for(8)
    g = torch.Generator().manual_seed(5)
    cpu = factory(g)(x, y)
    g.manual_seed(5)
    out = factory(g)(x.cuda(), y.cuda())  # a CPU generator drives a CUDA batch with the same draws
    assert out[0].device.type == "cuda" and out[1].device.type == "cuda"
    torch.testing.assert_close(out[0].cpu(), cpu[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1].cpu(), cpu[1], atol=1e-6, rtol=0)
    gc = torch.Generator(device="cuda")
    eager, script = factory(gc), torch.jit.script(factory(gc))
    gc.manual_seed(4)
    a = eager(x.cuda(), y.cuda())
    gc.manual_seed(4)
    b = script(x.cuda(), y.cuda())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    plain = factory(None)(x.cuda(), y.cuda())  # global CUDA RNG, labels left on the CPU also work
    assert plain[0].device.type == "cuda" and factory(None)(x.cuda(), y)[1].device.type == "cuda"


# --------------------------------------------------------------------------------------------------
# bad input


_BAD: list[tuple[str, Callable[[], Any], type, str]] = [
    ("3-D images", lambda: MixUp(1.0, 5)(make_batch(4)[0], labels_for(4)), ValueError, "4 dims"),
    ("int32 images", lambda: MixUp(1.0, 5)(make_batch(4, dtype=torch.uint8).int(), labels_for(4)), TypeError,
     "uint8 or floating"),
    ("float labels", lambda: CutMix(1.0, 5)(make_batch(4), labels_for(4).float()), TypeError, "integer class"),
    ("labels shape", lambda: CutMix(1.0, 5)(make_batch(4), labels_for(3)), ValueError, r"expected shape \[4\]"),
    ("one-hot labels", lambda: CutMix(1.0, 5)(make_batch(4), torch.eye(5, dtype=torch.int64)[:4]), ValueError,
     r"expected shape \[4\]"),
    ("label too big", lambda: MixUpCutMix(5)(make_batch(4), torch.tensor([0, 1, 2, 5])), ValueError,
     r"in \[0, 4\].*got values in \[0, 5\]"),
    ("negative label", lambda: MixUp(1.0, 5)(make_batch(4), torch.tensor([0, -1, 2, 3])), ValueError,
     r"got values in \[-1, 3\]"),
    ("alpha 0", lambda: MixUp(0.0, 5), ValueError, "alpha: expected .* > 0"),
    ("alpha < 0", lambda: CutMix(-1.0, 5), ValueError, "alpha: expected .* > 0"),
    ("alpha nan", lambda: CutMix(float("nan"), 5), ValueError, "alpha"),
    ("mix alpha < 0", lambda: MixUpCutMix(5, mixup_alpha=-0.1), ValueError, "mixup_alpha"),
    ("both alphas 0", lambda: MixUpCutMix(5, mixup_alpha=0.0, cutmix_alpha=0.0), ValueError, "at least one > 0"),
    ("num_classes 0", lambda: MixUp(1.0, 0), ValueError, "num_classes"),
    ("smoothing 1", lambda: MixUp(1.0, 5, label_smoothing=1.0), ValueError, "label_smoothing"),
    ("pairing", lambda: MixUp(1.0, 5, pairing="shuffle"), ValueError, "'roll' .* or 'flip'"),
    ("switch_prob", lambda: MixUpCutMix(5, switch_prob=1.5), ValueError, "switch_prob"),
    ("generator", lambda: MixUp(1.0, 5, generator=3), TypeError, "torch.Generator"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("what,call,exc,match", _BAD, ids=[b[0] for b in _BAD])
def test_bad_input(what: str, call: Callable[[], Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_bad_labels_scripted() -> None:
    with pytest.raises(torch.jit.Error, match=r"ValueError: labels: expected class indices in \[0, 4\]"):
        torch.jit.script(MixUpCutMix(5))(make_batch(4), torch.tensor([0, 1, 2, 9]))
