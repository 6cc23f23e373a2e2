"""The code's shape, held by test: short functions in the packages and in the harness beside them (bench/,
support/, doctools/), the import layers of ``[tool.importlinter]`` (also run by ``make lint``) with no cycle at
any depth, and every test file collected. A module is one concept whatever its length: no size cap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo import COLLECTED_MODULES, REPO

MAX_FUNCTION_LINES = 80
PACKAGES = ("cachebuild", "loaders", "bench", "support", "doctools")
# Not code of ours: bench's recorded outputs, its working files, and the peers' venvs (bench/.venvs)
OUTSIDE = {"results", "work"}


def _modules() -> list[Path]:
    return sorted(p for name in PACKAGES for p in (REPO / name).rglob("*.py")
                  if not any(part in OUTSIDE or part.startswith(".") for part in p.relative_to(REPO).parts))


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_import_layers_hold_and_nothing_imports_in_a_cycle():
    exe = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe), "--no-cache"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def _collected_by_a_plain_run(config: pytest.Config) -> set[Path]:
    """The test modules a plain ``pytest --collect-only -m ""`` from the root collects: this session's own
    collection when it is such a run (no paths given: ``testpaths``), else that command in a child."""
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and COLLECTED_MODULES in config.stash:
        return config.stash[COLLECTED_MODULES]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return {(REPO / line.split("::", 1)[0]).resolve() for line in r.stdout.splitlines() if "::" in line}


def test_every_test_file_is_collected_by_a_plain_run(request: pytest.FixtureRequest):
    """A folder pytest does not recurse into (its default ``norecursedirs`` holds ``build``, ``dist``, ``*.egg``,
    dotted names...) or a file outside ``testpaths`` would silently never run: 84 tests once did."""
    on_disk = {p.resolve() for p in (REPO / "tests").rglob("test_*.py")}
    collected = {p.resolve() for p in _collected_by_a_plain_run(request.config)}
    assert sorted(str(p.relative_to(REPO)) for p in on_disk - collected) == []
