"""Every ``CACHEBUILD_*`` environment variable, declared once: its name, type, default, meaning and check.

:func:`settings` reads them all from the environment as it is when called, never at import, so a variable
set (or changed) after ``import cachebuild`` counts from the next call on. A value that cannot work raises
:class:`~cachebuild.errors.OptionError` naming the variable, what it holds and a value that would do; an
unset or empty variable is its default. The table in ``docs/settings.md`` lists the same knobs, and
``python -m doctools.check_docs`` holds it to :data:`KNOBS` (every knob, its default).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachebuild.errors import OptionError

__all__ = ["KNOBS", "Knob", "Settings", "defaults", "knobs", "settings"]


def _whole(minimum: int, below: str) -> Callable[[str], int]:
    """A parser of whole numbers of at least ``minimum`` (``below``: the message for a smaller one)."""
    def parse(text: str) -> int:
        try:
            value = int(text)  # int() takes surrounding whitespace itself
        except ValueError:
            raise ValueError("is not a whole number") from None
        if value < minimum:
            raise ValueError(below)
        return value
    return parse


_count = _whole(1, "must be at least 1")
_files = _whole(0, "must be 0 (off) or more")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be positive")
    return value


_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _switch(text: str) -> bool:
    try:
        return _SWITCH[text.strip().lower()]
    except KeyError:
        raise ValueError("is neither 1 (on) nor 0 (off)") from None


def _folder(text: str) -> Path:
    return Path(text).expanduser()


def _text(text: str) -> str | None:
    """Any text (surrounding whitespace dropped); empty is unset (None)."""
    return text.strip() or None


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``default`` is written as a user would set it (the docs' table shows it)."""

    env: str
    default: str
    meaning: str
    parse: Callable[[str], Any]  # the text to the value; ValueError(why) for a value that cannot work
    example: str = ""  # a good value for the error message (default: the default)
    secret: bool = False  # a credential: never shown (not in messages, not in the settings' repr)

    def read(self, environ: Mapping[str, str]) -> Any:
        raw = environ.get(self.env, "")
        if not raw.strip():
            return self.parse(self.default)
        try:
            return self.parse(raw)
        except ValueError as e:
            shown = "(its value not shown)" if self.secret else f"={raw!r}"
            raise OptionError(f"{self.env}{shown} {e}; unset it or give e.g. "
                              f"{self.env}={self.example or self.default}") from None


def _knob(env: str, default: str, meaning: str, parse: Callable[[str], Any], example: str = "",
          secret: bool = False) -> Any:
    return dataclasses.field(metadata={"knob": Knob(env, default, meaning, parse, example, secret)},
                             repr=not secret)


@dataclass(frozen=True)
class Settings:
    """The knobs' values at one moment (:func:`settings`); one field per variable."""

    retries: int = _knob("CACHEBUILD_RETRIES", "10", "Tries of one remote request (a cache's file, a source's "
                         "shard, a push's upload) before it fails.", _count)
    retry_budget_s: float = _knob("CACHEBUILD_RETRY_BUDGET", "120", "Seconds one remote call (a request, or a "
                                  "batch's group of them) may take, its retries and waits included.", _seconds)
    http_timeout_s: float = _knob("CACHEBUILD_HTTP_TIMEOUT", "60", "Seconds without a byte from a server that end "
                                  "a request as stalled (it is then tried again).", _seconds)
    home: Path = _knob("CACHEBUILD_HOME", "~/.cache/cachebuild", "Where a build without --out writes: "
                       "HOME/DATASET-SIZE[-FIT][-STORAGE]/SPLIT.", _folder)
    pin_versions: bool = _knob("CACHEBUILD_PIN_VERSIONS", "1", "Pin a reader of a URL to the file versions "
                               "(ETags) it opened; 0 for a server that answers If-Match wrongly.", _switch)
    hedge: bool = _knob("CACHEBUILD_HEDGE", "1", "Send a second request for a late range read; 0 turns it off.",
                        _switch)
    hedge_factor: float = _knob("CACHEBUILD_HEDGE_FACTOR", "3", "A read is late after this many times the "
                                "recent median of reads of its size.", _seconds)
    hedge_after_s: float = _knob("CACHEBUILD_HEDGE_AFTER", "0.05", "Seconds before which no read is hedged.",
                                 _seconds)
    readahead_files: int = _knob("CACHEBUILD_READAHEAD_FILES", "1", "Files read ahead, whole, past the one a "
                                 "sequential read of a URL cache with a block cache is in; 0 turns readahead off.",
                                 _files, example="2")
    push_stale_s: float = _knob("CACHEBUILD_PUSH_STALE_S", "300", "Seconds after its last renewal that a push's "
                                "claim on a URL counts as abandoned (another host may take it over); the "
                                "holder stops at half of it and renews it every tenth of it, at most 30 s.",
                                _seconds)
    store: str | None = _knob("CACHEBUILD_STORE", "", "The team store a build command asks first when it is given "
                              "no --store: a folder, s3:// or http(s):// URL (unset: none).", _text,
                              example="s3://team/caches")
    lease_s: float = _knob("CACHEBUILD_LEASE_S", "600", "Seconds a reader's lease on a store's cache lasts after "
                           "its last renewal (readers renew it every tenth of it, at most every 60 s): gc never "
                           "removes a cache with a live lease.", _seconds)
    http_token: str | None = _knob("CACHEBUILD_HTTP_TOKEN", "", "The bearer token sent to http(s):// stores and "
                                   "caches (a `cachebuild serve` server); never printed or logged.", _text,
                                   example="$(cat ~/.cachebuild-token)", secret=True)


def knobs() -> list[tuple[str, Knob]]:
    """(field name, knob) of every variable, in declaration order."""
    return [(f.name, f.metadata["knob"]) for f in dataclasses.fields(Settings)]


KNOBS: tuple[Knob, ...] = tuple(k for _, k in knobs())


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Every knob read from ``environ`` (default: ``os.environ`` as it is now)."""
    env = os.environ if environ is None else environ
    return Settings(**{name: k.read(env) for name, k in knobs()})


def defaults() -> Settings:
    """The knobs' values when none is set."""
    return settings({})
