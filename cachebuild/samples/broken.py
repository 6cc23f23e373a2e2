"""Writers of the bad files a real image tree holds, each one in a given folder.

Every function writes one file (named like an ImageNet JPEG unless told otherwise) and returns its
path, so a test can put the file in a class folder and check that a build skips it, lists it in the
manifest, or refuses it before decoding.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from cachebuild.samples.photos import photo_bank, render_sample

__all__ = ["BROKEN_KINDS", "write_all_broken", "write_dangling_symlink", "write_empty_file", "write_pixel_bomb_jpeg",
           "write_pixel_bomb_png", "write_text_as_jpeg", "write_truncated_jpeg"]


def write_truncated_jpeg(folder: Path, name: str = "truncated.JPEG", keep: float = 0.6, seed: int = 0) -> Path:
    """The first ``keep`` fraction of a real 400x300 JPEG's bytes (a cut download): no EOI marker."""
    if not 0.0 < keep < 1.0:
        raise ValueError(f"keep must be in (0, 1), got {keep}")
    bank = photo_bank()
    buf = io.BytesIO()
    Image.fromarray(render_sample(bank, seed % len(bank), 400, 300, np.random.default_rng(seed))).save(
        buf, format="JPEG", quality=90)
    data = buf.getvalue()
    path = Path(folder) / name
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def write_empty_file(folder: Path, name: str = "empty.JPEG") -> Path:
    """A zero-byte file."""
    path = Path(folder) / name
    path.write_bytes(b"")
    return path


def write_text_as_jpeg(folder: Path, name: str = "not_an_image.JPEG") -> Path:
    """A text file (an HTML error page, as failed crawls leave) with an image name."""
    path = Path(folder) / name
    path.write_text("<html><head><title>404 Not Found</title></head>\n<body><h1>Not Found</h1><p>The requested URL "
                    "was not found on this server.</p></body></html>\n", encoding="ascii")
    return path


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def write_pixel_bomb_png(folder: Path, name: str = "pixel_bomb.JPEG", side: int = 30000) -> Path:
    """A valid PNG of ``side`` x ``side`` black pixels that is only a few hundred KB on disk.

    1-bit grayscale keeps writing fast (``side * side / 8`` bytes go through zlib); decoding it to
    RGB uint8 would need ``3 * side**2`` bytes (2.7 GB at 30000), so a reader must refuse it from
    the header. Named ``.JPEG`` by default, as a bomb in a crawled tree would be.
    """
    if side < 1 or side > 2**31 - 1:
        raise ValueError(f"side must be in [1, 2**31 - 1], got {side}")
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte 0 + packed 1-bit zeros
    comp = zlib.compressobj(level=6)
    feed = max(1, (1 << 22) // len(row))  # rows per compress() call: about 4 MiB
    block = row * feed
    parts = [comp.compress(block) for _ in range(side // feed)]
    parts += [comp.compress(row * (side % feed)), comp.flush()]
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit gray, deflate, no interlace
    png = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", b"".join(parts))
    png += _png_chunk(b"IEND", b"")
    path = Path(folder) / name
    path.write_bytes(png)
    return path


def write_pixel_bomb_jpeg(folder: Path, name: str = "pixel_bomb_sof.JPEG", width: int = 65500,
                          height: int = 65500) -> Path:
    """A tiny 16x16 JPEG whose SOF0 header is patched to declare ``width`` x ``height``.

    The entropy data is that of 16x16 pixels, so a decoder that trusts the header allocates
    ``3 * width * height`` bytes (12.9 GB by default) before finding the data short.
    """
    if not (1 <= width <= 65535 and 1 <= height <= 65535):
        raise ValueError(f"JPEG dimensions are 16-bit: got {width}x{height}")
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 64, 32)).save(buf, format="JPEG", quality=90)
    data = bytearray(buf.getvalue())
    i = 2
    while i + 4 <= len(data):  # walk the marker segments up to SOF0 (FFC0)
        if data[i] != 0xFF:
            raise RuntimeError("unexpected JPEG structure from PIL")
        marker = data[i + 1]
        seg_len = struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker == 0xC0:
            # segment: length(2) precision(1) height(2) width(2) ...
            data[i + 5 : i + 9] = struct.pack(">HH", height, width)
            break
        i += 2 + seg_len
    else:
        raise RuntimeError("no SOF0 marker in PIL's baseline JPEG")
    path = Path(folder) / name
    path.write_bytes(bytes(data))
    return path


def write_dangling_symlink(folder: Path, name: str = "unreadable.JPEG") -> Path:
    """A symlink to a file that does not exist: listed by ``os.scandir``, fails on open.

    (The tests run as root, where ``chmod 000`` does not make a file unreadable.)
    """
    path = Path(folder) / name
    target = Path(folder) / ".missing-target-of-unreadable.JPEG"
    if path.is_symlink() or path.exists():
        path.unlink()
    os.symlink(target, path)
    return path


BROKEN_KINDS: tuple[str, ...] = ("truncated", "empty", "text", "bomb_png", "bomb_jpeg", "unreadable")


def write_all_broken(folder: Path, prefix: str = "", seed: int = 0) -> dict[str, Path]:
    """Every kind of :data:`BROKEN_KINDS` in ``folder``; file names are ``prefix`` + a fixed stem."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "truncated": write_truncated_jpeg(folder, f"{prefix}truncated.JPEG", seed=seed),
        "empty": write_empty_file(folder, f"{prefix}empty.JPEG"),
        "text": write_text_as_jpeg(folder, f"{prefix}not_an_image.JPEG"),
        "bomb_png": write_pixel_bomb_png(folder, f"{prefix}pixel_bomb.JPEG"),
        "bomb_jpeg": write_pixel_bomb_jpeg(folder, f"{prefix}pixel_bomb_sof.JPEG"),
        "unreadable": write_dangling_symlink(folder, f"{prefix}unreadable.JPEG"),
    }
