"""What the ``cachebuild`` command modules share: logging setup and the ``--wait`` option."""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import click

__all__ = ["WAIT", "setup_logging"]

# --wait [SECONDS], for the commands that take the lock of an output (build, pull, push)
WAIT: dict[str, Any] = dict(
    type=click.FloatRange(min=0), is_flag=False, flag_value=math.inf, default=None, metavar="[SECONDS]",
    help="If another cachebuild process builds or pulls the same output: wait for it (up to SECONDS; forever "
         "without a value) instead of exiting with its name.")


def setup_logging(quiet: bool, verbose: bool) -> None:
    """The ``cachebuild`` logger to stderr, bare messages: warnings only (``quiet``), debug (``verbose``) or info."""
    log = logging.getLogger("cachebuild")
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
