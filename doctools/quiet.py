"""Comparisons only from quiet runs: which results folders were measured on a quiet machine, which is the
newest quiet full run, and the checker's rule that holds README.md and docs/ to them.

A **quiet** measurement is one whose 1-minute load average at the start (``load_average_at_start``: the first
of the three, in ``machine`` of a results.json, or anywhere in another results file) was at most
:data:`QUIET_LOAD` on this 2-core box; a file without one is not quiet (nothing says it was). A **full run** is
``python -m bench --profile full`` with at least the build, load, transforms and train sections; the newest
is the last by its ``run.started``.

A **comparison** is a line (of prose, or a table row) outside code with a figure and either a ratio figure
(``1.45x``) or a comparative word near it (faster, slower, ahead, behind, against, than, beats, in our favour,
outperforms). The rule (:func:`comparison_problems`):

1. each figure of a comparison must be found in a cited results file that is quiet (figures found only in
   noisy files are refused, naming the file and its load);
2. a comparison found in a full run must be found in the newest quiet full run (an older full run is refused
   once a newer quiet one exists). Runs of single scripts (faults, A/B rounds of one change) are not full
   runs: the full run does not measure them, so they may be cited when quiet;
3. generated blocks that compare contenders (``performance``, ``peers``, ``headline``, ``imagenet``,
   ``compact``, ``augment``: from a results.json) must come from the newest quiet full run (write their
   SOURCE as :data:`QUIET_FULL`).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

__all__ = ["COMPARING_KINDS", "QUIET_FULL", "QUIET_LOAD", "figure_run_problem", "full_runs", "is_comparison",
           "is_comparison_header",
           "load_of", "newest_quiet_full", "run_problems"]

QUIET_LOAD = 1.5
QUIET_FULL = "bench/results/@quiet-full"  # a block SOURCE: the newest quiet full run, found anew each time
COMPARING_KINDS = ("performance", "peers", "headline", "imagenet", "compact", "augment")
FULL_SECTIONS = {"build", "load", "transforms", "train"}
COMPARATIVE = re.compile(r"\b(?:faster|slower|ahead|behind|against|than|beats?|outperforms?|in our favour)\b", re.I)
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?![a-zA-Z0-9])")


def is_comparison(line: str) -> bool:
    """A line with a ratio figure, or with a comparative word (the caller knows it holds a figure)."""
    return bool(RATIO.search(line) or COMPARATIVE.search(line))


HEADER = re.compile(r"\bx\b|\bratio|\bours\b|cachebuild /| / cachebuild", re.I)


def is_comparison_header(header: str) -> bool:
    """A table whose header row compares (``x ImageFolder``, ``cachebuild / peer``, ``ours / Lightning``)."""
    return bool(header and (COMPARATIVE.search(header) or HEADER.search(header)))


def _find_load(v: Any) -> float | None:
    if isinstance(v, dict):
        if "load_average_at_start" in v:
            got = v["load_average_at_start"]
            got = got[0] if isinstance(got, list) and got else got
            if isinstance(got, str):
                got = got.split()[0] if got.split() else None
            try:
                return None if got is None else float(got)
            except (TypeError, ValueError):
                return None
        for x in v.values():
            found = _find_load(x)
            if found is not None:
                return found
    elif isinstance(v, list):
        for x in v:
            found = _find_load(x)
            if found is not None:
                return found
    return None


@functools.cache
def _json_load(path: Path) -> float | None:
    try:
        return _find_load(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def load_of(path: Path) -> float | None:
    """The load at the start of what ``path`` (a results file) measured: its own record, else the highest its
    folder's JSON files record (a .md of a run states the run's figures); None when nothing records one."""
    own = _json_load(path) if path.suffix == ".json" else None
    if own is not None:
        return own
    loads = [x for x in (_json_load(p) for p in sorted(path.parent.glob("*.json"))) if x is not None]
    return max(loads) if loads else None


def _run(folder: Path) -> dict[str, Any] | None:
    try:
        res = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run = res.get("run", {})
    if run.get("profile") != "full" or not set(run.get("sections", ())) >= FULL_SECTIONS:
        return None
    return res


def full_runs(repo: Path) -> list[tuple[str, Path, float | None]]:
    """(started, folder, load at the start) of every full run under bench/results, oldest first."""
    out = []
    for folder in sorted(p for p in (repo / "bench" / "results").iterdir() if p.is_dir()):
        res = _run(folder)
        if res is not None:
            out.append((str(res["run"].get("started", "")), folder, _find_load(res.get("machine", {}))))
    return sorted(out, key=lambda r: r[0])


def newest_quiet_full(repo: Path) -> Path:
    """The newest full run whose load at the start was at most QUIET_LOAD."""
    quiet = [folder for _, folder, load in full_runs(repo) if load is not None and load <= QUIET_LOAD]
    if not quiet:
        raise SystemExit(f"no full run under bench/results with a load average at the start <= {QUIET_LOAD}")
    return quiet[-1]


def _load_text(load: float | None) -> str:
    return "records no load average at the start" if load is None else f"load average {load:g} at the start"


def run_problems(where: str, kind: str, folder: Path, repo: Path) -> list[str]:
    """Rule 3: a comparing block's folder is the newest quiet full run."""
    if kind not in COMPARING_KINDS:
        return []
    newest = newest_quiet_full(repo)
    if folder.resolve() == newest.resolve():
        return []
    name = _rel(folder, repo)
    load = _run(folder) and _find_load((_run(folder) or {}).get("machine", {}))
    why = (f"is not a full run ({_load_text(load if isinstance(load, float) else None)})" if _run(folder) is None
           else f"is an older full run than {_rel(newest, repo)}")
    return [f"{where}: the {kind} block compares contenders from {name}, which {why}: its SOURCE should be "
            f"{QUIET_FULL} (the newest full run with a load average at the start <= {QUIET_LOAD})"]


def figure_run_problem(where: str, value: str, text: str, holders: list[Path], repo: Path) -> str | None:
    """Rules 1 and 2 for one figure of a comparison: ``holders`` are the cited files it is found in."""
    quiet = [p for p in holders if (load := load_of(p)) is not None and load <= QUIET_LOAD]
    newest = newest_quiet_full(repo).resolve()
    if not quiet:
        named = ", ".join(f"{_rel(p, repo)} ({_load_text(load_of(p))})" for p in holders)
        return (f"{where}: comparison figure {value} ({text!r}) comes from a noisy run: {named}; quote a run "
                f"whose load average at the start was <= {QUIET_LOAD} (the newest quiet full run: "
                f"{_rel(newest, repo)})")
    fulls = {f.resolve() for _, f, _ in full_runs(repo)}
    if all(p.parent.resolve() in fulls and p.parent.resolve() != newest for p in quiet):
        return (f"{where}: comparison figure {value} ({text!r}) comes from an older full run "
                f"({', '.join(sorted({p.parent.name for p in quiet}))}); quote the newest quiet full run, "
                f"{_rel(newest, repo)}")
    return None


def _rel(p: Path, repo: Path) -> str:
    try:
        return p.resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        return str(p)
