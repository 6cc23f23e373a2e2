"""Comparisons only from quiet runs (doctools/quiet.py, check_docs rule 6): a comparison quoted from a run at a
load average above 1.5 is refused, so is one from an older full run once a newer quiet one exists, and the
blocks that compare contenders resolve to the newest quiet full run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from doctools import blocks as gen
from doctools.check_docs import figure_problems
from doctools.quiet import QUIET_FULL, newest_quiet_full, run_problems
from tests.repo import REPO

RESULTS = REPO / "bench" / "results"
NOISY = RESULTS / "2026-12-02-vm-augment-peers"  # a full-profile run of two sections at load 4.42
OLDER_FULL = RESULTS / "2026-12-01-vm"  # a quiet full run (load 0.19), older than 2026-12-02-vm


def _doc(tmp_path: Path, run: Path, text: str) -> Path:
    doc = tmp_path / "page.md"
    doc.write_text(text.replace("RUN", os.path.relpath(run, tmp_path)), encoding="utf-8")
    return doc


def _aug(run: Path, key: str) -> float:
    res = json.loads((run / "results.json").read_text())
    return float(res["load"]["groups"]["augmented"][key]["img_s"]["median"])


def test_a_comparison_from_a_noisy_run_is_refused_and_a_plain_figure_is_not(tmp_path: Path) -> None:
    ours, ffcv = _aug(NOISY, "cachebuild_npy_crop_in_threads"), _aug(NOISY, "ffcv_raw")
    claim = _doc(tmp_path, NOISY, f"# A\n\nThreads {ours:,.0f} img/s against FFCV's {ffcv:,.0f} img/s "
                                  f"([run](RUN/README.md)).\n")
    problems = figure_problems(claim)
    assert len(problems) == 2 and all("comes from a noisy run" in p and "load average 4.42" in p for p in problems)
    ratio = _doc(tmp_path, NOISY, f"# A\n\nThreads {ours:,.0f} img/s, {ours / ffcv:.2f}x FFCV "
                                  f"([run](RUN/results.md)).\n")
    assert len([p for p in figure_problems(ratio) if "noisy run" in p]) == 2
    plain = _doc(tmp_path, NOISY, f"# A\n\nThreads read {ours:,.0f} img/s there ([run](RUN/results.md)).\n")
    assert figure_problems(plain) == []  # a figure, but no comparison


def test_a_table_whose_header_compares_is_a_comparison_in_every_row(tmp_path: Path) -> None:
    ours = _aug(NOISY, "cachebuild_npy_crop_in_threads")
    table = _doc(tmp_path, NOISY, f"# A\n\n[run](RUN/results.md)\n\n| row | img/s | x FFCV |\n|---|---:|---:|\n"
                                  f"| threads | {ours:,.0f} | - |\n")
    assert [p for p in figure_problems(table) if "noisy run" in p]


def test_an_older_full_run_is_refused_once_a_newer_quiet_one_exists(tmp_path: Path) -> None:
    newest = newest_quiet_full(REPO)
    res = json.loads((OLDER_FULL / "results.json").read_text())
    rate = res["load"]["groups"]["raw"]["cachebuild_npy_dataloader"]["img_s"]["median"]
    doc = _doc(tmp_path, OLDER_FULL, f"# A\n\nOurs {rate:,.0f} img/s, faster than before ([run](RUN/results.md)).\n")
    problems = figure_problems(doc)
    assert len(problems) == 1 and "older full run" in problems[0] and newest.name in problems[0]
    now = json.loads((newest / "results.json").read_text())["load"]["groups"]["raw"]
    fresh = now["cachebuild_npy_dataloader"]["img_s"]["median"]
    doc = _doc(tmp_path, newest, f"# A\n\nOurs {fresh:,.0f} img/s, faster than before ([run](RUN/results.md)).\n")
    assert figure_problems(doc) == []


def _run(repo: Path, name: str, started: str, load: float, src: dict) -> None:
    folder = repo / "bench" / "results" / name
    folder.mkdir(parents=True)
    res = {**src, "run": {**src["run"], "started": started},
           "machine": {**src["machine"], "load_average_at_start": [load, load, load]}}
    (folder / "results.json").write_text(json.dumps(res))


def test_comparing_blocks_come_from_the_newest_quiet_full_run(tmp_path: Path) -> None:
    src = json.loads((newest_quiet_full(REPO) / "results.json").read_text())
    repo = tmp_path / "repo"
    _run(repo, "2026-12-01-a", "2026-12-01T10:00:00+00:00", 0.4, src)
    _run(repo, "2026-12-03-b", "2026-12-03T10:00:00+00:00", 2.9, src)  # newer, noisy
    assert newest_quiet_full(repo).name == "2026-12-01-a"
    noisy = repo / "bench/results/2026-12-03-b"
    problems = run_problems("README.md:3", "performance", noisy, repo)
    assert len(problems) == 1 and "@quiet-full" in problems[0]
    assert run_problems("README.md:3", "reliability", noisy, repo) == []  # not a comparison of contenders
    _run(repo, "2026-12-04-c", "2026-12-04T10:00:00+00:00", 1.2, src)  # a newer quiet run: the one quoted now
    assert gen.resolve(QUIET_FULL, repo).name == "2026-12-04-c"
    older = run_problems("docs/performance.md:9", "peers", repo / "bench/results/2026-12-01-a", repo)
    assert len(older) == 1 and "older full run than bench/results/2026-12-04-c" in older[0]
    shutil.rmtree(repo / "bench/results/2026-12-04-c")
    assert gen.resolve(QUIET_FULL, repo).name == "2026-12-01-a"
