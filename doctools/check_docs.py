"""The docs' checker (``make lint``, and ``tests/doctools/test_check_docs.py`` in ``make test``):

    python -m doctools.check_docs      # one line per problem; exit 1 if any

Over README.md and docs/*.md (CHANGELOG.md is history and is not checked):

1. **Generated blocks** (``<!-- bench:KIND:begin SOURCE -->``) equal what their results folder generates
   (``doctools/blocks.py``; ``python -m doctools.blocks`` rewrites them).
2. **Every figure traceable.** A figure is a number with a unit of measure (img/s, MB/s, s, ms, min, %,
   dB, kB/MB/GB/KiB/MiB/GiB, a ratio such as ``1.49x``) in prose or a table, outside code, or a table cell
   holding only numbers (its unit in the column's header). Outside generated blocks, each must be found,
   allowing rounding and a unit's scale (s/ms, bytes/MB, a share/%), in a results folder (its .json and
   .md files) that its section (heading to next heading) cites: a link to that folder or a file in it
   under ``bench/results/``, or a comment ``<!-- figures: bench/results/RUN -->`` (repository-relative).
   Settings and constants (defaults, limits, sizes a user types) are written as code (``64 MB``), which is
   not a figure.
3. **Links resolve**: relative links to files and folders, and ``#anchors`` to headings of the page linked.
4. **Commands exist as documented**: every ``cachebuild CMD --flag`` in code names a command and its flag
   (the commands' own click definitions, ``--help``'s source), every ``--flag`` in the text is an option of
   some command, every ``make TARGET`` is a Makefile target, and every keyword argument a ``python`` code
   block passes to a function of ``loaders`` or ``cachebuild`` is a parameter of it.
5. **Settings as declared**: the table of ``CACHEBUILD_*`` variables in ``docs/settings.md`` lists every knob
   of ``cachebuild/settings.py`` with its default, and nothing else; no page names a variable that is not one.
6. **Comparisons only from quiet runs** (``doctools/quiet.py``): a figure on a line that compares (a ratio
   such as ``1.45x``, or faster/slower/ahead/behind/against/than near it) must be found in a cited file
   measured at a load average at the start <= 1.5, and, when from a full run, in the newest such full run;
   generated blocks that compare contenders come from that run (SOURCE ``bench/results/@quiet-full``).
"""

from __future__ import annotations

import ast
import bisect
import importlib
import inspect
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from doctools.blocks import BLOCK, REPO, check, doc_files, find_blocks, resolve
from doctools.quiet import figure_run_problem, is_comparison, is_comparison_header, run_problems

__all__ = ["block_run_problems", "check_all", "figure_problems", "flag_problems", "link_problems", "main",
           "settings_problems", "signature_problems"]

UNIT = (r"img/s|samples/s|[kMG]i?B/s|core-hours|dB|%|x(?![a-zA-Z0-9])|ms\b|s\b|min\b|minutes\b|seconds\b|"
        r"hours\b|[kKMGT]i?B\b")
NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# A figure, or a run of them sharing one unit: "3.7 s", "3-20%", "44.2 / 48.2 / 41.8 dB", "0.80x and 0.65x"
FIGURE = re.compile(rf"(?<![\w.\-/#])(?P<run>(?:{NUM})(?:\s?(?:-|to|/|and|,)\s?(?:{NUM}))*)\s?(?P<unit>{UNIT})")
TIMED = ("img/s", "samples/s", "core-hours", "%", "x", "ms", "s", "min", "minutes", "seconds", "hours")
TIMED_PREFIXES = tuple(f"{p}B/s" for p in ("k", "M", "G", "ki", "Mi", "Gi", "Ki"))
SCALES = (1, 100, 0.01, 1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9, 2**-10, 2**-20, 2**-30, 2**10, 2**20, 60, 1 / 60, 1 / 3600)
CITE = re.compile(r"(?:\]\(|<!-- figures: )(?P<path>[^)\s]*bench/results/[^)\s#]+)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _name(doc: Path) -> str:
    try:
        return str(doc.resolve().relative_to(REPO))
    except ValueError:
        return str(doc)


def _strip_generated(text: str) -> str:
    return BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _sections(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each section (a heading to the next heading), code blocks and generated
    blocks blanked out (line numbers kept)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), _strip_generated(text))
    start, buf = 1, list[str]()  # a section's first line number and its lines
    for i, raw in enumerate(text.split("\n"), 1):
        if raw.startswith("#") and buf:
            yield start, "\n".join(buf)
            start, buf = i, []
        buf.append(raw)
    yield start, "\n".join(buf)


def _numbers(path: Path) -> list[float]:
    """Every number in a results file (JSON values, and numbers written in strings or text)."""
    out: list[float] = []
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        def walk(v: object) -> None:
            if isinstance(v, bool):
                return
            if isinstance(v, (int, float)):
                out.append(float(v))
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, list):
                for x in v:
                    walk(x)
            elif isinstance(v, str):
                out.extend(float(n.replace(",", "")) for n in re.findall(NUM, v))
        walk(json.loads(text))
    else:
        out.extend(float(n.replace(",", "")) for n in re.findall(NUM, text))
    return out


def _cited(para: str, doc: Path) -> list[Path]:
    found = []
    for m in CITE.finditer(para):
        raw = m.group("path")
        base = REPO if m.group(0).startswith("<!--") else doc.parent
        p = (base / raw).resolve()
        run = p if p.is_dir() else p.parent  # a file of a run cites the run: results.md's tables, results.json
        if p.exists() and run.is_dir():
            found += sorted(q for q in run.iterdir() if q.suffix in (".json", ".md") and q.is_file())
    return sorted(set(found))


NUMERIC_CELL = re.compile(r"^[\d.,\s/()\-x%~]*\d[\d.,\s/()\-x%~]*$")


def _numeric_cells(line: str) -> list[str]:
    """A table row's cells that hold only numbers (a column's unit is in its header): each is a figure."""
    if not line.lstrip().startswith("|") or set(line.replace("|", "").strip()) <= set("-: "):
        return []
    return [c for c in line.strip().strip("|").split("|") if NUMERIC_CELL.match(c.strip())]


def _values(run: str) -> list[str]:
    """The numbers of a run of figures; "1,820" is one number, "12, 18" two (a list is written with spaces)."""
    return re.findall(NUM, re.sub(r",(?=\s)", " ", run))


def _found(value: str, pool: list[list[float]]) -> bool:
    f = float(value.replace(",", ""))
    decimals = len(value.split(".", 1)[1]) if "." in value else 0
    tol = 0.5 * 10**-decimals + 1e-9
    for scaled in pool:
        i = bisect.bisect_left(scaled, f - tol)
        if i < len(scaled) and scaled[i] <= f + tol:
            return True
    return False


def figure_problems(doc: Path) -> list[str]:
    problems: list[str] = []
    pools: dict[Path, list[list[float]]] = {}
    for start, section in _sections(doc.read_text(encoding="utf-8")):
        cited = _cited(section, doc)
        for p in cited:
            if p not in pools:
                nums = sorted(set(_numbers(p)))
                pools[p] = [sorted(n * s for n in nums) for s in SCALES]
        header = ""  # the header row of the table a line is in: a table of ratios compares in every row
        for offset, para in enumerate(section.split("\n")):
            prose = CODE.sub(" ", COMMENT.sub(" ", LINK.sub("]", para)))
            header = (header or prose) if prose.lstrip().startswith("|") else ""
            timed = [(m.group(0), v) for m in FIGURE.finditer(prose) if m.group("unit") in TIMED or
                     m.group("unit").startswith(TIMED_PREFIXES) for v in _values(m.group("run"))]
            figures = [(m.group(0), v) for m in FIGURE.finditer(prose) for v in _values(m.group("run"))]
            cells = [(cell.strip(), v) for cell in _numeric_cells(prose) for v in re.findall(NUM, cell)]
            figures += cells
            if not figures:
                continue
            where = f"{_name(doc)}:{start + offset}"
            # load changes timings, not sizes or PSNR: a comparison's timed figures (and a table's bare cells)
            comparison = set(timed + cells) if is_comparison(prose) or is_comparison_header(header) else set()
            for text, value in figures:
                holders = [p for p in cited if _found(value, pools[p])]
                if not cited:
                    problems.append(f"{where}: figure {value} ({text!r}) cites no results file (link one under "
                                    "bench/results/ in its section, or write a setting as `code`)")
                elif not holders:
                    names = ", ".join(_name(p) for p in cited)
                    problems.append(f"{where}: figure {value} ({text!r}) is not in {names}")
                elif (text, value) in comparison and (bad := figure_run_problem(where, value, text, holders, REPO)):
                    problems.append(bad)
    return problems


def block_run_problems(doc: Path) -> list[str]:
    """Generated blocks that compare contenders come from the newest quiet full run (doctools.quiet)."""
    text = doc.read_text(encoding="utf-8")
    out = []
    for m in find_blocks(text):
        where = f"{_name(doc)}:{text[: m.start()].count(chr(10)) + 1}"
        out += run_problems(where, m.group("kind"), resolve(m.group("source")), REPO)
    return out


def _anchors(md: Path) -> set[str]:
    out = set()
    for h in re.findall(r"^#+ (.+)$", FENCE.sub("", md.read_text(encoding="utf-8")), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", "")).replace(" ", "-")
        out.add(slug)
    return out


def link_problems(doc: Path) -> list[str]:
    problems = []
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    for m in LINK.finditer(CODE.sub("", text)):
        target = m.group("target")
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            problems.append(f"{_name(doc)}: link to {target} : no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            problems.append(f"{_name(doc)}: link to {target} : no heading #{anchor} there")
    return problems


def _commands() -> dict[str, set[str]]:
    """Every ``cachebuild`` command and its option names, from the click definitions themselves."""
    import click

    from cachebuild.cli import main

    ctx = click.Context(main)
    out = {}
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        if name == "train" and (cmd is None or not cmd.params):  # not installed as an entry point here
            from loaders.train.cli import train as cmd
        # a group (`cachebuild columns add|ls|rm`): the options of its subcommands, under the group's name
        subs = list(cmd.commands.values()) if isinstance(cmd, click.Group) else []
        params = [p for c in ([cmd] if cmd else []) + subs for p in c.params]
        out[name] = {o for p in params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    return out


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(encoding="utf-8"), flags=re.M))


def flag_problems(doc: Path, commands: dict[str, set[str]] | None = None) -> list[str]:
    commands = commands or _commands()
    every = set().union(*commands.values())
    text = doc.read_text(encoding="utf-8")
    code = "\n".join([*re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M),
                      *(c.strip("`") for c in CODE.findall(FENCE.sub("", text)))]).replace("\\\n", " ")
    problems = []
    for m in re.finditer(r"(?:^|[\s;(|&])cachebuild ([a-z][\w-]*)([^\n;|&#]*)", code, flags=re.M):
        name, rest = m.group(1), m.group(2)
        if name not in commands:
            if name not in ("sample",) and not name.startswith("-"):
                problems.append(f"{_name(doc)}: `cachebuild {name}`: no such command")
            continue
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
            if flag not in commands[name]:
                problems.append(f"{_name(doc)}: `cachebuild {name} {flag}`: no such option")
    prose = FENCE.sub("", _strip_generated(text))
    for flag in set(re.findall(r"`(--[a-z][\w-]*)", prose)):
        if flag not in every:
            problems.append(f"{_name(doc)}: `{flag}` is no option of any cachebuild command")
    targets = _make_targets()
    for target in set(re.findall(r"\bmake ([a-z][\w-]*)", code)):
        if target not in targets:
            problems.append(f"{_name(doc)}: `make {target}`: no such Makefile target")
    return problems


def _imported(tree: ast.AST) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("loaders", "cachebuild"):
            try:
                mod = importlib.import_module(node.module)
            except ImportError:  # a module of an extra that is not installed here (lightning): not checked
                continue
            for a in node.names:
                obj = getattr(mod, a.name, None)
                out[a.asname or a.name] = obj if obj is not None else importlib.import_module(f"{node.module}.{a.name}")
    return out


def signature_problems(doc: Path) -> list[str]:
    problems = []
    for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(encoding="utf-8"), flags=re.S | re.M):
        try:
            tree = ast.parse(block)
        except SyntaxError as e:
            problems.append(f"{_name(doc)}: a python block does not parse ({e.msg}, its line {e.lineno})")
            continue
        names = _imported(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.keywords):
                continue
            f = node.func
            obj = (names.get(f.id) if isinstance(f, ast.Name) else
                   getattr(names.get(f.value.id), f.attr, None)
                   if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in names
                   else None)
            if obj is None or not callable(obj):
                continue
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                if kw.arg and kw.arg not in params:
                    problems.append(f"{_name(doc)}: {ast.unparse(f)}(... {kw.arg}=...): no such parameter")
    return problems


SETTINGS_DOC = REPO / "docs" / "settings.md"
KNOB_ROW = re.compile(r"^\|\s*`(?P<env>CACHEBUILD_\w+)`\s*\|\s*`(?P<default>[^`]*)`\s*\|", re.M)


def settings_problems(table: Path = SETTINGS_DOC, docs: Iterable[Path] = ()) -> list[str]:
    """The table of ``CACHEBUILD_*`` variables in ``table`` (rows ``| `NAME` | `DEFAULT` | meaning |``) against
    ``cachebuild.settings.KNOBS``: every knob listed once, none the code lacks, the same defaults; and no page
    of ``docs`` naming a variable that is not a knob."""
    from cachebuild.settings import KNOBS

    knobs = {k.env: k for k in KNOBS}
    where = _name(table)
    rows = [(m.group("env"), m.group("default")) for m in KNOB_ROW.finditer(table.read_text(encoding="utf-8"))]
    listed = [env for env, _ in rows]
    problems = [f"{where}: {env} is not in the table (cachebuild/settings.py declares it, default "
                f"{knobs[env].default!r})" for env in knobs if env not in listed]
    problems += [f"{where}: {env} is listed more than once" for env in sorted(set(listed)) if listed.count(env) > 1]
    for env, default in rows:
        if env not in knobs:
            problems.append(f"{where}: {env} is no setting of cachebuild (cachebuild/settings.py)")
        elif default != knobs[env].default:
            problems.append(f"{where}: {env}: the table says default `{default}`, the code {knobs[env].default!r}")
    for doc in docs:
        named = set(re.findall(r"CACHEBUILD_[A-Z][A-Z0-9_]*[A-Z0-9]", doc.read_text(encoding="utf-8")))
        problems += [f"{_name(doc)}: {env} is no setting of cachebuild" for env in sorted(named - set(knobs))]
    return problems


def check_all(docs: Iterable[Path] | None = None) -> list[str]:
    docs = list(docs or doc_files())
    commands = _commands()
    problems = list(check())
    for doc in docs:
        problems += figure_problems(doc) + block_run_problems(doc) + link_problems(doc)
        problems += flag_problems(doc, commands) + signature_problems(doc)
    return problems + settings_problems(docs=docs)


def main() -> int:
    problems = check_all()
    print("\n".join(problems) or f"docs: {len(doc_files())} pages, every figure traced, every link and flag found")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
