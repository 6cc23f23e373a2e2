"""The one registry of source kinds, and the recipes that let a plan be made again.

A kind is one module with a :class:`~cachebuild.sources.kind.SourceKind` (name, options dataclass, ``plan()``)
and one line in ``_KINDS`` (or a call to :func:`register_source`); the ``cachebuild`` build commands are
generated from this table. Kinds are imported on first use.

A recipe is small JSON kept in the manifest (``source.recipe``): the kind, what the user named (a path made
absolute, so that it names the same tree wherever ``status`` runs; a URL without its credentials) and the
options as they made that plan. :func:`plan_source` attaches it to every
plan, so no source writes its own; :func:`replan` makes the plan again (``cachebuild status``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

from cachebuild.errors import SourceError
from cachebuild.sources.kind import SourceKind, SourceOptions
from cachebuild.sources.plan import Plan
from cachebuild.storage.locations import is_url, redact

__all__ = ["get_source", "plan_source", "recipe_of_old_cache", "register_source", "replan", "source_names"]

# name -> "module:attribute" (a SourceKind class or instance)
_KINDS: dict[str, str] = {
    "imagenet": "cachebuild.sources.imagenet:ImagenetSource",
    "cifar10": "cachebuild.sources.cifar:CIFAR10",
    "cifar100": "cachebuild.sources.cifar:CIFAR100",
    "folder": "cachebuild.sources.folder:FolderSource",
    "wds": "cachebuild.sources.shards.wds:WdsSource",
    "parquet": "cachebuild.sources.shards.parquet:ParquetSource",
    "ffcv": "cachebuild.sources.peers.ffcv:FfcvSource",
    "mds": "cachebuild.sources.peers.mds:MdsSource",
    "litdata": "cachebuild.sources.peers.litdata:LitdataSource",
}
_LOADED: dict[str, SourceKind] = {}

# Caches built before recipes were recorded name only their dataset: these were planned by the kind of the
# same name, any other by the class-folder tree (the kinds that release had).
_BEFORE_RECIPES = ("imagenet", "cifar10", "cifar100")


def register_source(name: str, target: str | SourceKind) -> None:
    """Add a source kind: ``target`` is a SourceKind instance or a ``"module:attribute"`` string."""
    if isinstance(target, SourceKind):
        _LOADED[name] = target
        _KINDS[name] = f"{type(target).__module__}:{type(target).__qualname__}"
    else:
        _KINDS[name] = target
        _LOADED.pop(name, None)


def source_names() -> tuple[str, ...]:
    return tuple(_KINDS)


def get_source(name: str) -> SourceKind:
    """The kind ``name`` (a named error for one this release does not know)."""
    kind = _LOADED.get(name)
    if kind is None:
        if name not in _KINDS:
            raise SourceError(f"source kind {name!r} is not known to this cachebuild (it knows "
                              f"{', '.join(_KINDS)}); upgrade cachebuild to plan it")
        module, attr = _KINDS[name].split(":")
        found = getattr(importlib.import_module(module), attr)
        kind = _LOADED[name] = found() if isinstance(found, type) else found
    return kind


def plan_source(name: str, src: str | os.PathLike[str], options: SourceOptions | None = None, *,
                classes: list[str] | None = None, jobs: int = 1) -> list[Plan]:
    """The plans of ``src`` as kind ``name`` makes them, each carrying the recipe that makes it again."""
    kind = get_source(name)
    options = options if options is not None else kind.options()
    if not isinstance(options, kind.options):
        raise TypeError(f"source kind {name!r} takes {kind.options.__name__}, not {type(options).__name__}")
    kind.check()
    plans = kind.plan(os.fspath(src), options, classes=classes, jobs=jobs)
    given = {"classes_given": classes is not None} if kind.pins_classes else {}
    named = os.fspath(src)
    named = redact(named) if is_url(named) else os.path.abspath(named)
    return [dataclasses.replace(p, recipe={"kind": name, "src": named,
                                           **options.recipe_of(p), **given}) for p in plans]


def replan(recipe: dict[str, Any], src: str | os.PathLike[str] | None, classes: list[str]) -> Plan:
    """The plan ``recipe`` describes, of ``src`` (default: the source it was made from). ``classes``: the
    cache's class list, for sources whose classes were given rather than found."""
    name = str(recipe.get("kind"))
    try:
        kind = get_source(name)
    except SourceError:
        raise SourceError(f"this cachebuild cannot re-plan a source of kind {name!r}") from None
    where = os.fspath(src) if src is not None else str(recipe.get("src", ""))
    options = kind.options.from_dict(recipe)
    given = classes if kind.pins_classes and recipe.get("classes_given") else None
    kind.check()
    return kind.plan(where, options, classes=given)[0]


def recipe_of_old_cache(dataset: str, split: str) -> dict[str, Any]:
    """The recipe of a cache built before recipes were recorded, from its manifest's dataset and split."""
    kind = dataset if dataset in _BEFORE_RECIPES else "folder"
    return {"kind": kind, "split": split, "dataset": dataset}
