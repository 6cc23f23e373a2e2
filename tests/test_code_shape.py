"""The code's shape, held by test (issue 23): short functions, modules of a readable size, and the import
layers of ``[tool.importlinter]`` (also run by ``make lint``) with no cycle at any depth."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.repo import REPO

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 420  # "about 400": the CIFAR pickle reader and writer are one concept each


def _modules() -> list[Path]:
    return sorted([*(REPO / "cachebuild").rglob("*.py"), *(REPO / "loaders").rglob("*.py")])


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_no_module_is_longer_than_about_400_lines():
    big = [f"{p.relative_to(REPO)} ({n} lines)" for p in _modules()
           if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_MODULE_LINES]
    assert big == []


def test_the_import_layers_hold_and_nothing_imports_in_a_cycle():
    exe = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe), "--no-cache"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
