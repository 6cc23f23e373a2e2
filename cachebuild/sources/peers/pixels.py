"""A stored image payload of a peer's format -> what the build decodes: encoded bytes (JPEG, PNG...: the build's
decoder sniffs and decodes them, as it does files) or RGB ``(H, W, 3)`` uint8 pixels (resized by the build as
CIFAR's arrays are).

A codec is a short string, so that readers stay picklable and a plan can say which it found:

- ``encoded``: the payload is an image file's bytes (FFCV BytesField, MDS ``jpeg``/``png``/``bytes``, LitData
  ``jpeg``/``image:*``/``bytes``/``file:*``).
- ``ffcv-rgb``: an FFCV RGBImageField: per sample, mode 0 is a JPEG, mode 1 is raw RGB of the recorded size.
- ``raw:H,W,C``: raw uint8 of a fixed shape (an FFCV NDArrayField, MDS ``ndarray:uint8:H,W,C``).
- ``pil``: PIL's raw layout as MDS and LitData both write it: uint32 width, height and mode length, the mode
  name, then ``Image.tobytes()``.
- ``mds-ndarray[:DTYPE]``: MDS ``ndarray`` with a per-sample shape (and dtype when none is given).
- ``litdata-numpy``, ``litdata-tensor``: LitData's ``numpy`` (uint32 dtype index, rank, dims) and ``tensor``
  (big-endian uint32 dtype index, rank, dims; CHW when the first axis is 1 or 3) serializers.

Pixels: uint8 only (PIL: any mode but a palette's, whose palette the layout drops); grey ``(H, W)`` /
``(H, W, 1)`` are repeated to RGB and an alpha channel is dropped, as PIL's ``convert("RGB")`` does (the build
decodes a grey or RGBA PNG file the same way).
"""

from __future__ import annotations

import math
import struct

import numpy as np

from cachebuild.errors import DecodeError

__all__ = ["MDS_DTYPES", "check_codec", "raw_shape", "to_image"]

# MDS ndarray: value dtype codes (streaming/base/format/mds/encodings.py) and shape dtype codes
MDS_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
              34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_MDS_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
# LitData: index of uint8 in its numpy dtype table (litdata/constants.py _NUMPY_DTYPES_MAPPING) and torch's
_LITDATA_NUMPY_UINT8 = 4
_LITDATA_TENSOR_UINT8 = 11
_CODECS = ("encoded", "ffcv-rgb", "pil", "mds-ndarray", "litdata-numpy", "litdata-tensor")


def raw_shape(codec: str) -> tuple[int, ...]:
    """The shape of a ``raw:H,W,C`` codec."""
    return tuple(int(d) for d in codec.split(":", 1)[1].split(","))


def check_codec(codec: str) -> None:
    """Raise ValueError for a codec string this module does not know (a recipe of a newer release)."""
    base = codec.split(":", 1)[0]
    if base == "raw":
        if len(raw_shape(codec)) not in (2, 3):
            raise ValueError(f"raw pixels of shape {raw_shape(codec)} are not an image")
    elif base not in _CODECS:
        raise ValueError(f"unknown image codec {codec!r}")


def _rgb(arr: np.ndarray, key: str) -> np.ndarray:
    """uint8 (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) -> RGB (H, W, 3)."""
    if arr.dtype != np.uint8:
        raise DecodeError(key, f"pixels of dtype {arr.dtype}, not uint8: only 8-bit images are read")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4) or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise DecodeError(key, f"an array of shape {arr.shape} is not an image: expected (H, W), (H, W, 1), "
                               f"(H, W, 3) or (H, W, 4)")
    if arr.shape[2] == 1:
        return np.repeat(arr, 3, axis=2)
    return np.ascontiguousarray(arr[:, :, :3]) if arr.shape[2] == 4 else np.ascontiguousarray(arr)


def _exact(data: bytes | memoryview, shape: tuple[int, ...], key: str) -> np.ndarray:
    want = math.prod(shape)  # Python integers: a damaged shape cannot wrap around
    if len(data) != want:
        raise DecodeError(key, f"{len(data):,} bytes of pixels where shape {shape} needs {want:,}: damaged")
    return np.frombuffer(bytearray(data), np.uint8).reshape(shape)  # writable: the resize hands it to torch


def _pil(data: bytes, key: str) -> np.ndarray:
    if len(data) < 12:
        raise DecodeError(key, "a PIL payload shorter than its 12-byte header: damaged")
    width, height, n = struct.unpack_from("<III", data, 0)
    mode = data[12:12 + n].decode("ascii", "replace")
    raw = data[12 + n:]
    if mode == "RGB":
        return _exact(raw, (height, width, 3), key)
    if mode in ("P", "PA"):
        raise DecodeError(key, f"a palette image (mode {mode}) stored without its palette (PIL's tobytes drops it): "
                               f"its colours are lost; write the images as RGB")
    from PIL import Image

    try:
        im = Image.frombytes(mode, (width, height), raw)
        return np.array(im.convert("RGB"))
    except (ValueError, OSError) as e:
        raise DecodeError(key, f"a PIL image of mode {mode!r}, {width}x{height}, cannot be read ({e})") from None


def _mds_ndarray(codec: str, data: bytes, key: str) -> np.ndarray:
    parts = codec.split(":")
    at = 0
    if len(parts) > 1:
        dtype = parts[1]
    else:
        dtype = MDS_DTYPES.get(data[0], f"code {data[0]}") if data else "?"
        at = 1
    if at + 1 > len(data):
        raise DecodeError(key, "an MDS ndarray shorter than its header: damaged")
    ndim, shape_code = data[at] >> 2, data[at] & 3
    width = 1 << shape_code
    shape = tuple(int(d) for d in np.frombuffer(data, _MDS_SHAPE_DTYPES[shape_code], ndim, at + 1))
    body = data[at + 1 + ndim * width:]
    if dtype != "uint8":
        raise DecodeError(key, f"an MDS ndarray of dtype {dtype}: only uint8 images are read")
    return _rgb(_exact(body, shape, key), key)


def _litdata_array(codec: str, data: bytes, key: str) -> np.ndarray:
    big = codec == "litdata-tensor"
    order, uint8 = (">", _LITDATA_TENSOR_UINT8) if big else ("<", _LITDATA_NUMPY_UINT8)
    if len(data) < 8:
        raise DecodeError(key, "a LitData array shorter than its header: damaged")
    dtype, rank = struct.unpack_from(order + "II", data, 0)
    if rank > 8 or len(data) < 8 + 4 * rank:
        raise DecodeError(key, f"a LitData array header of rank {rank}: damaged")
    shape = struct.unpack_from(f"{order}{rank}I", data, 8)
    if dtype != uint8:
        raise DecodeError(key, f"a LitData {codec.split('-')[1]} of dtype index {dtype}: only uint8 images are "
                               f"read (uint8 is index {uint8})")
    arr = _exact(data[8 + 4 * rank:], tuple(shape), key)
    if big and arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[2] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)  # torchvision's CHW
    return _rgb(arr, key)


def to_image(codec: str, data: bytes, key: str, mode: int = 0, width: int = 0, height: int = 0
             ) -> bytes | np.ndarray:
    """The payload ``data`` of sample ``key`` as encoded bytes or RGB pixels; DecodeError when it is not one
    (whatever is wrong with a damaged payload: its headers are other files' bytes)."""
    try:
        return _to_image(codec, data, key, mode, width, height)
    except (ValueError, OverflowError, IndexError, TypeError, struct.error) as e:
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(key, f"a damaged {codec} payload of {len(data):,} bytes ({type(e).__name__}: {e})") from None


def _to_image(codec: str, data: bytes, key: str, mode: int, width: int, height: int) -> bytes | np.ndarray:
    """``mode``, ``width``, ``height``: an FFCV RGBImageField's per-sample metadata."""
    if codec == "encoded":
        return data
    if codec == "ffcv-rgb":
        if mode == 0:
            return data
        if mode != 1:
            raise DecodeError(key, f"FFCV image mode {mode} (0 is JPEG, 1 is raw): damaged metadata")
        return _exact(data, (height, width, 3), key)
    if codec.startswith("raw:"):
        return _rgb(_exact(data, raw_shape(codec), key), key)
    if codec == "pil":
        return _pil(data, key)
    if codec.startswith("mds-ndarray"):
        return _mds_ndarray(codec, data, key)
    if codec in ("litdata-numpy", "litdata-tensor"):
        return _litdata_array(codec, data, key)
    raise DecodeError(key, f"unknown image codec {codec!r}")
