"""Run in a spawned child (a build worker's situation); this module imports no torch, so the child only has
torch if the code under test imported it."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from cachebuild.build.block import _init_worker
from cachebuild.build.decode import ResizeSpec, decode_into


def decode_in_worker(side: int, conn: Any) -> None:
    """A build worker's start (its initialiser) and one decode of a ``side`` x ``side`` picture to 16 px; send
    (torch imported?, torch's thread count or None)."""
    _init_worker()
    out = np.empty((16, 16, 3), np.uint8)
    decode_into(np.full((side, side, 3), 7, np.uint8), ResizeSpec(16), out)
    torch = sys.modules.get("torch")
    conn.send(("torch" in sys.modules, torch.get_num_threads() if torch is not None else None))
