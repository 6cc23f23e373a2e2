"""A command's parameters made from an options dataclass: one per field declared with
:func:`cachebuild.options.option`, so a flag's name, help, default, choices and bounds are written once.

``cachebuild train`` (``loaders.train.cli``), ``show`` and ``report`` (``loaders.inspect_cli``) and each build
command's source options (``cachebuild.cli_build``) are made so::

    @dataclass(frozen=True)
    class Options:
        epochs: int = option(1, "Passes over the data.", min=1)

        def __post_init__(self) -> None:
            check_fields(self)

    cmd = click.Command("run", params=field_options(Options), callback=lambda **kw: go(Options(**kw)))

A field becomes ``--field-name`` (or its ``flag=``), a positional argument with ``argument=True``; its click
type follows its annotation and declaration (``click.Choice`` of its choices, ``IntRange``/``FloatRange`` of
its bounds, ``click.Path`` for a path, an on/off switch for a bool), and its callback checks the value as the
dataclass checks it, so a bad value is a usage error naming the flag before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from cachebuild.options import REQUIRED, Declared, declared

__all__ = ["field_options"]


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


def _whole(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def _type(d: Declared) -> Any:
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


def _checked(d: Declared) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """The click callback: the value held to the field's declaration as the dataclass holds it, so that what
    click's type let through but the field refuses (a NaN, an unknown model) is the flag's usage error."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return value  # not given: the field's default, or click's "missing" for a required one
        try:
            d.check_value(value)
            d.check_more(value)
        except ValueError as e:  # OptionError included
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
        return value

    return callback


def _parameter(d: Declared) -> click.Parameter:
    f, flag = d.field, d.flag
    required = f.default is REQUIRED
    default: Any = None if required else f.default
    if isinstance(default, tuple):
        default = ",".join(default)  # shown as typed
    if flag.argument:
        return click.Argument([f.name], type=_type(d), required=required, metavar=flag.metavar,
                              callback=_checked(d))
    name, *short = (flag.flag or "--" + f.name.replace("_", "-")).split()  # "--quiet -q": a short spelling too
    common: dict[str, Any] = {"default": default, "help": flag.help, "hidden": flag.hidden,
                              "callback": _checked(d)}
    if d.kind is bool and flag.choices is None:
        if "/" not in name and (d.optional or default is not False):
            name = f"{name}/--no-{name[2:]}"  # a switch with an off spelling: --progress/--no-progress
        return click.Option([name, *short, f.name], is_flag=True, **common)
    if flag.bare is not None:  # a flag whose value may be left out: --wait [SECONDS]
        common.update(is_flag=False, flag_value=flag.bare)
    return click.Option([name, *short, f.name], type=_type(d), required=required, show_default=flag.show_default,
                        metavar=flag.metavar, **common)


def field_options(options: type) -> list[click.Parameter]:
    """One parameter per declared field of the dataclass ``options``, in field order, named as the field (so
    ``options(**kwargs)`` takes what click passes)."""
    return [_parameter(d) for d in declared(options)]
