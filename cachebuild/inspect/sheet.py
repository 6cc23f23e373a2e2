"""A contact sheet: samples in a grid, each tile captioned, with the geometry of every tile returned
beside the image (so a test, or a caller, can find sample ``i``'s pixels in the sheet).

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

    def save(self, path: str | Path | IO[bytes]) -> Path | IO[bytes]:
        """The sheet as a PNG, to a path or into a binary file; returns where."""
        target = path if not isinstance(path, str | Path) else Path(path)
        Image.fromarray(self.image).save(target, format="PNG", optimize=False, compress_level=1)
        return target


@lru_cache(maxsize=1)
def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=FONT_SIZE)


def shorten(text: str, width: float) -> str:
    """``text`` cut in the middle with an ellipsis to fit ``width`` pixels (file names keep their end)."""
    font = _font()
    if font.getlength(text) <= width:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # the most characters kept (head 1/3, tail 2/3) that still fit
        mid = (lo + hi + 1) // 2
        head = mid // 3
        cand = text[:head] + "\u2026" + text[len(text) - (mid - head):]
        if font.getlength(cand) <= width:
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
            draw.text((x0, ty + line * LINE), text, fill=TEXT, font=_font())
        tiles.append(Tile(int(indices[k]), int(labels[k]), class_names[k], paths[k], box, abox, caption))
    return Sheet(np.asarray(sheet), tiles, cols, scale)
