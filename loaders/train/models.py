"""Models by name: torchvision classifiers built from scratch, and small CNNs for CPU demos and tests."""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = ["LOCAL_MODELS", "SmallCNN", "available_models", "build_model", "is_known_model"]


class SmallCNN(nn.Module):
    """Four conv blocks (widths w, 2w, 4w, 8w), global average pool, linear head; ~0.1 M parameters at w=16.

    Every block halves the resolution, the first one too unless ``stem_stride=1`` (small images such as
    CIFAR's 32 px), which keeps a 64-96 px CPU demo step around 10 ms per image on one core.

    GroupNorm, not BatchNorm: it normalises each sample on its own, so a micro-batch, an accumulated
    batch and a DDP-sharded batch give the same gradients (the equivalence the tests check), and tiny
    CPU batches train as well as large ones.
    """

    def __init__(self, num_classes: int, width: int = 16, in_channels: int = 3, stem_stride: int = 2) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        chans = [in_channels, width, 2 * width, 4 * width, 8 * width]
        layers: list[nn.Module] = []
        for i, (cin, cout) in enumerate(itertools.pairwise(chans)):
            layers += [
                nn.Conv2d(cin, cout, 3, stride=stem_stride if i == 0 else 2, padding=1, bias=False),
                nn.GroupNorm(min(8, cout), cout),
                nn.ReLU(inplace=True),
            ]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(chans[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class _Linear(nn.Module):
    """Global average pool over a 4x4 grid + linear: a BN-free, dropout-free model for exactness tests."""

    def __init__(self, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(in_channels * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(x), 1))


# name -> (num_classes, image_size or None) -> module
LOCAL_MODELS = {
    "small_cnn": lambda n, s: SmallCNN(n, width=16, stem_stride=1 if s and s <= 48 else 2),
    "tiny_cnn": lambda n, s: SmallCNN(n, width=8, stem_stride=1 if s and s <= 48 else 2),
    "linear": lambda n, s: _Linear(n),
}


def _torchvision_models() -> list[str]:
    import torchvision  # imported on demand: it pulls in torch._dynamo, seconds of start-up

    return sorted(torchvision.models.list_models(module=torchvision.models))


def available_models() -> list[str]:
    """Names :func:`build_model` accepts: the local small models, then torchvision's classifiers."""
    return sorted(LOCAL_MODELS) + _torchvision_models()


def is_known_model(name: str) -> bool:
    return name in LOCAL_MODELS or name in _torchvision_models()


def build_model(
    name: str, num_classes: int, *, image_size: int | None = None, channels_last: bool = True
) -> nn.Module:
    """A freshly initialised classifier for ``num_classes`` (``weights=None``: nothing is downloaded).

    ``image_size`` (the training crop) lets the small local CNNs keep full resolution in their first
    block for 32 px inputs; torchvision models ignore it.

    ``channels_last`` matches the batches the device transforms produce, so convolutions run in NHWC
    without a layout copy per step.
    """
    if name in LOCAL_MODELS:
        model = LOCAL_MODELS[name](num_classes, image_size)
    else:
        import torchvision

        if name not in _torchvision_models():
            raise ValueError(
                f"unknown model {name!r}: expected one of {sorted(LOCAL_MODELS)} or a torchvision "
                f"classifier such as resnet18, resnet50, mobilenet_v3_small"
            )
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
