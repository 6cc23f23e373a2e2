"""How a plan was made, so that it can be made again: ``cachebuild status`` re-plans a cache's source
exactly as its build did (same kind of source, same options) and compares fingerprints.

A recipe is small JSON kept in the manifest (``source.recipe``): the source kind, what the user named
(a path, or a URL without its credentials) and the planner's options. Every planner attaches one with
:func:`with_recipe`; :func:`replan` dispatches on the kind.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from cachebuild.errors import SourceError
from cachebuild.sources.plan import Plan
from cachebuild.storage.names import redact

__all__ = ["replan", "with_recipe"]


def with_recipe(plan: Plan, kind: str, src: str | os.PathLike[str], **options: Any) -> Plan:
    """``plan`` carrying the recipe that made it (``options`` must be JSON values)."""
    return dataclasses.replace(plan, recipe={"kind": kind, "src": redact(os.fspath(src)), **options})


def replan(recipe: dict[str, Any], src: str | os.PathLike[str] | None, classes: list[str]) -> Plan:
    """The plan ``recipe`` describes, of ``src`` (default: the source it was made from). ``classes``: the
    cache's class list, for sources whose classes were given rather than found."""
    kind = recipe.get("kind")
    where = os.fspath(src) if src is not None else str(recipe.get("src", ""))
    split = str(recipe.get("split") or "") or None
    if kind == "imagenet":
        from cachebuild.sources.imagenet import imagenet_plans

        return imagenet_plans(where, split or "all")[0]
    if kind in ("cifar10", "cifar100"):
        from cachebuild.sources.cifar import cifar_plans

        return cifar_plans(where, kind, split or "all")[0]
    if kind == "folder":
        from cachebuild.sources.folder import folder_plan

        return folder_plan(where, dataset=recipe["dataset"], split=split or "train",
                           classes=classes if recipe.get("classes_given") else None)
    if kind == "wds":
        from cachebuild.sources.wds import WdsLayout, wds_plan

        options: dict[str, Any] = dict(recipe["layout"])
        layout = WdsLayout(**{**options, "image_keys": tuple(options["image_keys"])})
        return wds_plan(where, split=split, classes=classes if recipe.get("classes_given") else None,
                        layout=layout, dataset=recipe["dataset"])
    if kind == "parquet":
        from cachebuild.sources.parquet import ParquetColumns, parquet_plan

        return parquet_plan(where, split=split, classes=classes if recipe.get("classes_given") else None,
                            columns=ParquetColumns(**recipe["columns"]), dataset=recipe["dataset"])
    raise SourceError(f"this cachebuild cannot re-plan a source of kind {kind!r}")
