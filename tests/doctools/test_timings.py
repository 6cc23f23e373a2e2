"""doctools.timings reads make demo's commands from the Makefile itself, and the README's block says what is
not measured yet."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from doctools.summary import commands_section
from doctools.timings import demo_commands
from tests.repo import REPO


def test_the_demo_commands_come_from_the_makefile(tmp_path: Path) -> None:
    cmds = demo_commands(REPO / "Makefile", tmp_path / "demo-out")
    assert [c[:4] for c in cmds] == [[sys.executable, "-m", "cachebuild", k] for k in ("sample", "imagenet", "info",
                                                                                      "train")]
    build = cmds[1]
    assert build[build.index("--size") + 1] == "96" and str(tmp_path / "demo-out" / "cache") in build
    assert not any("#" in w or "$(" in w for c in cmds for w in c)  # comments and make variables gone
    bad = tmp_path / "Makefile"
    bad.write_text("demo: x\n\trm -rf /tmp/nothing\n")
    with pytest.raises(SystemExit, match="not a cachebuild command"):
        demo_commands(bad, tmp_path)


def test_the_commands_block_names_what_is_not_measured() -> None:
    machine = {"cpu": "CPU X", "cpu_flags": ["avx2"], "cores_usable": 2, "ram_gb": 8, "gpu": None, "python": "3.11",
               "versions": {"torch": "2.x"}, "git": {"commit": "abcdef0123456789", "dirty": False},
               "load_average_at_start": [0.5, 0.4, 0.3]}
    demo = {"command": "make demo", "runs_s": [42.0], "median_s": 42.0, "date": "2026-12-02T00:00:00+00:00",
            "machine": machine, "output_tail": ["a", "b", "accuracy    val top-1 98.0%"],
            "steps": [{"command": "cachebuild sample demo-out/photos", "wall_s": 1.0}]}
    text = commands_section({"entries": {"make-demo": demo}}, "run")
    assert "CPU X (AVX2)" in text and "`abcdef0123`" in text and "took 42.0 s (sample 1.0 s)" in text
    assert "accuracy    val top-1 98.0%" in text and "Not measured in this folder yet: `make test`" in text
    done = commands_section({"entries": {"make-demo": demo, "make-test": {**demo, "median_s": 400.0,
                                                                          "runs_s": [400.0]}}}, "run")
    assert "Not measured" not in done and "6.7 min" in done
