"""Checks for option values, one per kind, each raising :class:`OptionError` that names the option.

Used by the frozen option dataclasses (``BuildOptions``, ``TrainConfig``) in ``__post_init__``, so a
value that cannot work is refused when the options are made, not hours later (the manifest parsers
follow the same pattern for values read back from disk).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from cachebuild.errors import OptionError

__all__ = ["parse_bool", "parse_choice", "parse_float", "parse_int", "parse_optional_bool", "parse_path"]


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
