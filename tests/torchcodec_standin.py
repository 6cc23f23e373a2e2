"""TorchCodec's JPEG decoder for the tests of the GPU paths on the CPU, or a stand-in where torchcodec is missing.

The GPU paths (``device_loader(decode="cuda")``, ``--decode-device cuda``) decode through TorchCodec's
``torchcodec.decoders.decode_jpeg``, the optional extra ``torchcodec``. Where it is installed, the fixture hands
over the real module (its CPU decoder: libjpeg-turbo). Where it is not (the shared test environment), it puts a
stand-in in its place for the test: ``decode_jpeg`` with TorchCodec's signature and behaviour (RGB, a list decoded
as a batch, EXIF orientation always applied, CPU only), made of torchvision's CPU decoder, so the code that calls
TorchCodec runs through the same interface. The GPU checks (``.ci/gpu-checks``) run the real one on CUDA.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

import pytest
import torch

STANDIN = "torchvision stand-in"


def _standin_decode_jpeg(source: Any, *, mode: str = "RGB", device: Any = "cpu") -> Any:
    """``torchcodec.decoders.decode_jpeg`` as TorchCodec documents it, by torchvision's CPU decoder."""
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as torchvision_decode_jpeg

    if torch.device(device).type != "cpu":
        raise RuntimeError(f"the {STANDIN} of TorchCodec decodes on the CPU only, not on {device}")
    batch = isinstance(source, (list, tuple))
    tensors = [s if isinstance(s, torch.Tensor) else torch.frombuffer(bytearray(s), dtype=torch.uint8)
               for s in (source if batch else [source])]
    with warnings.catch_warnings():  # torchvision's image decoders are deprecated: the reason TorchCodec is used
        warnings.simplefilter("ignore", DeprecationWarning)
        out = torchvision_decode_jpeg(tensors, mode=ImageReadMode[mode.upper()], device="cpu",
                                      apply_exif_orientation=True)
    return out if batch else out[0]


@pytest.fixture
def torchcodec_decoder(monkeypatch: pytest.MonkeyPatch) -> str:
    """``"torchcodec"`` when the real package decodes here, else the stand-in's name (installed for the test)."""
    try:
        decoders = importlib.import_module("torchcodec.decoders")
        if hasattr(decoders, "decode_jpeg"):
            return "torchcodec"
    except ImportError:
        pass
    package = types.ModuleType("torchcodec")
    decoders = types.ModuleType("torchcodec.decoders")
    decoders.decode_jpeg = _standin_decode_jpeg  # type: ignore[attr-defined]
    package.decoders = decoders  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchcodec", package)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)
    return STANDIN
