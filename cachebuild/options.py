"""Options: checks for their values, and options declared once on a dataclass's fields.

``parse_*``: one check per kind of value, each raising :class:`OptionError` that names the option. Used by
the frozen option dataclasses (``BuildOptions``, ``TrainConfig``) in ``__post_init__``, so a value that
cannot work is refused when the options are made, not hours later (the manifest parsers follow the same
pattern for values read back from disk).

:func:`option` declares a field with its flag, help, choices and bounds beside its one default;
:func:`check_fields` holds an instance to those declarations, and :func:`cachebuild.flags.field_options`
makes a command's parameters from the same ones (``cachebuild train``, ``show``, ``report`` and the build
commands' source options).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachebuild.errors import OptionError

__all__ = ["REQUIRED", "Declared", "Flag", "check_fields", "declared", "flag_of", "option", "parse_bool",
           "parse_choice", "parse_float", "parse_int", "parse_optional_bool", "parse_path"]


def parse_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def parse_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None, *,
              optional: bool = False, not_zero: bool = False) -> int | None:
    """An int (not a bool, not a float) in ``[minimum, maximum]``; ``None`` allowed when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum) or \
            (not_zero and value == 0):
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum is None else f"<= {maximum}"
        rng = " and ".join(x for x in (lo, hi) if x)
        raise OptionError(f"{name} must be {rng}{' and not 0' if not_zero else ''}; got {value}")
    return value


def parse_float(name: str, value: Any, minimum: float | None = None, maximum: float | None = None, *,
                min_open: bool = False, max_open: bool = False, optional: bool = False) -> float | None:
    """A finite real number in the given (half-)open or closed range; ints are accepted."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise OptionError(f"{name} must be a finite number; got {value!r}")
    too_low = minimum is not None and (value <= minimum if min_open else value < minimum)
    too_high = maximum is not None and (value >= maximum if max_open else value > maximum)
    if too_low or too_high:
        lo = "" if minimum is None else f"{'>' if min_open else '>='} {minimum}"
        hi = "" if maximum is None else f"{'<' if max_open else '<='} {maximum}"
        raise OptionError(f"{name} must be {' and '.join(x for x in (lo, hi) if x)}; got {value}")
    return float(value)


def parse_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"{name} must be True or False; got {value!r}")
    return value


def parse_optional_bool(name: str, value: Any) -> bool | None:
    return None if value is None else parse_bool(name, value)


def parse_path(name: str, value: Any, *, optional: bool = False) -> str | None:
    """A non-empty path (str or os.PathLike), returned as str."""
    if value is None and optional:
        return None
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise OptionError(f"{name} must be a path; got {value!r}")
    return str(os.fspath(value))


# ---------------------------------------------------------------- options declared on dataclass fields

REQUIRED: Any = dataclasses.MISSING  # option(REQUIRED, ...): a field (and a flag) without a default


@dataclass(frozen=True)
class Flag:
    """How a dataclass field is offered and checked: its flag, help and limits (the default stays with the field).

    The value's type is the field's annotation (``int``, ``float``, ``bool``, ``str``, ``Path``, a tuple, each
    optionally ``| None``); ``choices``, the bounds and ``check`` narrow it. :func:`check_fields` holds a
    dataclass to these when it is made and :func:`cachebuild.flags.field_options` makes the command-line
    parameters from them, so that a limit is written once for both.
    """

    help: str | None
    flag: str | None = None  # default: --field-name; "--x/--no-x": a switch with an off spelling; "--x -x": short
    metavar: str | None = None
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None  # the typed text to the value (ValueError: a bad value)
    show_default: bool | str = True
    min: float | None = None  # bounds of an int or float
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    check: Callable[[Any], None] | None = None  # a further check of a set value: raise ValueError(why)
    path: str | None = None  # "dir" / "file": the value names a folder / a file ("any": either)
    exists: bool = False  # the command refuses a path that does not exist
    argument: bool = False  # a positional argument of the command (``metavar`` names it)
    hidden: bool = False  # not listed in --help (testing switches)
    bare: Any = None  # the value of the flag given without one (``--wait`` alone: math.inf, as long as it takes)


def option(default: Any, help: str | None, **cli: Any) -> Any:
    """A dataclass field with its flag: ``option(1, "Micro-batches per step.", min=1)``,
    ``option("all", "Split.", choices=("train", "all"))``; ``option(REQUIRED, ...)`` has no default."""
    if default is REQUIRED:
        return dataclasses.field(metadata={"cli": Flag(help, **cli)})
    return dataclasses.field(default=default, metadata={"cli": Flag(help, **cli)})


def flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    return f.metadata.get("cli")


@dataclass(frozen=True)
class Declared:
    """One declared field of an options dataclass: its flag, value type and whether None is a value."""

    field: dataclasses.Field[Any]
    flag: Flag
    kind: type  # int, float, bool, str, Path, tuple...
    optional: bool

    @property
    def name(self) -> str:
        return self.field.name

    def check_value(self, value: Any, name: str | None = None) -> None:
        """``value`` as the declaration allows (type, choices, bounds); OptionError naming ``name``. The
        further ``check`` is :meth:`check_more`'s."""
        name = name or self.name
        flag = self.flag
        if value is None and self.optional:
            return
        if flag.choices is not None:
            parse_choice(name, value, flag.choices)
        elif self.kind is bool:
            parse_bool(name, value)
        elif self.kind is int:
            parse_int(name, value, _whole(flag.min), _whole(flag.max))
        elif self.kind is float:
            if value == math.inf and value == flag.bare:  # "forever", the bare flag's value
                return
            parse_float(name, value, flag.min, flag.max, min_open=flag.min_open, max_open=flag.max_open)
        elif flag.path is not None:
            parse_path(name, value)
        elif not isinstance(value, self.kind) or (isinstance(value, tuple) and not all(isinstance(v, str)
                                                                                     for v in value)):
            raise OptionError(f"{name} must be {_WORDS.get(self.kind) or self.kind.__name__}; got {value!r}")

    def check_more(self, value: Any) -> None:
        """The field's own ``check`` of a set value: ValueError(why), the why not naming the field."""
        if self.flag.check is not None and value is not None:
            self.flag.check(value)


_WORDS: dict[type, str] = {str: "a string", tuple: "a list of strings"}


def _whole(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def declared(options: type) -> tuple[Declared, ...]:
    """The fields of the dataclass ``options`` that declare a flag (:func:`option`), in field order."""
    return _declared(options)


@functools.cache
def _declared(options: Any) -> tuple[Declared, ...]:
    try:
        hints = typing.get_type_hints(options)
    except (NameError, TypeError):  # an annotation this module cannot resolve: the default's type then
        hints = {}
    out = []
    for f in dataclasses.fields(options):
        flag = flag_of(f)
        if flag is None:
            continue
        kind, optional = _kind(hints.get(f.name), f.default)
        out.append(Declared(f, flag, kind, optional))
    return tuple(out)


def _kind(hint: Any, default: Any) -> tuple[type, bool]:
    """(the value type, None allowed) of an annotation such as ``int | None`` or ``tuple[str, ...]``."""
    if hint is None:
        return (type(default) if default is not None and default is not REQUIRED else str), default is None
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = [typing.get_origin(a) or a for a in args if a is not type(None)]
    return (kinds[0] if len(kinds) == 1 and isinstance(kinds[0], type) else object), len(kinds) < len(args)


def check_fields(obj: Any) -> None:
    """Check every declared field of the dataclass instance ``obj`` (its ``__post_init__`` calls this):
    OptionError naming the first field whose value its declaration does not allow."""
    for d in declared(type(obj)):
        value = getattr(obj, d.name)
        d.check_value(value)
        try:
            d.check_more(value)
        except OptionError:
            raise
        except ValueError as e:
            raise OptionError(f"{d.name}: {e}") from None
