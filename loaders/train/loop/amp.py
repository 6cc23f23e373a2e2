"""Mixed precision: resolve ``--amp`` to an autocast dtype, and the GradScaler that fp16 (only) needs."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from cachebuild.errors import CacheBuildError
from loaders.train.config import AMP_CHOICES

__all__ = ["AMP_CHOICES", "AmpUnsupportedError", "autocast", "cpu_has_native_bf16", "cuda_has_native_bf16",
           "make_scaler", "resolve_amp"]


class AmpUnsupportedError(CacheBuildError, ValueError):
    """A mixed-precision mode the chosen device cannot train in."""


def cpu_has_native_bf16() -> bool:
    """True when oneDNN has bf16 kernels for this CPU (AVX512-BF16 / AMX); else bf16 is emulated and slow."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def cuda_has_native_bf16(device: torch.device | str) -> bool:
    """True on GPUs with bf16 tensor cores (compute capability >= 8: Ampere on; ROCm). On older ones
    ``torch.cuda.is_bf16_supported()`` is still True, since bf16 is emulated there, and slower than fp16."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def resolve_amp(amp: str, device: torch.device | str) -> torch.dtype | None:
    """``--amp`` -> the autocast dtype (``None``: full fp32).

    ``auto`` is bf16 where the device runs it natively, else fp16 on CUDA, else off. fp16 on CPU is
    refused: CPU autocast has no loss scaling worth the name and few fp16 kernels, so it would be a
    slower, less stable fp32 run.
    """
    device = torch.device(device)
    if amp not in AMP_CHOICES:
        raise AmpUnsupportedError(f"--amp must be one of {AMP_CHOICES}, got {amp!r}")
    if amp == "off":
        return None
    if device.type == "cuda":
        bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if amp == "auto":
            return torch.bfloat16 if bf16_ok and cuda_has_native_bf16(device) else torch.float16
        if amp == "bf16" and not bf16_ok:
            raise AmpUnsupportedError(
                f"--amp bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use --amp fp16"
            )
        return torch.bfloat16 if amp == "bf16" else torch.float16
    if device.type == "cpu":
        if amp == "fp16":
            raise AmpUnsupportedError("--amp fp16 needs a CUDA device; on CPU use --amp bf16 or --amp off")
        if amp == "auto":
            return torch.bfloat16 if cpu_has_native_bf16() else None
        return torch.bfloat16
    if amp == "auto":
        return None
    raise AmpUnsupportedError(f"--amp {amp} is not supported on device type {device.type!r}")


def make_scaler(amp_dtype: torch.dtype | None, device: torch.device | str) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 only: bf16 has fp32's exponent range, so its gradients do not underflow."""
    if amp_dtype is not torch.float16:
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def autocast(device: torch.device | str, amp_dtype: torch.dtype | None) -> Any:
    """``torch.autocast`` for ``amp_dtype``, or a no-op context when running in fp32."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=amp_dtype)
