"""Time the commands the README states durations for, and record them with the machine and the commit:

    python -m doctools.timings --out bench/results/<run> make-demo demo-build     # in a checkout with .venv
    python -m doctools.timings --out bench/results/<run> make-test                # `make test` as it runs
    python -m doctools.timings --out bench/results/<run> --tree /tmp/old --label before demo-build

Each named command becomes one entry of ``<run>/commands.json`` (added to what the file holds, so one
folder can gather runs made at different times; each entry carries its own machine, commit and load).
The README's "Two commands" block is generated from that file (``python -m doctools.blocks``).

- ``make-demo``: ``make demo`` in a fresh output folder when the tree's ``.venv`` is installed (so nothing
  is installed while the clock runs); otherwise the ``demo`` target's commands, read from the Makefile,
  run with this Python (``python -m cachebuild`` for ``$(BIN)/cachebuild``), each timed. Keeps what the
  demo printed last.
- ``demo-build``: its build line alone (``cachebuild imagenet PHOTOS --size 96 ...``), ``--repeat`` times.
- ``make-test``, ``make-reliability``, ``make-bench-quick``: ``make TARGET`` in the tree, as a user runs it
  (the venv must exist: run ``make install`` first, so the install is not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.machine import git_commit, machine_info

__all__ = ["COMMANDS", "demo_commands", "main", "record"]

REPO = Path(__file__).resolve().parents[1]
MAKE_TARGETS = {"make-test": "test", "make-reliability": "reliability", "make-bench-quick": "bench-quick"}
COMMANDS = ("make-demo", "demo-build", *MAKE_TARGETS)
TAIL_LINES = 12


def demo_commands(makefile: Path, demo: Path, python: str = sys.executable) -> list[list[str]]:
    """The ``demo`` target's recipe lines as argument lists: ``$(BIN)/cachebuild`` -> ``python -m cachebuild``,
    ``$(DEMO)`` -> ``demo``; comments dropped, continuation lines joined."""
    text = makefile.read_text(encoding="utf-8").replace("\\\n", " ")
    recipe = re.search(r"^demo:.*?\n((?:\t.*\n)+)", text, flags=re.M)
    if recipe is None:
        raise SystemExit(f"{makefile} has no demo target")
    out = []
    for line in recipe.group(1).splitlines():
        line = line.strip().split("  #", 1)[0].replace("$(DEMO)", str(demo))
        words = shlex.split(line)
        if words and words[0] == "$(BIN)/cachebuild":
            out.append([python, "-m", "cachebuild", *words[1:]])
        elif words:
            raise SystemExit(f"{makefile}: demo step {line!r} is not a cachebuild command; teach doctools.timings it")
    return out


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} exited {p.returncode}:\n{p.stdout[-4000:]}")
    return wall, p.stdout


def _tail(text: str, n: int = TAIL_LINES) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip() and "\r" not in line]
    return lines[-n:]


def _demo(tree: Path, env: dict[str, str], work: Path) -> dict[str, Any]:
    """``make demo`` itself when the tree's venv is installed (its install step then does nothing), with its
    output folder in ``work``; else its commands one by one with this Python, each timed."""
    if (tree / ".venv" / ".installed-stamp").exists():
        wall, text = _run(["make", "demo", f"DEMO={work / 'demo-out'}"], tree, env)
        prefix = str(work) + "/"
        return {"command": "make demo (venv installed)", "runs_s": [round(wall, 2)], "steps": [],
                "output_tail": [line.replace(prefix, "") for line in _tail(text)]}
    steps: list[dict[str, Any]] = []
    outputs: list[str] = []
    for cmd in demo_commands(tree / "Makefile", work / "demo-out"):
        wall, text = _run(cmd, tree, env)
        steps.append({"command": shlex.join(["cachebuild", *cmd[3:]]).replace(str(work) + "/", ""),
                      "wall_s": round(wall, 2)})
        outputs.append(text)
    prefix = str(work) + "/"  # the temporary folder: shown as make demo shows its own, demo-out/...
    return {"command": "make demo: its commands, venv installed", "runs_s": [round(sum(s["wall_s"] for s in steps), 2)],
            "steps": steps,
            "output_tail": [line.replace(prefix, "") for line in _tail(outputs[-1])],
            "build_output": [line.replace(prefix, "") for line in _tail(outputs[1], 6)]}


def _demo_build(tree: Path, env: dict[str, str], work: Path, repeat: int) -> dict[str, Any]:
    photos, cache = work / "photos", work / "cache"
    _run([sys.executable, "-m", "cachebuild", "sample", str(photos)], tree, env)
    cmd = [sys.executable, "-m", "cachebuild", "imagenet", str(photos), "--size", "96", "--out", str(cache),
           "--force"]
    runs, text = [], ""
    for _ in range(repeat):
        wall, text = _run(cmd, tree, env)
        runs.append(round(wall, 2))
    return {"command": "cachebuild imagenet PHOTOS --size 96 --out CACHE --force", "runs_s": runs,
            "output_tail": _tail(text, 6)}


def _make(tree: Path, env: dict[str, str], target: str) -> dict[str, Any]:
    wall, text = _run(["make", target], tree, env)
    return {"command": f"make {target}", "runs_s": [round(wall, 1)], "output_tail": _tail(text)}


def record(name: str, tree: Path, repeat: int = 3) -> dict[str, Any]:
    """Run one named command in ``tree`` and return its entry (machine, commit, load before and after)."""
    path = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    load = [round(x, 2) for x in os.getloadavg()]
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="cb-timings-") as tmp:
        if name == "make-demo":
            entry = _demo(tree, env, Path(tmp))
        elif name == "demo-build":
            entry = _demo_build(tree, env, Path(tmp), repeat)
        else:
            entry = _make(tree, env, MAKE_TARGETS[name])
    entry["median_s"] = round(statistics.median(entry["runs_s"]), 2)
    machine["git"] = git_commit(tree)
    machine["load_average_at_start"] = load
    return {**entry, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m doctools.timings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commands", nargs="+", choices=COMMANDS)
    ap.add_argument("--out", type=Path, required=True, help="results folder; commands.json there is added to")
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout to run (default: this one)")
    ap.add_argument("--label", default="", help="suffix of the entry names, e.g. 'before' -> demo-build@before")
    ap.add_argument("--repeat", type=int, default=3, help="runs of demo-build (default 3)")
    a = ap.parse_args(argv)
    path = a.out / "commands.json"
    data: dict[str, Any] = (json.loads(path.read_text()) if path.exists()
                            else {"format": "cachebuild-timings", "entries": {}})
    # Written once, after the last command (or its failure): `make test` checks the README's generated block
    # against this file, so an entry added while later commands still run would fail that very check.
    try:
        for name in a.commands:
            key = f"{name}@{a.label}" if a.label else name
            data["entries"][key] = record(name, a.tree.resolve(), a.repeat)
            print(f"{key}: {data['entries'][key]['median_s']} s (runs {data['entries'][key]['runs_s']})", flush=True)
    finally:
        a.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
