"""What a cache claims about how it was made (its manifest's recipe), and whether a reference can redo it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachebuild.errors import CacheBuildError
from cachebuild.format.manifest import Manifest

__all__ = ["FITS", "INTERPOLATIONS", "KINDS", "ParityInputError", "Recipe", "need_scipy", "recipe_of"]

KINDS = ("folder", "imagenet", "cifar10", "cifar100", "parquet")  # the kinds with an independent reference
FITS = ("crop", "squash", "pad")
INTERPOLATIONS = ("antialias", "area", "linear")


class ParityInputError(CacheBuildError):
    """Bad input for ``parity`` (exit 2): not a cache, a source of another kind, a recipe with no reference."""


def need_scipy() -> None:
    """parity's two-sample tests (and the ImageNet devkit's ``.mat`` files) read with scipy, an optional extra:
    without it, :class:`ParityInputError` naming it, before any work."""
    try:
        import scipy.io
        import scipy.stats  # noqa: F401
    except ImportError:
        raise ParityInputError("cachebuild parity needs scipy for its statistical tests: "
                               "pip install 'cachebuild[scipy]'") from None


@dataclass(frozen=True)
class Recipe:
    """The parts of a manifest that say which reference to use."""

    kind: str
    split: str
    size: int
    fit: str
    interpolation: str  # antialias | area | linear (the "+jpeg-dct-reduce" suffix dropped: same reference)
    codec: str | None  # "jpeg" for compact caches: pixels compared after decode
    options: dict[str, Any]

    def describe(self) -> str:
        codec = f", {self.codec} q{self.options.get('quality', '?')}" if self.codec else ""
        return f"{self.kind} {self.split}, {self.size} px, --fit {self.fit}, {self.interpolation}{codec}"


def recipe_of(m: Manifest) -> Recipe:
    """The cache's recipe; :class:`ParityInputError` naming what cannot be reproduced."""
    recipe = m.source.get("recipe")
    if not isinstance(recipe, dict) or not recipe.get("kind"):
        raise ParityInputError("the cache records no source recipe (built by an older release): rebuild it with "
                               "this release to check it")
    kind = str(recipe["kind"])
    if kind not in KINDS:
        raise ParityInputError(f"no independent reference for source kind {kind!r}: parity checks "
                               f"{', '.join(KINDS)}")
    h, w, _ = m.shape
    if h != w:
        raise ParityInputError(f"samples are {h}x{w}: cachebuild builds square samples, this recipe has no reference")
    interp = m.interpolation.split("+")[0]
    if m.fit not in FITS or interp not in INTERPOLATIONS:
        raise ParityInputError(f"--fit {m.fit} / interpolation {m.interpolation}: no torchvision reference for it")
    codec = m.build.get("codec")
    opts = {k: v for k, v in recipe.items() if k not in ("kind", "src")}
    if codec:
        opts["quality"] = m.build.get("quality")
    return Recipe(kind, m.split, h, m.fit, interp, str(codec) if codec else None, opts)


def source_folder(recipe: Recipe, src: Path) -> Path:
    """The folder of the cache's split in ``src`` as the build was given it (ImageNet: ``src/<split>``)."""
    if not src.exists():
        raise ParityInputError(f"{src} does not exist: pass the source the cache was built from to --source")
    if recipe.kind == "imagenet":
        folder = src / recipe.split
        if not folder.is_dir():
            raise ParityInputError(f"{src} has no {recipe.split}/ folder: the cache was built from an ImageNet "
                                   f"tree (train/, val/); pass that tree's root to --source")
        return folder
    if recipe.kind == "folder" and not src.is_dir():
        raise ParityInputError(f"{src} is not a folder: the cache was built from a class-folder tree")
    return src
