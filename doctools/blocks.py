"""Regenerate, or check, every generated block of README.md and docs/*.md from the results folder it names:

    python -m doctools.blocks          # rewrite every block from its folder
    python -m doctools.blocks --check  # exit 1 naming each block that differs from what its folder generates

A generated block is

    <!-- bench:KIND:begin SOURCE -->
    ...written by this module, never by hand...
    <!-- bench:KIND:end -->

SOURCE is a results folder relative to the repository root (``bench/results/RUN``), or a glob of folders
(``bench/results/*-reliability*``): the newest match, by name (results folders begin with their date), so
a new run committed under a matching name is picked up by the next ``python -m doctools.blocks``; or
``bench/results/@quiet-full``: the newest full run whose load average at the start was <= 1.5
(``doctools.quiet``), the one source of every block that compares contenders.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from doctools.performance import imagenet_section, peers_section, performance_section
from doctools.quiet import QUIET_FULL, newest_quiet_full
from doctools.run_figures import augment_section, compact_section
from doctools.scale import scale_section
from doctools.summary import commands_section, headline_section, reliability_section

__all__ = ["KINDS", "REPO", "check", "doc_files", "find_blocks", "regenerate", "resolve"]

REPO = Path(__file__).resolve().parents[1]
Section = Callable[[dict[str, Any], str], str]
# kind -> (the file of the folder it reads, the function that writes the block)
KINDS: dict[str, tuple[str, Section]] = {
    "performance": ("results.json", performance_section),
    "imagenet": ("results.json", imagenet_section),
    "peers": ("results.json", peers_section),
    "headline": ("results.json", headline_section),
    "compact": ("results.json", compact_section),
    "augment": ("results.json", augment_section),
    "commands": ("commands.json", commands_section),
    "reliability": ("table.json", reliability_section),
    "scale": ("scale.json", scale_section),
}
BLOCK = re.compile(r"<!-- bench:(?P<kind>[a-z]+):begin (?P<source>\S+) -->\n(?P<body>.*?)<!-- bench:(?P=kind):end -->",
                   re.S)


def doc_files(repo: Path = REPO) -> list[Path]:
    """The user docs: README.md and docs/*.md (CHANGELOG.md is history, not checked)."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def find_blocks(text: str) -> Iterator[re.Match[str]]:
    return BLOCK.finditer(text)


def resolve(source: str, repo: Path = REPO) -> Path:
    """The folder a block's SOURCE names: itself, the newest (last by name) folder matching a glob, or for
    ``bench/results/@quiet-full`` the newest full run whose load average at the start was <= 1.5."""
    if source == QUIET_FULL:
        return newest_quiet_full(repo)
    if any(c in source for c in "*?["):
        found = sorted(p for p in repo.glob(source) if p.is_dir())
        if not found:
            raise SystemExit(f"no results folder matches {source}")
        return found[-1]
    folder = repo / source
    if not folder.is_dir():
        raise SystemExit(f"no results folder {source}")
    return folder


def _link(folder: Path, doc: Path) -> str:
    return os.path.relpath(folder, doc.parent)


def render(kind: str, folder: Path, doc: Path) -> str:
    if kind not in KINDS:
        raise SystemExit(f"{doc}: unknown generated block kind {kind!r} (one of {', '.join(KINDS)})")
    name, section = KINDS[kind]
    data = json.loads((folder / name).read_text(encoding="utf-8"))
    return section(data, _link(folder, doc)) + "\n"


def regenerate(doc: Path, repo: Path = REPO) -> str:
    """``doc``'s text with every generated block written again from its folder."""
    def block(m: re.Match[str]) -> str:
        kind, source = m.group("kind"), m.group("source")
        body = render(kind, resolve(source, repo), doc)
        return f"<!-- bench:{kind}:begin {source} -->\n{body}<!-- bench:{kind}:end -->"

    return BLOCK.sub(block, doc.read_text(encoding="utf-8"))


def check(repo: Path = REPO) -> list[str]:
    """One line per generated block that differs from what its folder generates now."""
    problems = []
    for doc in doc_files(repo):
        text = doc.read_text(encoding="utf-8")
        for m in find_blocks(text):
            want = render(m.group("kind"), resolve(m.group("source"), repo), doc)
            if m.group("body") != want:
                line = text[: m.start()].count("\n") + 1
                problems.append(f"{doc.relative_to(repo)}:{line}: the {m.group('kind')} block differs from what "
                                f"{m.group('source')} generates: run `python -m doctools.blocks`")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m doctools.blocks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    a = ap.parse_args(argv)
    if a.check:
        problems = check()
        print("\n".join(problems) or "every generated block is up to date")
        return 1 if problems else 0
    for doc in doc_files():
        new = regenerate(doc)
        if new != doc.read_text(encoding="utf-8"):
            doc.write_text(new, encoding="utf-8")
            print(f"rewrote {doc.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
