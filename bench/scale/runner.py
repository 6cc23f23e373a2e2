"""The steps of one N, each in its own child process (``bench.scale.steps``), watched by
``bench.children.run_child``: time, the process's own peak RSS and its tree's peak RSS and PSS."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.children import ChildError, run_child

__all__ = ["Runner", "cache_checksums"]

ROOT = Path(__file__).resolve().parents[2]


def cache_checksums(cache: Path) -> list[str]:
    """Every checksum a cache's manifest records for its pixels and side arrays, in order."""
    m = json.loads((cache / "manifest.json").read_text())
    key = "digest" if m.get("format_version", 0) >= 4 else "sha256"  # cachebuild.format.manifest.entry_key
    return [s[key] for s in m["shards"]] + [a[key] for _, a in sorted(m.get("arrays", {}).items())]


class Runner:
    """Runs steps for one harness run: ``size``, ``jobs`` and where caches go (``work/caches``)."""

    def __init__(self, work: Path, size: int, jobs: int, timeout: float, log: Any = print,
                 shard_size: int | None = None) -> None:
        self.work, self.size, self.jobs, self.timeout, self.log = work, size, jobs, timeout, log
        self.shard_size = shard_size
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def step(self, name: str, *args: str, expect_exit: int | None = 0) -> dict[str, Any]:
        """One step in a child: its answer plus ``wall`` (the whole process), ``tree_rss_peak``,
        ``tree_pss_peak``; ``error`` instead when it failed."""
        t0 = time.perf_counter()
        try:
            answer, peak = run_child([sys.executable, "-m", "bench.scale.steps", *args], timeout=self.timeout,
                                     env=self.env, cwd=str(ROOT))
        except ChildError as e:
            self.log(f"    {name}: FAILED\n{e}")
            return {"error": str(e)[-3000:]}
        answer.update(wall=time.perf_counter() - t0, tree_rss_peak=peak["rss"], tree_pss_peak=peak["pss"],
                      load=os.getloadavg()[0])  # the box is shared: the 1-minute load beside every figure
        if expect_exit is not None and answer.get("exit_code", 0) != expect_exit:
            answer["error"] = f"exit code {answer['exit_code']}, expected {expect_exit}: {answer.get('output', '')}"
        self.log(f"    {name:<18} {answer.get('seconds', 0):9.2f} s  parent {answer['rss_self_peak'] / 2**20:7.0f} MB"
                 f"  tree PSS {peak['pss'] / 2**20:7.0f} MB" + ("  ERROR" if "error" in answer else ""))
        return answer

    def build_args(self, src: Path, out: Path, split: str = "train", *extra: str) -> list[str]:
        args = ["cli", "imagenet", str(src), "--split", split, "--size", str(self.size), "--out", str(out),
                "--jobs", str(self.jobs), "--no-progress", *extra]
        return args + (["--shard-size", str(self.shard_size)] if self.shard_size else [])

    def touched_status(self, src: Path, cache: Path, k: int = 10) -> dict[str, Any]:
        """``status`` after ``k`` files spread over the tree were rewritten (a byte appended: a new mtime alone
        would be found unchanged by its bytes' digest); their bytes and times are put back after (the subsets
        share the full tree's files by hard link)."""
        classes = sorted(os.listdir(src / "train"))
        picked = []
        for c in classes[:: max(1, len(classes) // k)][:k]:
            picked.append(src / "train" / c / sorted(os.listdir(src / "train" / c))[0])
        saved = [(p, os.stat(p), p.read_bytes()) for p in picked]
        try:
            for p, _, data in saved:
                p.write_bytes(data + b"\0")
            r = self.step("status_touched", "cli", "status", str(cache), "--json", expect_exit=1)
        finally:
            _put_back(saved)
        status = _json_in(r.get("output", ""))
        r["modified"] = status.get("modified")
        if "error" not in r and status.get("modified") != k:
            r["error"] = f"status found {status.get('modified')} modified files, {k} were touched"
        return r

    def update_touched(self, src: Path, out: Path, build_seconds: float, k: int = 10) -> dict[str, Any]:
        """``--update`` of the cache in ``out`` after ``k`` files spread over the tree were rewritten (then put
        back: the cache is updated once more to match), against the full build's ``build_seconds``."""
        classes = sorted(os.listdir(src / "train"))
        picked = [src / "train" / c / sorted(os.listdir(src / "train" / c))[0]
                  for c in classes[:: max(1, len(classes) // k)][:k]]
        saved = [(p, os.stat(p), p.read_bytes()) for p in picked]
        summary = self.work / "update.json"
        try:
            for p, _, data in saved:
                p.write_bytes(data + b"\0")  # another size: decoded again (a new mtime alone: digested, reused)
            r = self.step("update_touched", *self.build_args(src, out, "train", "--update", "-q", "--json",
                                                              str(summary)))
        finally:
            _put_back(saved)
        if "error" in r:
            return r
        doc = json.loads(summary.read_text())
        r.update(touched=k, decoded=doc["decoded"], reused=doc["reused"], build_seconds=build_seconds,
                 ratio=r["seconds"] / build_seconds, per_reused_ms=1e3 * doc["seconds"] / max(1, doc["reused"]))
        if doc["decoded"] != k:
            r["error"] = f"the update decoded {doc['decoded']} files, {k} were touched"
        self.step("update_back", *self.build_args(src, out, "train", "--update", "-q"))
        return r

    def pull(self, out: Path, dest: Path) -> dict[str, Any]:
        """``pull`` of ``out/train`` from the loopback HTTP range server (support/http_server.py) into ``dest``."""
        sys.path.insert(0, str(ROOT))
        from support.http_server import HttpServer
        from support.loopback import EventLoopThread

        loop = EventLoopThread()
        server = HttpServer(out)
        loop.run(server.start())
        shutil.rmtree(dest, ignore_errors=True)
        try:
            r = self.step("pull", "cli", "pull", server.url_for("train"), str(dest), "--jobs", "8",
                          "--no-progress", "-q")
        finally:
            loop.run(server.stop())
            loop.close()
        if "error" not in r:
            nbytes = sum(f.stat().st_size for f in dest.iterdir())
            r.update(bytes=nbytes, mb_per_s=nbytes / 1e6 / r["seconds"])
            if cache_checksums(dest) != cache_checksums(out / "train"):
                r["error"] = "the pulled cache's checksums differ from the served one's"
        shutil.rmtree(dest, ignore_errors=True)
        return r


def _put_back(saved: list[tuple[Path, os.stat_result, bytes]]) -> None:
    """The files' bytes and times as they were."""
    for p, st, data in saved:
        p.write_bytes(data)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def _json_in(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except ValueError:
        return {}
