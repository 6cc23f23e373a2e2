"""A contact sheet: samples in a grid, each tile captioned, with the geometry of every tile returned
beside the image (so a test, or a caller, can find sample ``i``'s pixels in the sheet).

Captions are drawn in DejaVu Sans (the system's or matplotlib's copy: Latin, Greek, Cyrillic, Hebrew, Arabic
and more), and a character it lacks in the first installed font that has it (CJK where such a font is
installed); what no font draws stays a box, and the sheet lists it (``missing_glyphs``) for the caller to say.

Tiles show the stored pixels exactly: small samples are enlarged by a whole factor (nearest neighbour,
each pixel a ``scale`` x ``scale`` block), never resampled. An optional second image per tile (what the
device transforms made of the sample) sits to its right at the same scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["BACKGROUND", "Sheet", "Tile", "compose_sheet", "shorten"]

BACKGROUND = (24, 24, 24)
TEXT = (235, 235, 235)
MIN_SIDE = 96  # tiles smaller than this (CIFAR's 32 px) are enlarged by a whole factor
PAD = 4
GAP = 4  # between a stored tile and its augmented twin
FONT_SIZE = 11
LINE = 13
CAPTION_LINES = 3
MIN_CELL_WIDTH = 120  # room for a readable caption under tiny tiles


@dataclass(frozen=True)
class Tile:
    """One sample on the sheet: where its pixels are (x0, y0, x1, y1; end-exclusive) and what its caption says."""

    index: int
    label: int
    class_name: str
    path: str
    stored: tuple[int, int, int, int]
    augmented: tuple[int, int, int, int] | None
    caption: tuple[str, ...]


@dataclass
class Sheet:
    image: np.ndarray  # uint8 (H, W, 3)
    tiles: list[Tile] = field(default_factory=list)
    columns: int = 0
    scale: int = 1
    missing_glyphs: str = ""  # characters of the captions no installed font draws (shown as boxes)

    def save(self, path: str | Path | IO[bytes]) -> Path | IO[bytes]:
        """The sheet as a PNG, to a path or into a binary file; returns where."""
        target = path if not isinstance(path, str | Path) else Path(path)
        Image.fromarray(self.image).save(target, format="PNG", optimize=False, compress_level=1)
        return target


# A private-use code point: no font has a glyph for it, so it draws as a font's "missing glyph" box.
_NO_GLYPH = "\U0010fffd"
_MAX_FALLBACK_FONTS = 200  # system fonts tried for a character DejaVu Sans lacks (once per character)


def _dejavu() -> ImageFont.FreeTypeFont | None:
    """DejaVu Sans (Latin, Greek, Cyrillic, Armenian, Georgian, Hebrew, Arabic and more): the system's copy
    (Pillow looks in the system's font folders), else the one matplotlib ships."""
    try:
        return ImageFont.truetype("DejaVuSans.ttf", FONT_SIZE)
    except OSError:
        pass
    try:
        import matplotlib
    except ImportError:
        return None
    try:
        return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts/ttf/DejaVuSans.ttf"), FONT_SIZE)
    except OSError:
        return None


def _system_font_files() -> list[str]:
    """Every font file of the system, as matplotlib's font manager lists them (none without matplotlib)."""
    try:
        from matplotlib import font_manager
    except ImportError:
        return []
    return sorted(font_manager.findSystemFonts())[:_MAX_FALLBACK_FONTS]


class _Glyphs:
    """The font that draws each character of a caption: DejaVu Sans, else the first system font that has a glyph
    for it (CJK, say, where one is installed), else none (drawn as a box by the first font, and reported).
    A font lacks a glyph when the character renders as its missing-glyph box."""

    def __init__(self) -> None:
        primary = _dejavu()
        self.fonts: list[ImageFont.FreeTypeFont | ImageFont.ImageFont] = \
            [primary] if primary is not None else [ImageFont.load_default(size=FONT_SIZE)]
        self._fallback_files: list[str] | None = None  # listed on the first character the fonts above lack
        self._fallbacks: dict[str, ImageFont.FreeTypeFont | None] = {}
        self._boxes: dict[int, bytes] = {}
        self._memo: dict[str, ImageFont.FreeTypeFont | ImageFont.ImageFont | None] = {}

    @property
    def first(self) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
        return self.fonts[0]

    def _render(self, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, ch: str) -> bytes:
        im = Image.new("L", (3 * FONT_SIZE, 3 * FONT_SIZE))
        ImageDraw.Draw(im).text((FONT_SIZE, FONT_SIZE // 2), ch, font=font, fill=255)
        return im.tobytes()

    def _has(self, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, ch: str) -> bool:
        box = self._boxes.get(id(font))
        if box is None:
            box = self._boxes[id(font)] = self._render(font, _NO_GLYPH)
        return self._render(font, ch) != box

    def _fallback(self, path: str) -> ImageFont.FreeTypeFont | None:
        if path not in self._fallbacks:
            try:
                self._fallbacks[path] = ImageFont.truetype(path, FONT_SIZE)
            except OSError:  # a font Pillow cannot read (a bitmap font, a broken file)
                self._fallbacks[path] = None
        return self._fallbacks[path]

    def font_for(self, ch: str) -> ImageFont.FreeTypeFont | ImageFont.ImageFont | None:
        """The font that draws ``ch``; None when no font here has it."""
        if ch.isascii() or ch == "\u2026":
            return self.first  # every font draws ASCII and the ellipsis of a shortened name
        if ch in self._memo:
            return self._memo[ch]
        found = self.first if self._has(self.first, ch) else None
        if found is None:
            if self._fallback_files is None:
                self._fallback_files = _system_font_files()
            for path in self._fallback_files:
                font = self._fallback(path)
                if font is not None and self._has(font, ch):
                    found = font
                    break
        self._memo[ch] = found
        return found

    def runs(self, text: str) -> list[tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont]]:
        """``text`` cut into runs drawn by one font each (a character no font has: the first font's box)."""
        out: list[tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont]] = []
        for ch in text:
            font = self.font_for(ch) or self.first
            if out and out[-1][1] is font:
                out[-1] = (out[-1][0] + ch, font)
            else:
                out.append((ch, font))
        return out

    def missing(self, text: str) -> set[str]:
        return {ch for ch in text if self.font_for(ch) is None}

    def length(self, text: str) -> float:
        return sum(font.getlength(run) for run, font in self.runs(text))

    def draw(self, draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, fill: tuple[int, ...]) -> None:
        x, y = xy
        for run, font in self.runs(text):
            draw.text((x, y), run, fill=fill, font=font)
            x += font.getlength(run)


@lru_cache(maxsize=1)
def _glyphs() -> _Glyphs:
    return _Glyphs()


def shorten(text: str, width: float) -> str:
    """``text`` cut in the middle with an ellipsis to fit ``width`` pixels (file names keep their end)."""
    glyphs = _glyphs()
    if glyphs.length(text) <= width:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # the most characters kept (head 1/3, tail 2/3) that still fit
        mid = (lo + hi + 1) // 2
        head = mid // 3
        cand = text[:head] + "\u2026" + text[len(text) - (mid - head):]
        if glyphs.length(cand) <= width:
            lo = mid
        else:
            hi = mid - 1
    head = lo // 3
    return text[:head] + "\u2026" + text[len(text) - (lo - head):] if lo else "\u2026"


def _enlarge(img: np.ndarray, scale: int) -> np.ndarray:
    return img if scale == 1 else np.repeat(np.repeat(img, scale, axis=0), scale, axis=1)


def compose_sheet(stored: np.ndarray, indices: Sequence[int], labels: Sequence[int], class_names: Sequence[str],
                  paths: Sequence[str], *, augmented: np.ndarray | None = None, columns: int | None = None) -> Sheet:
    """Lay ``stored`` (uint8 (N, H, W, 3)) out in ``columns`` columns, captioned: ``#index  label`` / class
    name / source file. ``augmented`` (uint8 (N, h, w, 3)) goes beside each stored tile."""
    n, h, w = stored.shape[:3]
    cols = max(1, min(n, columns or min(8, max(1, math.ceil(math.sqrt(n))))))
    rows = max(1, math.ceil(n / cols))
    scale = max(1, math.ceil(MIN_SIDE / max(h, w)))
    ah, aw = (augmented.shape[1:3] if augmented is not None else (0, 0))
    pics_w = w * scale + ((GAP + aw * scale) if augmented is not None else 0)
    cell_w = max(pics_w, MIN_CELL_WIDTH) + 2 * PAD
    cell_h = max(h, ah) * scale + 2 * PAD + CAPTION_LINES * LINE
    sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    glyphs = _glyphs()
    missing: set[str] = set()
    tiles = []
    for k in range(n):
        x0, y0 = (k % cols) * cell_w + PAD, (k // cols) * cell_h + PAD
        sheet.paste(Image.fromarray(_enlarge(stored[k], scale)), (x0, y0))
        box = (x0, y0, x0 + w * scale, y0 + h * scale)
        abox = None
        if augmented is not None:
            ax = x0 + w * scale + GAP
            sheet.paste(Image.fromarray(_enlarge(augmented[k], scale)), (ax, y0))
            abox = (ax, y0, ax + aw * scale, y0 + ah * scale)
        room = cell_w - 2 * PAD
        title = f"#{indices[k]}  label {labels[k]}"
        caption = tuple(shorten(t, room) for t in (title, class_names[k], paths[k]))
        ty = y0 + max(h, ah) * scale + 2
        for line, text in enumerate(caption):
            glyphs.draw(draw, (x0, ty + line * LINE), text, TEXT)
            missing |= glyphs.missing(text)
        tiles.append(Tile(int(indices[k]), int(labels[k]), class_names[k], paths[k], box, abox, caption))
    return Sheet(np.asarray(sheet), tiles, cols, scale, "".join(sorted(missing)))
