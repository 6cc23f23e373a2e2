"""loaders.train.loop.step on plain lists of batches: accumulation equivalence, AMP, GradScaler skips, evaluate."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loaders.train.loop import amp as amp_mod
from loaders.train.loop.step import EpochConfig, evaluate, num_optimizer_steps, train_one_epoch, window_size
from loaders.train.models import build_model


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it is asked to apply."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[override]
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def _batches(n_batches: int, b: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 2, 2, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (b,), generator=g)) for _ in range(n_batches)]


@pytest.mark.parametrize(("n_batches", "accum"), [(7, 3), (6, 3), (1, 4), (5, 1), (4, 8)])
def test_accumulation_equals_one_big_batch(n_batches: int, accum: int) -> None:
    b = 4
    data = _batches(n_batches, b)
    model = _mlp()
    ref = _mlp()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    sched_calls: list[int] = []
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sched_calls.append(s) or 1.0)
    sched_calls.clear()  # LambdaLR calls the lambda once at construction
    res = train_one_epoch(model, data, opt, EpochConfig(accum=accum), scheduler=sched)

    ref_opt = RecordingSGD(ref.parameters(), lr=0.1)
    for lo in range(0, n_batches, accum):
        window = data[lo : lo + accum]
        x = torch.cat([w[0] for w in window])
        y = torch.cat([w[1] for w in window])
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()

    expected_steps = math.ceil(n_batches / accum)
    assert res.steps == num_optimizer_steps(n_batches, accum) == expected_steps
    assert len(opt.seen) == expected_steps
    assert len(sched_calls) == expected_steps
    for got, want in zip(opt.seen, ref_opt.seen, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True) after the step
    assert res.batches == n_batches and res.samples == n_batches * b


@pytest.mark.parametrize(("sizes", "accum"), [([4, 4, 4, 1], 2), ([4, 4, 4, 4, 2], 3), ([4, 4, 3], 4), ([4, 1], 1)])
def test_a_short_last_micro_batch_weighs_per_sample(sizes: list[int], accum: int) -> None:
    """With num_samples, a window holding the epoch's short last micro-batch is one batch of their union
    (without it, each micro-batch weighs 1/window and the short one's samples count several times)."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g))
            for n in sizes]
    model, ref = _mlp(), _mlp()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    res = train_one_epoch(model, data, opt, EpochConfig(accum=accum, num_samples=sum(sizes)))
    ref_opt = RecordingSGD(ref.parameters(), lr=0.1)
    for lo in range(0, len(data), accum):
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat([d[0] for d in data[lo : lo + accum]])),
                        torch.cat([d[1] for d in data[lo : lo + accum]])).backward()
        ref_opt.step()
    assert res.steps == len(ref_opt.seen)
    for got, want in zip(opt.seen, ref_opt.seen, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # Resumed at a window boundary: the same weights.
    resumed = _mlp()
    opt_r = torch.optim.SGD(resumed.parameters(), lr=0.1)
    cut = accum * ((len(sizes) - 1) // accum)  # where the last window starts
    whole = EpochConfig(accum=accum, num_batches=len(sizes), num_samples=sum(sizes))
    train_one_epoch(resumed, data[:cut], opt_r, whole)
    train_one_epoch(resumed, data[cut:], opt_r, dataclasses.replace(whole, start_batch=cut))
    for p, q in zip(resumed.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_num_samples_that_do_not_fit_the_batches_are_refused_before_the_step() -> None:
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="held 3 samples, 4 expected"):  # a short micro-batch mid-epoch
        train_one_epoch(model, [_batches(1, 2)[0], _batches(1, 1)[0], _batches(1, 2)[0]],
                        torch.optim.SGD(model.parameters(), lr=0.1), EpochConfig(accum=2, num_samples=5))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_logged_lr_is_the_one_the_step_applied() -> None:
    """The scheduler steps right after the optimizer: reading the LR then logged the next step's (the last
    step of a cosine schedule showed lr 0)."""
    applied: list[float] = []

    class LrSGD(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[override]
            applied.append(self.param_groups[0]["lr"])
            return super().step(closure)

    model = _mlp()
    opt = LrSGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    logged: list[float] = []
    train_one_epoch(model, _batches(6, 2), opt, EpochConfig(accum=2, log_every=1), scheduler=sched,
                    on_log=lambda e: logged.append(e["lr"]))
    assert applied == logged == [1.0, 0.5, 1 / 3]


def test_the_config_is_the_one_way_to_pass_settings() -> None:
    """Settings go in an EpochConfig only: ``accum=`` as a keyword (the signature of earlier releases) is a
    TypeError, as is a config of another type; no config trains with EpochConfig's defaults."""
    g = torch.Generator().manual_seed(3)
    sizes = [4, 4, 4, 2]
    data = [(torch.randn(n, 3, 2, 2, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g))
            for n in sizes]
    a, b = _mlp(), _mlp()
    with pytest.raises(TypeError, match="accum"):
        train_one_epoch(a, data, torch.optim.SGD(a.parameters(), lr=0.1), accum=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="config must be an EpochConfig, got dict"):
        train_one_epoch(a, data, torch.optim.SGD(a.parameters(), lr=0.1), {"accum": 3})  # type: ignore[arg-type]
    res_a = train_one_epoch(a, data, torch.optim.SGD(a.parameters(), lr=0.1))
    res_b = train_one_epoch(b, data, torch.optim.SGD(b.parameters(), lr=0.1), EpochConfig())
    assert res_a.steps == res_b.steps == 4
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_batch_transform_runs_after_the_transform_and_takes_soft_targets() -> None:
    """A batch-level mix (MixUp / CutMix) sees the transformed batch and may return soft (N, C) targets:
    one-hot targets train exactly as the hard labels, and mixed ones reach the loss as returned."""
    data = _batches(4, 4)
    hard, soft = _mlp(), _mlp()
    train_one_epoch(hard, data, torch.optim.SGD(hard.parameters(), lr=0.1), EpochConfig(accum=2),
                    transform=lambda x: x * 2)
    seen: list[torch.Tensor] = []

    def one_hot(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(x)
        return x, F.one_hot(y, 5).to(x.dtype)

    train_one_epoch(soft, data, torch.optim.SGD(soft.parameters(), lr=0.1), EpochConfig(accum=2),
                    transform=lambda x: x * 2, batch_transform=one_hot)
    assert [torch.equal(s, d[0] * 2) for s, d in zip(seen, data, strict=True)] == [True] * 4
    for p, q in zip(hard.parameters(), soft.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)

    made: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []

    def mix(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        made.append(0.7 * F.one_hot(y, 5).to(x.dtype) + 0.3 * F.one_hot(y.roll(1), 5).to(x.dtype))
        return 0.7 * x + 0.3 * x.roll(1, 0), made[-1]

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        targets.append(t)
        return F.cross_entropy(out, t)

    res = train_one_epoch(_mlp(), data, torch.optim.SGD(_mlp().parameters(), lr=0.1), loss_fn=loss_fn,
                          batch_transform=mix)
    assert res.samples == 16 and [t.shape for t in targets] == [(4, 5)] * 4
    assert len(made) == 4 and all(t is m for t, m in zip(targets, made, strict=True))


def test_window_size_shortens_only_the_last_window() -> None:
    assert [window_size(i, 7, 3) for i in range(7)] == [3, 3, 3, 3, 3, 3, 1]
    assert [window_size(i, 8, 3) for i in range(8)] == [3, 3, 3, 3, 3, 3, 2, 2]


def test_resume_mid_epoch_matches_one_pass() -> None:
    data = _batches(7, 4)
    a, b = _mlp(), _mlp()
    train_one_epoch(a, data, torch.optim.SGD(a.parameters(), lr=0.1), EpochConfig(accum=2))
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    stops: list[int] = []
    train_one_epoch(b, data[:4], opt_b, EpochConfig(accum=2, num_batches=7), on_step=lambda s: stops.append(s.batch))
    train_one_epoch(b, data[4:], opt_b, EpochConfig(accum=2, num_batches=7, start_batch=4))
    assert stops == [2, 4]
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match="boundary"):
        train_one_epoch(b, data[3:], opt_b, EpochConfig(accum=2, num_batches=7, start_batch=3))


def test_bad_accum_is_a_clear_error() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="accum must be >= 1"):
        train_one_epoch(model, _batches(2, 2), torch.optim.SGD(model.parameters(), lr=0.1), EpochConfig(accum=0))


def _separable(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four classes, each a different constant colour plus noise: a linear model learns it in steps."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.tensor([[1.0, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, -1]])
    out = []
    for _ in range(n):
        y = torch.randint(0, 4, (16,), generator=g)
        x = colours[y][:, :, None, None] + 0.5 * torch.randn(16, 3, 8, 8, generator=g)
        out.append((x.contiguous(memory_format=torch.channels_last), y))
    return out


def test_bf16_autocast_on_cpu_lowers_the_loss() -> None:
    torch.manual_seed(0)
    # bf16 convolutions are emulated (slow) on CPUs without AVX512-BF16/AMX: a linear model keeps it quick.
    model = build_model("linear", 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _separable(12)
    before = evaluate(model, data, amp_dtype=torch.bfloat16)
    losses = [train_one_epoch(model, data, opt, EpochConfig(amp_dtype=torch.bfloat16)).loss for _ in range(3)]
    after = evaluate(model, data, amp_dtype=torch.bfloat16)
    assert losses[-1] < 0.6 * losses[0], losses
    assert after["loss"] < before["loss"]
    assert after["top1"] > 0.8
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast keeps fp32 master weights


def test_gradscaler_skips_inf_step_on_cpu_without_touching_weights() -> None:
    torch.manual_seed(0)
    model = build_model("linear", 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data = _separable(3)
    poisoned = {1}
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, y)
        i = calls["n"]
        calls["n"] += 1
        return loss * torch.inf if i in poisoned else loss

    snapshots: list[dict[str, torch.Tensor]] = []
    res = train_one_epoch(
        model, data, opt, EpochConfig(clip_grad=1.0), loss_fn=loss_fn, scaler=scaler,
        on_step=lambda s: snapshots.append({k: v.clone() for k, v in model.state_dict().items()}),
    )
    assert res.steps == 3 and res.skipped_steps == 1
    for k in snapshots[0]:
        torch.testing.assert_close(snapshots[1][k], snapshots[0][k], rtol=0, atol=0)  # skipped: unchanged
        assert torch.isfinite(snapshots[2][k]).all()
    assert not torch.equal(snapshots[2]["fc.weight"], snapshots[1]["fc.weight"])
    assert scaler.get_scale() == 2.0**9  # backed off once


def test_clip_grad_unscales_before_clipping() -> None:
    """With a huge loss scale, clipping must see the true (unscaled) gradient norm."""
    data = _batches(1, 4)
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**16)):
        model = _mlp()
        opt = RecordingSGD(model.parameters(), lr=0.1)
        train_one_epoch(model, data, opt, EpochConfig(clip_grad=0.01), scaler=scaler)
        runs.append(opt.seen[0])
    for g, w in zip(*runs, strict=True):
        torch.testing.assert_close(g, w)
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in runs[1]])) <= 0.0100001


def test_evaluate_top1_top5_and_few_classes() -> None:
    class Fixed(nn.Module):
        def __init__(self, logits: torch.Tensor) -> None:
            super().__init__()
            self.logits = logits
            self.dummy = nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.logits[x[:, 0].long()]

    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
    x = torch.arange(3).float()[:, None]
    y = torch.tensor([0, 0, 4])  # hit@1, miss@5 (class 0 is last), hit@5 not @1
    r = evaluate(Fixed(logits), [(x, y)])
    assert r["count"] == 3
    assert r["top1"] == pytest.approx(1 / 3)
    assert r["top5"] == pytest.approx(2 / 3)
    r2 = evaluate(Fixed(logits[:, :3]), [(x, torch.tensor([0, 0, 2]))])  # 3 classes: top-5 = top-3
    assert r2["top5"] == 1.0


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def _check_cpu_has_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """True where the CPU advertises bf16 instructions; oneDNN's answer as a bool; False without oneDNN."""
    if _cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        assert amp_mod.cpu_has_native_bf16() is True
    with monkeypatch.context() as mp:
        mp.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: 1)
        assert amp_mod.cpu_has_native_bf16() is True
        mp.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: 0)
        assert amp_mod.cpu_has_native_bf16() is False

        def no_onednn() -> bool:
            raise RuntimeError("no oneDNN in this build")

        mp.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", no_onednn)
        assert amp_mod.cpu_has_native_bf16() is False


def test_resolve_amp(monkeypatch: pytest.MonkeyPatch) -> None:
    assert amp_mod.resolve_amp("off", "cpu") is None
    assert amp_mod.resolve_amp("bf16", "cpu") is torch.bfloat16
    _check_cpu_has_native_bf16(monkeypatch)
    # auto on CPU: bf16 exactly where the CPU has native bf16 kernels, else full fp32.
    monkeypatch.setattr(amp_mod, "cpu_has_native_bf16", lambda: True)
    assert amp_mod.resolve_amp("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(amp_mod, "cpu_has_native_bf16", lambda: False)
    assert amp_mod.resolve_amp("auto", "cpu") is None
    assert amp_mod.resolve_amp("bf16", "cpu") is torch.bfloat16  # asked for explicitly: emulated, but honoured
    with pytest.raises(amp_mod.AmpUnsupportedError, match="fp16 needs a CUDA"):
        amp_mod.resolve_amp("fp16", "cpu")
    # auto on CUDA: bf16 only with bf16 tensor cores. is_bf16_supported() is True on a T4 or V100 too (bf16
    # is emulated there, slower than fp16), so the compute capability decides.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, auto in (((7, 5), torch.float16), ((7, 0), torch.float16), ((8, 0), torch.bfloat16),
                             ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert amp_mod.resolve_amp("auto", "cuda") is auto, capability
        assert amp_mod.resolve_amp("bf16", "cuda") is torch.bfloat16  # asked for explicitly: honoured
    monkeypatch.undo()
    assert amp_mod.make_scaler(torch.bfloat16, "cpu") is None
    assert amp_mod.make_scaler(None, "cpu") is None
    assert isinstance(amp_mod.make_scaler(torch.float16, "cpu"), torch.amp.GradScaler)


@pytest.mark.gpu
def test_fp16_gradscaler_on_cuda() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = build_model("tiny_cnn", 4).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtype = amp_mod.resolve_amp("fp16", dev)
    scaler = amp_mod.make_scaler(dtype, dev)
    assert dtype is torch.float16 and scaler is not None
    data = [(x.to(dev), y.to(dev)) for x, y in _separable(12)]
    settings = EpochConfig(accum=2, amp_dtype=dtype, clip_grad=5.0)
    losses = [train_one_epoch(model, data, opt, settings, scaler=scaler).loss for _ in range(3)]
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
