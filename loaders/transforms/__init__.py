"""Device-side batch transforms: per-sample random parameters, one batched kernel per step.

``functional`` holds pure kernels on (N, 3, H, W) tensors; ``modules`` the ``nn.Module``s that draw
per-sample parameters; ``presets`` ready pipelines. Recommended: ``torch.compile(imagenet_train())``.
"""

from . import functional
from .mix import CutMix, MixUp, MixUpCutMix
from .modules import (
    BatchTransform,
    CenterCrop,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)
from .presets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    cifar_eval,
    cifar_train,
    imagenet_eval,
    imagenet_train,
)

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "IMAGENET_MEAN", "IMAGENET_STD", "BatchTransform", "CenterCrop", "Compose",
           "CutMix", "MixUp", "MixUpCutMix", "Normalize", "RandomCrop", "RandomHorizontalFlip", "RandomResizedCrop",
           "Resize", "cifar_eval", "cifar_train", "functional", "imagenet_eval", "imagenet_train"]
