"""The docs' checker: the committed docs pass it, and each kind of problem it exists for is caught."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from doctools import blocks as gen
from doctools.check_docs import (
    SETTINGS_DOC,
    check_all,
    figure_problems,
    flag_problems,
    link_problems,
    settings_problems,
    signature_problems,
)
from tests.repo import REPO

RUN = REPO / "bench" / "results" / "2026-12-01-vm-evening"


def test_the_committed_docs_pass() -> None:
    assert check_all() == []


def _doc(tmp_path: Path, text: str) -> Path:
    doc = tmp_path / "page.md"
    doc.write_text(text.replace("RUN", os.path.relpath(RUN, tmp_path)), encoding="utf-8")
    return doc


def test_a_figure_must_be_in_the_file_its_section_cites(tmp_path: Path) -> None:
    npy = json.loads((RUN / "results.json").read_text())["build"]["contenders"]["cachebuild_npy"]["img_s"]["median"]
    ok = _doc(tmp_path, f"# A\n\nBuilt at {npy:,.0f} img/s, {npy / 1e3:.1f}k no unit ([run](RUN/results.md)).\n")
    assert figure_problems(ok) == []
    wrong = _doc(tmp_path, f"# A\n\nBuilt at {npy + 7:,.0f} img/s ([run](RUN/results.md)).\n")
    assert [p for p in figure_problems(wrong) if "is not in" in p and f"{npy + 7:,.0f}" in p]
    uncited = _doc(tmp_path, "# A\n\n[run](RUN/results.md)\n\n## B\n\nIt takes 3.7 s and 12% less.\n")
    assert len([p for p in figure_problems(uncited) if "cites no results file" in p]) == 2  # per section
    table = _doc(tmp_path, f"# A\n\n[run](RUN/results.md)\n\n| what | img/s |\n|---|---:|\n| ours, batch 256 | "
                           f"{npy:,.0f} |\n| made up | 999,999 |\n")
    problems = figure_problems(table)  # the cell of the run's figure passes; the made-up one does not
    assert len(problems) == 1 and "figure 999,999 ('999,999') is not in " in problems[0]
    assert f"bench/results/{RUN.name}/results.json" in problems[0]  # a link to results.md cites the whole run
    code = _doc(tmp_path, "# A\n\nBlocks of `64 MB`, and\n\n```\ncachebuild x  # 9.9 s\n```\n")
    assert figure_problems(code) == []  # settings in code, and code blocks, are no figures


def test_a_generated_block_must_equal_what_its_folder_writes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("2026-12-01-vm-reliability", "2026-12-02-x-reliability"):
        shutil.copytree(REPO / "bench/results/2026-12-01-vm-reliability", repo / "bench/results" / name)
    newest = repo / "bench/results/2026-12-02-x-reliability/table.json"
    rows = json.loads(newest.read_text())
    first = next(iter(rows))
    rows[first]["trials"] += 1
    newest.write_text(json.dumps({"rows": rows, "machine": {"cpu": "Test CPU", "cpu_flags": ["avx2"]},
                                  "commit": "0123456789abcdef"}))
    (repo / "docs").mkdir()
    readme = repo / "README.md"
    readme.write_text("x\n<!-- bench:reliability:begin bench/results/*-reliability* -->\nOLD\n"
                      "<!-- bench:reliability:end -->\n")
    problems = gen.check(repo)
    assert len(problems) == 1 and "reliability block differs" in problems[0]
    readme.write_text(gen.regenerate(readme, repo))
    assert gen.check(repo) == []
    text = readme.read_text()
    assert "2026-12-02-x-reliability/table.json" in text  # the newest folder by name
    assert "Test CPU (AVX2)" in text and "`0123456789`" in text and "OLD" not in text


def test_links_flags_targets_and_keywords(tmp_path: Path) -> None:
    doc = _doc(tmp_path, "# A\n\n[x](missing.md) [y](RUN/results.md) [z](#a) [w](#nope)\n\n"
                         "```\ncachebuild imagenet SRC --size 96 --no-such-flag\ncachebuild nope\nmake demo\n"
                         "make no-target\n```\n\nUse `--also-missing` or `--jobs`.\n\n"
                         "```python\nfrom loaders import CachedImageDataset, DatasetOptions\n\n"
                         "CachedImageDataset('c', DatasetOptions(ring_slots=2, no_such_kw=1))\n```\n")
    links = link_problems(doc)
    assert len(links) == 2 and any("missing.md" in p for p in links) and any("#nope" in p for p in links)
    flags = flag_problems(doc)
    assert any("imagenet --no-such-flag" in p for p in flags) and any("cachebuild nope" in p for p in flags)
    assert any("`--also-missing`" in p for p in flags) and not any("--jobs" in p or "--size" in p for p in flags)
    assert any("make no-target" in p for p in flags) and not any("make demo" in p for p in flags)
    sig = signature_problems(doc)
    assert len(sig) == 1 and "no_such_kw" in sig[0]


@pytest.mark.parametrize("bad", ["```python\nx = f(\n```\n"])
def test_a_python_block_that_does_not_parse_is_named(tmp_path: Path, bad: str) -> None:
    assert "does not parse" in signature_problems(_doc(tmp_path, bad))[0]


def test_the_settings_table_is_held_to_the_settings_object(tmp_path: Path) -> None:
    """docs/settings.md lists every CACHEBUILD_* knob of cachebuild.settings with its default: a knob left out,
    one the code lacks, a default that differs and a page naming an unknown variable are each found."""
    from cachebuild.settings import KNOBS

    text = SETTINGS_DOC.read_text(encoding="utf-8")
    assert settings_problems() == [] and all(f"| `{k.env}` | `{k.default}` |" in text for k in KNOBS)
    table = tmp_path / "settings.md"
    table.write_text("\n".join(line for line in text.splitlines() if "`CACHEBUILD_HEDGE_AFTER`" not in line))
    assert settings_problems(table) == [f"{table}: CACHEBUILD_HEDGE_AFTER is not in the table (cachebuild/settings.py "
                                        "declares it, default '0.05')"]
    table.write_text(text.replace("| `CACHEBUILD_RETRIES` | `10` |", "| `CACHEBUILD_RETRIES` | `5` |")
                     + "| `CACHEBUILD_TURBO` | `1` | Goes faster. |\n")
    problems = settings_problems(table)
    assert len(problems) == 2, problems
    assert "CACHEBUILD_RETRIES: the table says default `5`, the code '10'" in problems[0]
    assert "CACHEBUILD_TURBO is no setting of cachebuild" in problems[1]
    page = tmp_path / "page.md"
    page.write_text("Set `CACHEBUILD_RETRIES=3` or `CACHEBUILD_RETRYS=3`.\n")
    assert settings_problems(docs=[page]) == [f"{page}: CACHEBUILD_RETRYS is no setting of cachebuild"]
