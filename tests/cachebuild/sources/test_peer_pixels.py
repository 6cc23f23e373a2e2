"""The peers' raw pixel payloads (MDS and LitData PIL layout, MDS ndarray, LitData numpy and tensor, FFCV raw)
decoded as PIL's convert("RGB") would, the rest refused per sample with the reason; and a peer file changed
after planning is never read."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from PIL import Image

from cachebuild.errors import DecodeError
from cachebuild.sources.peers.common import PeerOptions
from cachebuild.sources.peers.mds import mds_plan
from cachebuild.sources.peers.pixels import check_codec, to_image
from tests.cachebuild.sources.peer_files.peer_checks import HERE, copy_of

RNG = np.random.default_rng(7)
RGB = RNG.integers(0, 256, (5, 7, 3), dtype=np.uint8)


def _pil(im: Image.Image) -> bytes:
    mode = im.mode.encode()
    return struct.pack("<III", im.width, im.height, len(mode)) + mode + im.tobytes()


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "I;16"])
def test_pil_payloads_read_as_pils_convert_rgb(mode):
    im = Image.fromarray(RGB).convert(mode) if mode != "I;16" else Image.fromarray(RGB[..., 0].astype(np.uint16))
    got = to_image("pil", _pil(im), "k")
    assert isinstance(got, np.ndarray) and got.flags.writeable and got.shape == (5, 7, 3)
    assert np.array_equal(got, np.asarray(im.convert("RGB"))), mode


def test_arrays_of_every_layout_the_writers_use():
    grey = RGB[..., 0]
    rgba = np.concatenate([RGB, np.full((5, 7, 1), 9, np.uint8)], axis=2)
    # MDS ndarray: per-sample dtype code (8 = uint8) and shape (ndim << 2 | shape dtype code 0 = uint8)
    dyn = bytes([8, 3 << 2]) + bytes([5, 7, 3]) + RGB.tobytes()
    assert np.array_equal(to_image("mds-ndarray", dyn, "k"), RGB)
    assert np.array_equal(to_image("mds-ndarray:uint8", bytes([2 << 2, 5, 7]) + grey.tobytes(), "k"),
                          np.repeat(grey[..., None], 3, axis=2))
    assert np.array_equal(to_image("raw:5,7,4", rgba.tobytes(), "k"), RGB)  # alpha dropped
    # LitData numpy: little-endian dtype index (4 = uint8), rank, dims; tensor: big-endian (11 = uint8), CHW
    numpy = struct.pack("<5I", 4, 3, 5, 7, 3) + RGB.tobytes()
    assert np.array_equal(to_image("litdata-numpy", numpy, "k"), RGB)
    chw = struct.pack(">5I", 11, 3, 3, 5, 7) + np.ascontiguousarray(RGB.transpose(2, 0, 1)).tobytes()
    assert np.array_equal(to_image("litdata-tensor", chw, "k"), RGB)
    # FFCV RGBImageField: mode 1 raw of the recorded size, mode 0 JPEG bytes passed through
    assert np.array_equal(to_image("ffcv-rgb", RGB.tobytes(), "k", mode=1, width=7, height=5), RGB)
    assert to_image("ffcv-rgb", b"\xff\xd8jpeg", "k", mode=0) == b"\xff\xd8jpeg"


@pytest.mark.parametrize(("codec", "data", "why"), [
    ("mds-ndarray", bytes([34, 2 << 2, 2, 2]) + bytes(16), "dtype float32: only uint8"),
    ("litdata-numpy", struct.pack("<4I", 9, 2, 2, 2) + bytes(16), "dtype index 9: only uint8"),
    ("raw:5,7,3", RGB.tobytes()[:-1], "104 bytes of pixels where shape (5, 7, 3) needs 105"),
    ("litdata-numpy", struct.pack("<3I", 4, 1, 30) + bytes(30), "shape (30,) is not an image"),
    ("ffcv-rgb", bytes(3), "FFCV image mode 7"),
    ("pil", b"\x01\x00", "shorter than its 12-byte header"),
    ("pil", _pil(Image.fromarray(RGB).convert("P")), "a palette image .mode P. stored without its palette"),
])
def test_payloads_that_are_not_images_fail_their_sample_with_the_reason(codec, data, why):
    with pytest.raises(DecodeError, match="^k: .*" + why.replace("(", r"\(").replace(")", r"\)")):
        to_image(codec, data, "k", mode=7 if codec == "ffcv-rgb" else 0)


def test_unknown_codecs_are_refused():
    check_codec("raw:4,4")
    with pytest.raises(ValueError, match="unknown image codec 'webp-raw'"):
        check_codec("webp-raw")


def test_a_shard_rewritten_after_planning_is_not_read(tmp_path):
    src = copy_of(HERE / "mds", tmp_path / "mds")
    plan = mds_plan(src, PeerOptions(image_field="pil"))
    shard = src / "shard.00000.mds"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DecodeError, match=r"shard\.00000\.mds changed after the build planned it"):
        plan.reader.for_block(0, 1)(0, plan.keys[0])
    later = plan.keys.index("shard.00001.mds#0")
    assert isinstance(plan.reader(later, plan.keys[later]), np.ndarray)  # the other shards still read
