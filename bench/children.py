"""Run one contender in a child process and watch it: its JSON answer, the peak resident memory of its
whole process tree (it and its workers), and its wall time. Build contenders and every peer run this
way, so each pays its own imports and worker start-up outside its timed part and has its own RSS.

Watching must not slow the contender. RSS is read every 100 ms from each process's counters (cheap). PSS
needs the kernel to walk every page table of the tree (~25 ms for a build's 1 GB tree), and sampling it
every 50 ms took half a core from the contender: cachebuild's build measured 2.38 s watched that way
against 2.13 s unwatched, bare decoding (small tree) 1.73 against 1.60 s. PSS is therefore read at the
start, every 0.5 s while the tree's RSS grows by 10% from the last reading (start-up, mostly before the
clock), and every 2 s otherwise.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil

__all__ = ["ChildError", "run_child"]


class ChildError(RuntimeError):
    """A contender's process failed; the message ends with its last output lines."""


def _tree_memory(proc: psutil.Process, with_pss: bool) -> tuple[int, int]:
    """(RSS, PSS or 0) summed over a process and its descendants. RSS counts pages shared between the
    processes (libraries, torch) once per process; PSS splits each shared page between its sharers, so its
    sum is the tree's real footprint (and costly to read: see the module doc)."""
    rss = pss = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            if with_pss:
                m = p.memory_full_info()
                rss, pss = rss + m.rss, pss + getattr(m, "pss", m.rss)
            else:
                rss += p.memory_info().rss
        except psutil.Error:
            continue
    return rss, pss


def run_child(cmd: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
              cwd: str | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """``(answer, {"rss": peak bytes, "pss": peak bytes})`` of the child's process tree: ``answer`` is the
    last line of its stdout that parses as a JSON object. Raises :class:`ChildError` on a non-zero exit, a
    time-out or no answer."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    watched = psutil.Process(proc.pid)
    peak = {"rss": 0, "pss": 0}
    stop = threading.Event()

    def sample() -> None:
        last_pss, rss_at_pss = -1e9, 0
        while not stop.is_set():
            rss, pss = _tree_memory(watched, with_pss=False)
            now = time.monotonic()
            # at the start, then at most every 0.5 s while the tree grows by 10%, else every 2 s
            if now - last_pss >= (0.5 if rss > 1.1 * rss_at_pss else 2.0):
                rss, pss = _tree_memory(watched, with_pss=True)
                last_pss, rss_at_pss = now, rss
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        stop.set()
        raise ChildError(f"{' '.join(cmd[:4])}... ran past {timeout:.0f} s:\n{out[-2000:]}") from None
    finally:
        stop.set()
        sampler.join()
    if proc.returncode != 0:
        raise ChildError(f"{' '.join(cmd[:4])}... exited with {proc.returncode}:\n{out[-3000:]}")
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line), peak
            except ValueError:
                continue
    raise ChildError(f"{' '.join(cmd[:4])}... printed no JSON answer:\n{out[-2000:]}")
