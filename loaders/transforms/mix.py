# ruff: noqa: UP006, UP035, UP045 - typing.List/Optional/Tuple keep these TorchScript-compilable on older torch
"""MixUp and CutMix on the device: batch transforms with torchvision v2's semantics, plus timm's switch.

``forward(images, labels) -> (mixed images, soft targets)``: ``images`` (N, C, H, W) uint8 or floating on any
device; ``labels`` int (N,) class indices or float (N, num_classes) soft labels (a column of the cache), mixed
as the one-hot rows would be; targets float32 (N, num_classes). Semantics (checked value for value in the
tests): one ``lam ~ Beta(alpha, alpha)`` per batch; each sample mixed with its partner, the batch rolled by
one (``pairing="roll"``, torchvision's) or reversed (``"flip"``, timm's); MixUp ``lam * x + (1 - lam) *
partner``; CutMix a box of area ``(1 - lam) * H * W`` centred on a uniform pixel, clipped, filled from the
partner, ``lam`` then recomputed from the clipped box; targets the one-hot rows (first smoothed to ``1 - s +
s / C`` and ``s / C`` with ``label_smoothing=s``, timm's ``mixup_target``) mixed by the same ``lam``. Train
with ``F.cross_entropy(logits, targets)`` and leave its own ``label_smoothing`` at 0.

By design, unlike torchvision: uint8 is mixed in float32 and rounded half to even (torchvision truncates in
uint8; timm's ``FastCollateMixup`` rounds), fp16/bf16 in float32 rounded once; the input is never modified;
odd and short batches work (a batch of one is its own partner). Randomness and compilation as in
:mod:`loaders.transforms.modules`; with the global RNG a CPU batch draws exactly what torchvision's do (under
``torch.compile`` other, equally distributed draws: compare through a generator). Parameters stay tensors
on the device and the box is a mask, so a step is one fused elementwise pass under ``torch.compile``.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .modules import _probability

__all__ = ["CutMix", "MixUp", "MixUpCutMix", "box_lambda", "box_weight", "check_labels", "check_soft_labels",
           "cutmix_box", "mix_images", "mix_targets"]


# --------------------------------------------------------------------------------------------------
# kernels (pure: parameters in, tensors out)


def _check_batch(images: Tensor) -> None:
    if images.dtype != torch.uint8 and not images.is_floating_point():
        raise TypeError(f"images: expected a torch.uint8 or floating-point tensor, got dtype {images.dtype}")
    if images.dim() != 4:
        raise ValueError(
            f"images: expected a batch of shape (N, C, H, W) (4 dims), got shape {list(images.shape)}; "
            "MixUp/CutMix mix samples of a batch, so one image needs x[None] and a partner"
        )


def check_labels(labels: Tensor, n: int, num_classes: int) -> None:
    """Raise TypeError/ValueError unless ``labels`` is an integer (n,) tensor of values in [0, num_classes)."""
    if labels.is_floating_point() or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(
            f"labels: expected integer class indices, got dtype {labels.dtype}; "
            "MixUp/CutMix make the soft targets themselves"
        )
    if labels.dim() != 1 or labels.shape[0] != n:
        raise ValueError(f"labels: expected shape [{n}] (one class index per image), got {list(labels.shape)}")
    if n > 0:
        if torch.jit.is_scripting():
            _check_label_range(labels, num_classes)
        else:
            _check_label_range_eager(labels, num_classes)


def check_soft_labels(labels: Tensor, n: int, num_classes: int) -> None:
    """Raise unless ``labels`` is a floating (n, num_classes) tensor of per-class weights (a float (n,) one is
    taken for class indices of the wrong dtype: a TypeError)."""
    if labels.dim() == 1:
        raise TypeError(
            f"labels: expected integer class indices, got dtype {labels.dtype} of shape {list(labels.shape)}; "
            f"soft labels are float [{n}, {num_classes}]"
        )
    if labels.dim() != 2 or labels.shape[0] != n or labels.shape[1] != num_classes:
        raise ValueError(
            f"labels: soft labels must be float [{n}, {num_classes}] (one row of class weights per image), "
            f"got {list(labels.shape)}"
        )


def _check_label_range(labels: Tensor, num_classes: int) -> None:
    lo_hi = torch.aminmax(labels)
    lo, hi = int(lo_hi[0]), int(lo_hi[1])  # one host sync: a bad label is a named error, not a device assert
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"labels: expected class indices in [0, {num_classes - 1}] (num_classes={num_classes}), "
            f"got values in [{lo}, {hi}]; pass num_classes=len(dataset.classes)"
        )


# torch.compile would break the graph at int() with a warning; run the check eagerly instead (a silent
# break). TorchScript never sees the wrapper (is_scripting() branches are pruned).
_check_label_range_eager = torch.compiler.disable(_check_label_range)


def _partner(t: Tensor, flip_pairs: bool) -> Tensor:
    return t.flip(0) if flip_pairs else t.roll(1, 0)


def mix_images(images: Tensor, weight: Tensor, flip_pairs: bool = False) -> Tensor:
    """``weight * images + (1 - weight) * partner``, with ``weight`` (float64) broadcastable to the batch:
    a (1, 1, 1, 1) ``lam`` for MixUp, a (1, 1, H, W) 0/1 map (0 inside the box) for CutMix.

    float32/float64 batches are mixed in their dtype (torchvision's values); others in float32, rounded
    back once (uint8: half to even, saturated). Same device and dtype out, channels_last.
    """
    _check_batch(images)
    other = _partner(images, flip_pairs)
    keep = weight.to(images.device)
    if images.dtype == torch.float32 or images.dtype == torch.float64:
        out = images * keep.to(images.dtype) + other * (1.0 - keep).to(images.dtype)
    else:
        mixed = images.float() * keep.float() + other.float() * (1.0 - keep).float()
        out = mixed.round().clamp(0, 255).to(torch.uint8) if images.dtype == torch.uint8 else mixed.to(images.dtype)
    return out.contiguous(memory_format=torch.channels_last)


def mix_targets(
    labels: Tensor, num_classes: int, lam: Tensor, label_smoothing: float = 0.0, flip_pairs: bool = False
) -> Tensor:
    """float32 (N, num_classes) soft targets: smoothed one-hot of ``labels`` mixed with its partner's by
    ``lam`` (float64 scalar tensor), as timm's ``mixup_target``; torchvision's when ``label_smoothing=0``.
    Float (N, num_classes) ``labels`` (soft labels: a teacher's probabilities) are smoothed and mixed the same
    way, as the one-hot rows they stand for (a one-hot row gives exactly the targets of its class index)."""
    off = label_smoothing / num_classes
    on = 1.0 - label_smoothing + off
    n = labels.shape[0]
    if labels.is_floating_point():
        y = labels.to(torch.float32) * (1.0 - label_smoothing) + off
    else:
        y = torch.full([n, num_classes], off, dtype=torch.float32, device=labels.device)
        y = y.scatter(1, labels.to(torch.int64)[:, None], on)
    lam = lam.to(labels.device)
    return y * lam.to(torch.float32) + _partner(y, flip_pairs) * (1.0 - lam).to(torch.float32)


def cutmix_box(lam: Tensor, cy: Tensor, cx: Tensor, height: int, width: int) -> Tensor:
    """torchvision's CutMix box: int64 (4,) ``(y0, x0, y1, x1)``, end-exclusive, clipped to the image, for a
    drawn ``lam`` (float64 scalar tensor) centred on pixel (``cy``, ``cx``) (int64 scalar tensors)."""
    r = 0.5 * torch.sqrt(1.0 - lam.to(torch.float64))
    half_h = torch.floor(r * height).to(torch.int64)
    half_w = torch.floor(r * width).to(torch.int64)
    cy = cy.to(torch.int64).reshape([])
    cx = cx.to(torch.int64).reshape([])
    y0 = (cy - half_h).clamp_min(0)
    x0 = (cx - half_w).clamp_min(0)
    y1 = (cy + half_h).clamp_max(height)
    x1 = (cx + half_w).clamp_max(width)
    return torch.stack([y0, x0, y1, x1])


def box_lambda(box: Tensor, height: int, width: int) -> Tensor:
    """The share of each image a CutMix ``box`` leaves it, ``1 - area / (H * W)``: float64 scalar tensor."""
    area = ((box[2] - box[0]) * (box[3] - box[1])).to(torch.float64)
    return 1.0 - area / float(height * width)


def box_weight(box: Tensor, height: int, width: int) -> Tensor:
    """float64 (1, 1, H, W) map for :func:`mix_images`: 0 inside ``box`` (the partner's pixels), 1 outside."""
    rows = torch.arange(height, device=box.device)
    cols = torch.arange(width, device=box.device)
    in_rows = (rows >= box[0]) & (rows < box[2])
    in_cols = (cols >= box[1]) & (cols < box[3])
    inside = in_rows[:, None] & in_cols[None, :]
    return (~inside).to(torch.float64)[None, None]


# --------------------------------------------------------------------------------------------------
# modules (draw the parameters)


def _check_alpha(alpha: float, name: str, allow_zero: bool) -> float:
    a = float(alpha)
    if not math.isfinite(a) or a < 0.0 or (a == 0.0 and not allow_zero):
        need = ">= 0 (0 switches it off)" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite Beta(alpha, alpha) parameter {need}, got {alpha!r}")
    return a


class _Mix(nn.Module):
    """Shared parts: class count, smoothing, pairing, the generator and the draws."""

    generator: Optional[torch.Generator]

    def __init__(
        self, num_classes: int, label_smoothing: float, pairing: str, generator: Optional[torch.Generator]
    ) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes: expected an int >= 1 (len(dataset.classes)), got {num_classes!r}")
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"label_smoothing: expected a value in [0, 1), got {label_smoothing!r}")
        if pairing not in ("roll", "flip"):
            raise ValueError(f"pairing: expected 'roll' (torchvision) or 'flip' (timm), got {pairing!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        self.num_classes = num_classes
        self.label_smoothing = float(label_smoothing)
        self.pairing = pairing
        self.flip_pairs = pairing == "flip"
        self.generator = generator
        # TorchScript cannot read Generator.device: record it ("" = draw on the images' device).
        self.draw_device = "" if generator is None else str(generator.device)

    def _dev(self, device: torch.device) -> torch.device:
        return device if self.draw_device == "" else torch.device(self.draw_device)

    def _beta(self, alpha: float, device: torch.device) -> Tensor:
        """One Beta(alpha, alpha) draw as a float64 scalar on ``device``; the very call torchvision's
        ``torch.distributions.Beta`` makes (float32 concentration of shape (1, 2))."""
        dev = self._dev(device)
        conc = torch.full([1, 2], alpha, dtype=torch.float32, device=dev)
        gen = self.generator
        if gen is None:  # no generator= at all (torch.compile fails on an explicit None with dynamic shapes)
            return torch._sample_dirichlet(conc)[0, 0].to(device=device, dtype=torch.float64)
        return torch._sample_dirichlet(conc, generator=gen)[0, 0].to(device=device, dtype=torch.float64)

    def _randint(self, high: int, device: torch.device) -> Tensor:
        dev = self._dev(device)
        gen = self.generator
        if gen is None:
            return torch.randint(0, high, [1], device=dev).to(device)
        return torch.randint(0, high, [1], generator=gen, device=dev).to(device)

    def _rand(self, k: int, device: torch.device) -> Tensor:
        dev = self._dev(device)
        gen = self.generator
        if gen is None:
            return torch.rand([k], device=dev, dtype=torch.float64).to(device)
        return torch.rand([k], generator=gen, device=dev, dtype=torch.float64).to(device)

    def _draw_box(self, images: Tensor, alpha: float) -> Tuple[Tensor, Tensor]:
        # torchvision's draw order: lam, then the centre's x, then its y.
        h, w = images.shape[2], images.shape[3]
        lam = self._beta(alpha, images.device)
        cx = self._randint(w, images.device)
        cy = self._randint(h, images.device)
        box = cutmix_box(lam, cy, cx, h, w)
        return box, box_lambda(box, h, w)

    def get_params(self, images: Tensor) -> Tuple[Tensor, Tensor]:  # pragma: no cover - each subclass has one
        raise NotImplementedError

    def forward(self, images: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
        _check_batch(images)
        labels = labels.to(images.device)
        if labels.is_floating_point():  # soft labels (N, C), e.g. distillation targets: mixed like one-hot rows
            check_soft_labels(labels, images.shape[0], self.num_classes)
        else:
            check_labels(labels, images.shape[0], self.num_classes)
        weight, lam = self.get_params(images)
        return (
            mix_images(images, weight, self.flip_pairs),
            mix_targets(labels, self.num_classes, lam, self.label_smoothing, self.flip_pairs),
        )

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, label_smoothing={self.label_smoothing}, pairing={self.pairing!r}"


class _OneMix(_Mix):
    """A mix of one kind, with its one Beta(``alpha``, ``alpha``) (``alpha`` > 0): MixUp and CutMix."""

    def __init__(self, alpha: float = 1.0, num_classes: int = 1000, label_smoothing: float = 0.0,
                 pairing: str = "roll", generator: Optional[torch.Generator] = None) -> None:
        super().__init__(num_classes, label_smoothing, pairing, generator)
        self.alpha = _check_alpha(alpha, "alpha", allow_zero=False)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, " + super().extra_repr()


class MixUp(_OneMix):
    """Batch MixUp, ``torchvision.transforms.v2.MixUp(alpha, num_classes)`` semantics (module docstring),
    plus ``label_smoothing`` and ``pairing``. ``forward(images, labels) -> (images, soft targets)``."""

    @torch.jit.export
    def get_params(self, images: Tensor) -> Tuple[Tensor, Tensor]:
        """(weight (1, 1, 1, 1), lam ()) float64 on the images' device: one Beta(alpha, alpha) draw."""
        lam = self._beta(self.alpha, images.device)
        return lam.reshape([1, 1, 1, 1]), lam


class CutMix(_OneMix):
    """Batch CutMix, ``torchvision.transforms.v2.CutMix(alpha, num_classes)`` semantics (module docstring),
    plus ``label_smoothing`` and ``pairing``. ``forward(images, labels) -> (images, soft targets)``."""

    @torch.jit.export
    def get_box(self, images: Tensor) -> Tuple[Tensor, Tensor]:
        """Draw a box: (int64 (4,) ``(y0, x0, y1, x1)``, the lam it leaves, float64 ())."""
        return self._draw_box(images, self.alpha)

    @torch.jit.export
    def get_params(self, images: Tensor) -> Tuple[Tensor, Tensor]:
        """(weight (1, 1, H, W): 0 inside the box, lam ()) float64 on the images' device."""
        box, lam = self._draw_box(images, self.alpha)
        return box_weight(box, images.shape[2], images.shape[3]), lam


class MixUpCutMix(_Mix):
    """MixUp or CutMix, one of them per batch, with label smoothing: timm's ``Mixup(mode="batch")``.

    Per batch: with probability ``p`` the batch is mixed at all (else only smoothed); then CutMix with
    probability ``switch_prob``, otherwise MixUp. An alpha of 0 switches that one off. Defaults are the
    DeiT / timm ImageNet recipe (``mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5,
    label_smoothing=0.1``). The choice is made on the device (``torch.where``), never by a host branch.

    Compared with ``timm.data.Mixup``: ``pairing="flip"`` pairs samples as timm does; MixUp then gives
    timm's images and targets for the same ``lam``. CutMix boxes use torchvision's rule (side
    ``2 * int(0.5 * sqrt(1 - lam) * H)``, always even), timm's have side ``int(sqrt(1 - lam) * H)``:
    one row or column more when that is odd. Draws come from torch's RNG, timm's from NumPy's.
    """

    def __init__(self, num_classes: int = 1000, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0,
                 switch_prob: float = 0.5, p: float = 1.0, label_smoothing: float = 0.1, pairing: str = "roll",
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(num_classes, label_smoothing, pairing, generator)
        self.mixup_alpha = _check_alpha(mixup_alpha, "mixup_alpha", allow_zero=True)
        self.cutmix_alpha = _check_alpha(cutmix_alpha, "cutmix_alpha", allow_zero=True)
        if self.mixup_alpha == 0.0 and self.cutmix_alpha == 0.0:
            raise ValueError("mixup_alpha, cutmix_alpha: expected at least one > 0, got both 0")
        self.switch_prob = _probability(switch_prob, "switch_prob")
        self.p = _probability(p, "p")

    @torch.jit.export
    def get_params(self, images: Tensor) -> Tuple[Tensor, Tensor]:
        """(weight (1, 1, 1 or H, 1 or W), lam ()) float64 on the images' device."""
        dev = images.device
        u = self._rand(2, dev)  # [mix at all?, CutMix rather than MixUp?]
        one = torch.ones([], dtype=torch.float64, device=dev)
        weight = one.reshape([1, 1, 1, 1])
        lam = one
        if self.mixup_alpha > 0.0:
            lam = self._beta(self.mixup_alpha, dev)
            weight = lam.reshape([1, 1, 1, 1])
        if self.cutmix_alpha > 0.0:
            box, cut_lam = self._draw_box(images, self.cutmix_alpha)
            cut_weight = box_weight(box, images.shape[2], images.shape[3])
            use_cut = u[1] < self.switch_prob if self.mixup_alpha > 0.0 else u[1] >= 0.0
            weight = torch.where(use_cut, cut_weight, weight)
            lam = torch.where(use_cut, cut_lam, lam)
        apply = u[0] < self.p
        return torch.where(apply, weight, one), torch.where(apply, lam, one)

    def extra_repr(self) -> str:
        return (
            f"mixup_alpha={self.mixup_alpha}, cutmix_alpha={self.cutmix_alpha}, switch_prob={self.switch_prob}, "
            f"p={self.p}, " + super().extra_repr()
        )
