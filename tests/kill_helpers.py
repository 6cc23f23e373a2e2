"""A real ``cachebuild`` CLI build killed part way (SIGKILL of its whole process group), for resume tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["build_killed_after_blocks"]


def build_killed_after_blocks(args: list[str], blocks: Path, after: int = 3, timeout: float = 60) -> int:
    """Run ``python -m cachebuild *args``; SIGKILL it and its workers once ``blocks`` holds ``after`` block
    records (or at ``timeout``); returns how many records the killed build left."""
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and len(list(blocks.glob("*.json"))) < after:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return len(list(blocks.glob("*.json")))
