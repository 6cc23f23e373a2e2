"""Options declared once: a dataclass field carries its flag, help, choices and bounds beside its one default.

:func:`option` declares a field; :func:`check_fields`, called in the dataclass's ``__post_init__``, holds an
instance to the declarations, and :func:`field_options` makes a command's click parameters from the same
declarations, so a value is checked alike from Python and from the command line::

    @dataclass(frozen=True)
    class RunOptions(Options):  # Options.__post_init__: check_fields(self)
        cache: str = option(REQUIRED, None, argument=True, metavar="CACHE")
        epochs: int = option(1, "Passes over the data.", min=1)

    run = command("run", RunOptions, go)  # calls go(RunOptions(...)); go's docstring is the help

A field becomes ``--field-name`` (or its ``flag=``), or a positional argument with ``argument=True``; its
click type follows its annotation (``int``, ``float``, ``bool``, ``str``, ``Path``, a tuple, each optionally
``| None``) and declaration (``click.Choice`` of its choices, a range of its bounds, ``click.Path`` for a
path, an on/off switch for a bool), and a bad value is a usage error naming the flag before anything runs.

``parse_*`` are the checks, one per kind of value, each raising :class:`OptionError` that names the option;
the options dataclasses without flags (``BuildOptions``) call them directly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from cachebuild.errors import OptionError

__all__ = ["REQUIRED", "Options", "OptionsCommand", "check_fields", "command", "field_options", "option", "parse_bool",
           "parse_choice", "parse_float", "parse_int", "parse_optional_bool", "parse_path", "quiet_option",
           "setup_logging", "wait_option"]

T = TypeVar("T")


def parse_choice(name: str, value: Any, choices: Collection[str]) -> str:
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
        rng = " and ".join(x for x in ("" if minimum is None else f">= {minimum}",
                                       "" if maximum is None else f"<= {maximum}") if x)
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
    """How a dataclass field is offered and checked (its default stays with the field)."""

    help: str | None
    flag: str | None = None  # default: --field-name ("--x/--no-x" for a switch with an off spelling)
    short: str | None = None  # e.g. "-j"
    metavar: str | None = None
    choices: Collection[str] | None = None
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
    hidden: bool = False  # not listed in --help (an old spelling whose ``check`` names the new one)
    flag_value: Any = None  # the value of the flag given bare: ``--wait`` alone waits forever


def option(default: Any, help: str | None, **cli: Any) -> Any:
    """A dataclass field with its flag: ``option(1, "Micro-batches per step.", min=1)``,
    ``option("all", "Split.", choices=("train", "all"))``; ``option(REQUIRED, ...)`` has no default."""
    if default is REQUIRED:
        return dataclasses.field(metadata={"cli": Flag(help, **cli)})
    return dataclasses.field(default=default, metadata={"cli": Flag(help, **cli)})


@dataclass(frozen=True)
class _Declared:
    name: str  # the field's
    field: dataclasses.Field[Any]
    flag: Flag
    kind: type  # int, float, bool, str, Path, tuple...
    optional: bool  # None is a value

    def check(self, value: Any, *, named: bool = True) -> None:
        """``value`` as the declaration allows it; OptionError naming the field (the field's own ``check``'s
        why names it only when ``named``: a flag's usage error names the flag already)."""
        flag = self.flag
        if (value is None and self.optional) or (value is not None and value == flag.flag_value):
            return
        if flag.choices is not None:
            parse_choice(self.name, value, flag.choices)
        elif self.kind is bool:
            parse_bool(self.name, value)
        elif self.kind is int:
            parse_int(self.name, value, _whole(flag.min), _whole(flag.max))
        elif self.kind is float:
            parse_float(self.name, value, flag.min, flag.max, min_open=flag.min_open, max_open=flag.max_open)
        elif flag.path is not None:
            parse_path(self.name, value)
        elif not isinstance(value, self.kind) or (isinstance(value, tuple) and
                                                  not all(isinstance(v, str) for v in value)):
            words = _WORDS.get(self.kind, self.kind.__name__)
            raise OptionError(f"{self.name} must be {words}; got {value!r}")
        if flag.check is not None and value is not None:
            try:
                flag.check(value)
            except OptionError:
                raise
            except ValueError as e:
                raise OptionError(f"{self.name}: {e}" if named else str(e)) from None


_WORDS: dict[type, str] = {str: "a string", tuple: "a list of strings"}


def _whole(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


@functools.cache
def _declared(options: Any) -> tuple[_Declared, ...]:
    """The fields of the dataclass ``options`` declared with :func:`option`, in field order."""
    try:
        hints = typing.get_type_hints(options)
    except (NameError, TypeError):  # an annotation this module cannot resolve: the default's type then
        hints = {}
    out = []
    for f in dataclasses.fields(options):
        flag = f.metadata.get("cli")
        if flag is not None:
            out.append(_Declared(f.name, f, flag, *_kind(hints.get(f.name), f.default)))
    return tuple(out)


def _kind(hint: Any, default: Any) -> tuple[type, bool]:
    """(the value type, None allowed) of an annotation such as ``int | None`` or ``tuple[str, ...]``."""
    if hint is None:
        return (type(default) if default is not None and default is not REQUIRED else str), default is None
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    kinds = [typing.get_origin(a) or a for a in args if a is not type(None)]
    return (kinds[0] if len(kinds) == 1 and isinstance(kinds[0], type) else object), len(kinds) < len(args)


@dataclass(frozen=True)
class Options:
    """Base of an options dataclass: its declared fields are checked when an instance is made (a subclass with
    checks of its own calls ``super().__post_init__()`` first)."""

    def __post_init__(self) -> None:
        check_fields(self)


def check_fields(obj: Any) -> None:
    """Check every declared field of the dataclass instance ``obj`` (its ``__post_init__`` calls this):
    OptionError naming the first field whose value its declaration does not allow."""
    cls: Any = type(obj)
    for d in _declared(cls):
        d.check(getattr(obj, d.name))


# ---------------------------------------------------------------- the command-line parameters

class _Parsed(click.ParamType):
    """A field's ``parse`` as a click type: a ValueError is the flag's usage error."""

    name = "text"

    def __init__(self, parse: Callable[[str], Any]) -> None:
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _type(d: _Declared) -> Any:
    flag = d.flag
    if flag.choices is not None:
        return click.Choice(list(flag.choices))
    if flag.parse is not None:
        return _Parsed(flag.parse)
    if flag.path is not None:
        return click.Path(file_okay=flag.path != "dir", dir_okay=flag.path != "file", exists=flag.exists,
                          path_type=Path if d.kind is Path else None)
    bounded = flag.min is not None or flag.max is not None
    if d.kind is int:
        return click.IntRange(_whole(flag.min), _whole(flag.max), min_open=flag.min_open,
                              max_open=flag.max_open) if bounded else click.INT
    if d.kind is float:
        return click.FloatRange(flag.min, flag.max, min_open=flag.min_open, max_open=flag.max_open) if bounded \
            else click.FLOAT
    return None  # text: click's STRING


def _checked(d: _Declared) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """The click callback: the value held to the field's declaration as the dataclass holds it, so that what
    click's type let through but the field refuses (a NaN, an unknown model) is the flag's usage error."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return value  # not given: the field's default, or click's "missing" for a required one
        try:
            d.check(value, named=False)
        except OptionError as e:
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
        return value

    return callback


def _parameter(d: _Declared) -> click.Parameter:
    f, flag = d.field, d.flag
    required = f.default is REQUIRED
    default: Any = None if required else f.default
    if isinstance(default, tuple):
        default = ",".join(default)  # shown as typed
    if flag.argument:
        return click.Argument([f.name], type=_type(d), required=required, metavar=flag.metavar,
                              callback=_checked(d))
    name = flag.flag or "--" + f.name.replace("_", "-")
    names = [name, *([flag.short] if flag.short else []), f.name]
    common: dict[str, Any] = {"default": default, "help": flag.help, "hidden": flag.hidden,
                              "callback": _checked(d)}
    if d.kind is bool and flag.choices is None:
        if "/" not in name and (d.optional or default is not False):
            names[0] = f"{name}/--no-{name[2:]}"  # a switch with an off spelling: --progress/--no-progress
        return click.Option(names, is_flag=True, **common)
    if flag.flag_value is not None:
        common.update(is_flag=False, flag_value=flag.flag_value)
    return click.Option(names, type=_type(d), required=required, show_default=flag.show_default,
                        metavar=flag.metavar, **common)


def field_options(options: type) -> list[click.Parameter]:
    """One parameter per declared field of the dataclass ``options``, in field order, named as the field (so
    ``options(**kwargs)`` takes what click passes)."""
    return [_parameter(d) for d in _declared(options)]


class OptionsCommand(click.Command):
    """A command made from an options dataclass (:func:`command`); ``options`` is that class."""

    def __init__(self, name: str, options: type, run: Callable[[Any], None]) -> None:
        def callback(**given: Any) -> None:
            try:
                made = options(**given)
            except OptionError as e:
                raise click.UsageError(str(e)) from None
            run(made)

        super().__init__(name, params=field_options(options), callback=callback, help=inspect.getdoc(run))
        self.options = options


def command(name: str, options: type[T], run: Callable[[T], None]) -> OptionsCommand:
    """The command ``name``: its parameters are ``options``' fields, its body ``run(options(**given))``, its help
    ``run``'s docstring. A check across fields (the dataclass's own) is a usage error."""
    return OptionsCommand(name, options, run)


# ---------------------------------------------------------------- what several commands share

def wait_option() -> Any:
    """``--wait [SECONDS]``, of the commands that take the lock of an output (build, pull, push, columns)."""
    return option(None, "If another cachebuild process builds or pulls the same output: wait for it (up to "
                        "SECONDS; forever without a value) instead of exiting with its name.",
                  flag="--wait", metavar="[SECONDS]", min=0, flag_value=math.inf, show_default=False)


def quiet_option() -> Any:
    return option(False, "Only warnings and errors.", short="-q")


def setup_logging(quiet: bool, verbose: bool = False) -> None:
    """The ``cachebuild`` logger to stderr, bare messages: warnings only (``quiet``), debug (``verbose``) or info."""
    log = logging.getLogger("cachebuild")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
