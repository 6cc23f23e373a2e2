"""Which files of a class-folder tree (local or at a URL) are images: torchvision's rule."""

from __future__ import annotations

__all__ = ["IMG_EXTENSIONS"]

# torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively as ImageFolder does.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
