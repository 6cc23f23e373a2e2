"""What a source kind is: a name, a frozen options dataclass that parses and serialises itself, and ``plan()``.

Registered once in :mod:`cachebuild.sources.registry` (which attaches each plan's recipe, so that ``cachebuild
status`` can make it again); the build command of a kind is made from its options' fields
(:func:`~cachebuild.options.option`: flag, help and choices beside the field's one default). A new kind::

    @dataclass(frozen=True)
    class ListingOptions(SourceOptions):
        split: str = option("train", "Name of the split the listing is.")
        dataset: str | None = option(None, "Dataset name.", flag="--name")

    class ListingSource(SourceKind):
        name, options, help = "listing", ListingOptions, "A listing of path,label rows at SRC."

        def plan(self, src, options, *, classes=None, jobs=1):
            return [file_plan(options.dataset or "listing", options.split, root, keys, labels, classes)]

    register_source("listing", ListingSource())  # or one line in registry._KINDS

(``tests/cachebuild/sources/test_sources_registry.py`` builds and re-plans such a kind through the CLI.)
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from cachebuild.options import Options, option
from cachebuild.sources.plan import Plan

__all__ = ["SourceKind", "SourceOptions", "option"]

O = TypeVar("O", bound="SourceOptions")


@dataclass(frozen=True)
class SourceOptions(Options):
    """Base of the options of a source kind: JSON values, checked when made (so a recipe or call that cannot plan
    fails naming the field), flat ``to_dict``/``from_dict`` (a kind whose recipes nest some fields overrides both)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[O], data: dict[str, Any]) -> O:
        """The options ``data`` records; keys this release does not know are ignored, missing ones default."""
        return cls(**{f.name: _from_json(data[f.name]) for f in dataclasses.fields(cls) if f.name in data})

    def recipe_of(self, plan: Plan) -> dict[str, Any]:
        """These options as they made ``plan`` (``to_dict``'s form): its split and dataset name, where the options
        left them open (``--split all``, no ``--name``), so that planning them again gives this plan alone."""
        data = self.to_dict()
        data.update({k: getattr(plan, k) for k in ("split", "dataset") if k in data})
        return data


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _from_json(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class SourceKind(ABC):
    """One kind of source. ``name`` is the ``cachebuild`` command and the recipe's ``kind``."""

    name: ClassVar[str]
    options: ClassVar[type[SourceOptions]]
    #: the command's help: what SRC may be
    help: ClassVar[str]
    #: SRC may be a URL (else a local path)
    url_src: ClassVar[bool] = True
    #: --size: default, help, and where it sits among the kind's own flags (help order)
    default_size: ClassVar[int] = 224
    size_help: ClassVar[str] = "Output side S."
    size_at: ClassVar[int] = 1
    #: plans take a given class list (the recipe records whether one was; re-planning passes the cache's)
    pins_classes: ClassVar[bool] = False
    #: the command offers --classes FILE (after --size)
    classes_flag: ClassVar[bool] = False

    def check(self) -> None:
        """Before planning: raise :class:`~cachebuild.errors.SourceError` for a missing optional dependency."""
        return None  # most kinds need nothing beyond the base install

    @abstractmethod
    def plan(self, src: str, options: Any, *, classes: list[str] | None = None, jobs: int = 1) -> list[Plan]:
        """The plans of ``src`` (one per split the options ask for), without recipes: the registry adds them."""

