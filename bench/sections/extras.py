"""The harness's sections that are whole scripts of their own (``bench/scripts/``, each also run alone as
``python -m bench.scripts.X`` from the repository root, where the harness and its test servers import): remote
reads, compact caches, sharing, resize quality, planning shard sources.
Each runs in a child process on its own data (its script says how it is made) and its JSON lands in
``results.json`` under the section's name."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["EXTRA_SECTIONS", "run_extra"]

REPO = Path(__file__).resolve().parents[2]

# section -> (script, title, arguments per profile)
EXTRA_SECTIONS: dict[str, tuple[str, str, dict[str, list[str]]]] = {
    "remote": ("remote.py", "Caches at URLs: local path vs HTTP on 127.0.0.1 (DataLoader, 2 workers)", {
        "full": ["--n", "4000", "--rounds", "3"], "quick": ["--n", "1000", "--rounds", "1", "--batch", "64"],
        "tiny": ["--n", "64", "--size", "32", "--rounds", "1", "--batch", "16", "--epochs", "2"]}),
    "compact": ("compact.py", "Compact (JPEG) caches: size, quality, decode-on-read", {
        "full": ["--n", "2000", "--rounds", "3"], "quick": ["--n", "400", "--rounds", "1"],
        "tiny": ["--n", "40", "--size", "64", "--rounds", "1"]}),
    "share": ("share.py", "Sharing: pull from a loopback HTTP server, cold / resumed / rerun", {
        "full": ["--mb", "256"], "quick": ["--mb", "64"], "tiny": ["--mb", "4"]}),
    "quality": ("quality.py", "Resize quality: PSNR against torchvision's PIL Resize + CenterCrop", {
        "full": ["--n", "1000", "--sizes", "64,96,224"], "quick": ["--n", "300", "--sizes", "64,96,224"],
        "tiny": ["--n", "20", "--sizes", "32,64"]}),
    "plan": ("plan_sources.py", "Planning shard sources (WebDataset tars, Parquet files)", {
        "full": ["--shards", "100", "--per-shard", "1251", "--jobs", "2"],
        "quick": ["--shards", "20", "--per-shard", "500", "--jobs", "2"],
        "tiny": ["--shards", "4", "--per-shard", "20", "--jobs", "1", "--image-bytes", "2000", "--rounds", "1"]}),
}


def run_extra(section: str, cfg: dict[str, Any], work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Run one script section as a child process; returns its figures (or why it did not run)."""
    script, title, per_profile = EXTRA_SECTIONS[section]
    out = work / f"{section}.json"
    out.unlink(missing_ok=True)
    module = "bench.scripts." + Path(script).stem
    args = [sys.executable, "-m", module, *per_profile[cfg["profile"]], "--json", str(out)]
    if section == "compact":  # FFCV's JPEG Loader beside ours, when its venv is there and peers are wanted
        from bench.peers import peer_python

        ffcv, _ = peer_python("ffcv")
        args += ["--ffcv-python", ffcv] if cfg.get("peers", True) and ffcv is not None else ["--no-ffcv"]
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, timeout=cfg["child_timeout"],
                       cwd=REPO)
    seconds = round(time.perf_counter() - t0, 1)
    command = "python -m " + module + " " + " ".join(args[3:-2])
    if r.returncode != 0 or not out.is_file():
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        log(f"{section}: failed ({why})")
        return {"title": title, "command": command, "seconds": seconds, "failed": why}
    log(f"{section}: {seconds:.0f} s")
    return {"title": title, "command": command, "seconds": seconds, "figures": json.loads(out.read_text())}
