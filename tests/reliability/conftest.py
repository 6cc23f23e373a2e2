"""The reliability suite's table: every trial of every test here is counted in a row, printed at the end.

A trial *survives* when every check of it holds (the data is intact, the message is the promised one,
the resumed build is byte-identical...) and is *lost* otherwise; a lost trial also fails its test.
``make reliability`` runs the whole suite (slow rows too) and writes the table to
``reliability-out/table.json``; ``make test`` runs its fast rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@dataclass
class Row:
    trials: int = 0
    survived: int = 0
    lost: int = 0
    notes: list[str] = field(default_factory=list)
    detail: str = ""


class Ledger:
    """Rows in the order they were first used."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    @contextlib.contextmanager
    def trial(self, row: str, note: str = "") -> Iterator[None]:
        """Count one trial of ``row``: survived if the block completes, lost (and re-raised) if not."""
        r = self.rows.setdefault(row, Row())
        r.trials += 1
        try:
            yield
        except BaseException as e:
            r.lost += 1
            r.notes.append(f"{note}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise
        r.survived += 1

    def add(self, row: str, trials: int, survived: int, lost: int, note: str = "", detail: str = "") -> None:
        """Count trials run elsewhere (e.g. by hypothesis, which also re-runs a failing example to shrink it);
        ``detail`` replaces the row's previous one."""
        r = self.rows.setdefault(row, Row())
        r.trials, r.survived, r.lost = r.trials + trials, r.survived + survived, r.lost + lost
        if note:
            r.notes.append(note)
        if detail:
            r.detail = detail

    def note(self, row: str, detail: str) -> None:
        """A figure shown under the row (e.g. how many kills its trials held)."""
        self.rows.setdefault(row, Row()).detail = detail

    def table(self) -> str:
        width = max([len(k) for k in self.rows] + [20])
        lines = [f"{'row':<{width}}  {'trials':>6}  {'survived':>8}  {'lost':>4}", "-" * (width + 26)]
        for name, r in self.rows.items():
            lines.append(f"{name:<{width}}  {r.trials:>6}  {r.survived:>8}  {r.lost:>4}")
            lines += [f"    ({r.detail})"] if r.detail else []
            lines += [f"    lost: {n}" for n in r.notes[:3]]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {k: {"trials": r.trials, "survived": r.survived, "lost": r.lost, "notes": r.notes,
                    "detail": r.detail} for k, r in self.rows.items()}


LEDGER = Ledger()


@pytest.fixture(scope="session")
def ledger() -> Ledger:
    return LEDGER


_STARTED: dict[str, Any] = {}


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def pytest_sessionstart(session: Any) -> None:
    _STARTED.update(t=time.time(), load=_loadavg())


def _run_info() -> dict[str, Any]:
    """The machine, the commit (and whether the tree had changes) and the wall time of this run."""
    import subprocess

    from bench.machine import machine_info

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return r.stdout.strip()

    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain")),
            "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED["t"])),
            "wall_s": round(time.time() - _STARTED["t"], 1), "loadavg_start": _STARTED["load"],
            "loadavg_end": _loadavg()}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not LEDGER.rows:
        return
    terminalreporter.write_sep("=", "reliability: trials / survived / lost")
    terminalreporter.write_line(LEDGER.table())
    out = os.environ.get("RELIABILITY_JSON")
    if out:
        # "_run": the machine, commit and wall time; every other key is a row
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({**LEDGER.as_json(), "_run": _run_info()}, indent=1) + "\n")


@pytest.fixture(scope="session")
def photo_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A class-folder tree of 16 real-photo JPEGs (2 classes), never modified: copy it to change it."""
    from cachebuild.samples.imagenet_layout import write_imagenet

    info = write_imagenet(tmp_path_factory.mktemp("photos"), n_classes=2, train_per_class=8, val_per_class=1,
                          seed=7)
    return Path(info["train_dir"])
