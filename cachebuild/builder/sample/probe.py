"""A source file's header, read before any decode: its size and format, the size limit, truncation and
damaged PNG chunks refused with a reason. No OpenCV here (PIL only for formats the fast path leaves to it).
"""

from __future__ import annotations

import io
import threading

__all__ = ["PIL_LIMIT_LOCK", "probe"]

# PIL's bomb limit is a module global: lifted under this lock for header reads (here and in the decoder)
PIL_LIMIT_LOCK = threading.Lock()


# JPEG start-of-frame markers (baseline, extended, progressive, lossless...): C0-CF except DHT, JPG, DAC.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_or_png_size(data: bytes) -> tuple[int, int, str] | None:
    """(height, width, format) read straight from a JPEG SOF or PNG IHDR; None leaves the file to PIL.

    Only a shortcut: PIL's generic open costs ~0.1 ms a file (a tenth of a decode) mostly parsing JPEG
    tables that are not needed here. Anything unusual (no SOF before the scan, a zero height that a DNL
    marker would define later, other formats) goes to PIL, which also names the damage.
    """
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big"), "PNG"
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _SOF_MARKERS:
            if i + 9 > n:
                return None
            height, width = int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
            return (height, width, "JPEG") if height and width else None
        if marker in (0xDA, 0xD9):  # scan or end of image before any frame header
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def _pil_size(data: bytes) -> tuple[int, int, str]:
    from PIL import Image

    try:
        # PIL's own bomb check would refuse at its fixed limit before ours is applied: lift it for the
        # header read only (under a lock, as it is a module global).
        with PIL_LIMIT_LOCK:
            saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            try:
                with Image.open(io.BytesIO(data)) as im:
                    width, height = im.size
                    return height, width, im.format or "?"
            finally:
                Image.MAX_IMAGE_PIXELS = saved
    except Image.UnidentifiedImageError:
        raise ValueError("not an image (unrecognised file header)") from None
    except Exception as e:  # PIL raises SyntaxError, OSError... for damaged headers
        raise ValueError(f"damaged image header ({type(e).__name__}: {e})") from None


def probe(data: bytes, max_pixels: int) -> tuple[int, int, str]:
    """(height, width, format) from the header alone; refuses empty, non-image, oversized and truncated data."""
    if not data:
        raise ValueError("empty file (0 bytes)")
    height, width, fmt = _jpeg_or_png_size(data) or _pil_size(data)
    if width * height > max_pixels:
        raise ValueError(
            f"refused before decoding: {width}x{height} = {width * height:,} pixels is over the limit of "
            f"{max_pixels:,} (raise it with --max-pixels if the image is genuine)"
        )
    # OpenCV decodes a truncated JPEG without error and fills the rest with grey: check the end marker
    # (after any trailing padding; the common case is decided on the last 16 bytes without a copy).
    eoi = b"\xff\xd9"
    if fmt in ("JPEG", "MPO") and eoi not in data[-16:] and eoi not in data.rstrip(b"\x00\r\n\t ")[-16:]:
        raise ValueError("truncated JPEG (no end-of-image marker)")
    if fmt == "PNG":
        if b"IEND" not in data[-16:]:
            raise ValueError("truncated PNG (no IEND chunk)")
        _check_png_chunks(data)
    return height, width, fmt


def _check_png_chunks(data: bytes) -> None:
    """Every chunk must fit in the file. OpenCV 5 allocates what a chunk's length field declares before
    reading it: a 4 KB file declaring a 2 GB IDAT cost 2 GB of memory per worker (found by fuzzing)."""
    pos, n = 8, len(data)
    while pos + 8 <= n:
        length = int.from_bytes(data[pos : pos + 4], "big")
        if pos + 12 + length > n:
            kind = data[pos + 4 : pos + 8].decode("latin-1")
            raise ValueError(f"damaged PNG: chunk {kind!r} declares {length:,} bytes past the end of the file")
        if data[pos + 4 : pos + 8] == b"IEND":
            return
        pos += 12 + length

