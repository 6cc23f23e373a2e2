"""``parity``'s outputs: the JSON of every figure, and an HTML page in the report's style (its CSS and
helpers, ``cachebuild.inspect.page``) with the worst pixels beside their references and the loss curves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.inspect import compose_sheet
from cachebuild.inspect import page as P
from loaders.parity.checks import Check, PixelResult

__all__ = ["LEDGER", "OUT_FILES", "prepare_out", "write_html", "write_json"]

SHEET, CURVES, INDEX = "worst-pixels.png", "training-loss.png", "index.html"
OUT_FILES = (INDEX, SHEET, CURVES)  # the only names parity writes into --out
LEDGER = ".cachebuild-parity"  # in --out: says the folder is parity's page, so a later parity may replace it


def prepare_out(out: Path) -> None:
    """Make ``out`` parity's page folder: a new or empty folder, or one that a previous parity wrote (its
    :data:`LEDGER`, a regular file, is there), whose :data:`OUT_FILES` are removed (links not followed), and
    nothing else; any other folder is refused, as ``cachebuild report`` refuses one."""
    from loaders.parity.recipe import ParityInputError

    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ParityInputError(f"--out {out} is not a folder: pass a new or empty folder, or one parity wrote")
    if out.is_dir() and any(out.iterdir()):
        ledger = out / LEDGER
        if ledger.is_symlink() or not ledger.is_file():
            raise ParityInputError(f"--out {out} is not empty and holds no parity page: choose a new or empty "
                                   f"folder (parity never replaces files it did not write)")
        for name in OUT_FILES:
            (out / name).unlink(missing_ok=True)  # a link planted under one of these names goes, not its target
    out.mkdir(parents=True, exist_ok=True)
    (out / LEDGER).write_text("".join(f"{n}\n" for n in (LEDGER, *OUT_FILES)), encoding="utf-8")


def document(head: dict[str, Any], checks: list[Check]) -> dict[str, Any]:
    return {**head, "passed": all(c.passed for c in checks),
            "failed": [c.name for c in checks if not c.passed],
            "checks": [{"name": c.name, "passed": c.passed, "verdict": c.verdict, "figures": c.figures}
                       for c in checks]}


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n", encoding="utf-8")


def worst_sheet(res: PixelResult, classes: list[str], labels: np.ndarray, paths: list[str], png: Path) -> bool:
    """The worst samples (left) beside torchvision's reference (right), captioned with their PSNR."""
    if not res.worst:
        return False
    ours = np.stack([w[2] for w in res.worst])
    refs = np.stack([w[3] for w in res.worst])
    idx = [w[1] for w in res.worst]
    names = [f"{classes[labels[i]] if 0 <= labels[i] < len(classes) else labels[i]}  {w[0]:.1f} dB"
             for i, w in zip(idx, res.worst, strict=True)]
    sheet = compose_sheet(ours, idx, [int(labels[i]) for i in idx], names, [paths[i] for i in idx],
                          augmented=refs, columns=4)
    sheet.save(png)
    return True


def write_html(out: Path, doc: dict[str, Any], sheet: bool, curves: bool) -> Path:
    rows = [(c["name"], "pass" if c["passed"] else "FAIL", c["verdict"]) for c in doc["checks"]]
    head = {k: v for k, v in doc.items() if k in ("cache", "source", "recipe", "reference", "seconds")}
    verdict = "Every check passed." if doc["passed"] else "Failed: " + P.esc(", ".join(doc["failed"]))
    body = [f"<h2>Verdict</h2>\n<p>{verdict}</p>\n" + P.table(["check", "result", "what was compared"], rows),
            "<h2>Inputs</h2>\n" + P.definition_list(head)]
    if sheet:
        body.append("<h2>Worst pixels</h2>\n<p>Each sample as the cache serves it (left) beside torchvision's "
                    "reference for the cache's recipe (right), worst PSNR first.</p>\n"
                    f'<img src="{SHEET}" alt="worst samples beside their references">')
    if curves:
        body.append(f'<h2>Training A/B</h2>\n<img src="{CURVES}" alt="training loss of both pipelines">')
    body.append("<h2>Figures</h2>\n<pre>" + P.esc(json.dumps(
        [{"name": c["name"], **{k: v for k, v in c["figures"].items() if not k.startswith("loss_")}}
         for c in doc["checks"]], indent=1, default=float)) + "</pre>")
    title = f"parity of {doc['cache']}: {'pass' if doc['passed'] else 'FAIL'}"
    (out / INDEX).write_text(P.page(title, "\n".join(body)), encoding="utf-8")
    return out / INDEX
