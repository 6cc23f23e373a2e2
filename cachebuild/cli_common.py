"""Merged into :mod:`cachebuild.options` (``wait_option``, ``setup_logging``); this module stays only until the
build commands import them from there (then it goes)."""

from __future__ import annotations

import math
from typing import Any

import click

from cachebuild.options import setup_logging, wait_option

__all__ = ["WAIT", "setup_logging"]

WAIT: dict[str, Any] = dict(type=click.FloatRange(min=0), is_flag=False, flag_value=math.inf, default=None,
                            metavar="[SECONDS]", help=wait_option().metadata["cli"].help)
