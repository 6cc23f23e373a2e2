"""The HTML of the report: plain pages, inline CSS, no script. Every value from a cache (class names,
paths, failure reasons) is escaped."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["GENERATOR", "definition_list", "esc", "page", "table"]

GENERATOR = "cachebuild report"

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1400px; padding: 0 16px;
       color: #1a1a1a; background: #fafafa; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; }
h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 6px 0; } td, th { border: 1px solid #ddd; padding: 3px 8px;
       text-align: left; vertical-align: top; } th { background: #eee; }
code, pre { font: 13px ui-monospace, monospace; background: #eee; padding: 1px 4px; }
pre { padding: 8px; overflow-x: auto; }
img { display: block; max-width: none; image-rendering: pixelated; }
nav a { margin-right: 12px; } .muted { color: #666; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in row) + "</tr>\n" for row in rows)
    return f"<table><tr>{head}</tr>\n{body}</table>\n"


def definition_list(items: Mapping[str, Any]) -> str:
    return table(["field", "value"], items.items())


def page(title: str, body: str, nav: str = "") -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta name="generator" content="{GENERATOR}">\n<title>{esc(title)}</title>\n'
            f"<style>{_CSS}</style></head>\n<body>\n<nav>{nav}</nav>\n<h1>{esc(title)}</h1>\n{body}\n</body></html>\n")
