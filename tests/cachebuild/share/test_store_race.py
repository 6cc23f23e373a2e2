"""Real ``cachebuild`` processes asking a store for one recipe: two at the same moment (each with its own
``--out``) make exactly one build, both end with byte-identical caches, and the second costs a pull once the
first has published; a builder killed part way is taken over by the one waiting, whose result equals an
uninterrupted build. A shared folder and moto's S3 on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cachebuild.share import store_build
from cachebuild.share.pull import pull
from cachebuild.share.store import plan_wanted
from tests.cachebuild.share.test_store import RECIPE, same_cache
from tests.repo import REPO
from tests.trees import tree_bytes

FLAGS = ["--split", "train", "--size", "32", "--shard-size", "8", "-j", "1", "--no-progress", "-v"]

# A build command in its own process, its blocks slowed (SLOW_BLOCK_S each) so that it can be raced or killed part
# way; it says it is ready once imported, starts on a line of its standard input, and says when it started and
# ended.
_RUN = """
import atexit, os, sys, time
import cachebuild.builder.pipeline as pipeline
import cachebuild.share.store_build, cachebuild.share.push, cachebuild.share.pull
from cachebuild.cli import main
slow = float(os.environ.get("SLOW_BLOCK_S", "0"))
if slow:
    real = pipeline.run_block
    def run_block(task):
        time.sleep(slow)
        return real(task)
    pipeline.run_block = run_block
print("race-ready", flush=True)
sys.stdin.readline()
print(f"race-start {time.time():.6f}", flush=True)
atexit.register(lambda: print(f"race-end {time.time():.6f}", flush=True))
main(sys.argv[1:], prog_name="cachebuild")
"""


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_process_left() -> Any:
    """Every process a test started is gone when it ends, whatever it asserted."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)


class Run:
    def __init__(self, proc: subprocess.Popen[str], summary: Path) -> None:
        self.proc, self.summary = proc, summary
        self.output = ""
        _STARTED.append(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self, timeout: float = 120) -> Run:
        self.output, _ = self.proc.communicate(timeout=timeout)
        return self

    def stamp(self, what: str) -> float:
        return float(next(line.split()[1] for line in self.output.splitlines() if line.startswith(f"race-{what}")))

    def decoded(self) -> int:
        return int(json.loads(self.summary.read_text())["splits"][0]["decoded"])


def _start(src: Path, store: str, out: Path, env: dict[str, str], slow: float = 0.0) -> Run:
    summary = out.parent / f"{out.name}.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN, "imagenet", str(src), "--store", store, "--out", str(out), "--json",
         str(summary), *FLAGS],
        env={**os.environ, **env, "PYTHONPATH": str(REPO), "SLOW_BLOCK_S": str(slow)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "race-ready", line + proc.stdout.read()
    return Run(proc, summary)


def _go(*runs: Run) -> None:
    for r in runs:
        assert r.proc.stdin is not None
        r.proc.stdin.write("\n")
        r.proc.stdin.flush()


def _race(src: Path, store: str, tmp: Path, env: dict[str, str]) -> tuple[Run, Run]:
    """Two requests released at one instant; (the one that built, the one that waited)."""
    a, b = _start(src, store, tmp / "a", env, slow=0.3), _start(src, store, tmp / "b", env, slow=0.3)
    _go(a, b)
    a.finish(), b.finish()
    for r in (a, b):
        assert r.proc.returncode == 0 and "Traceback" not in r.output, r.output
    built = [r for r in (a, b) if "imagenet/train: built (" in r.output]
    found = [r for r in (a, b) if "imagenet/train: in the store (" in r.output]
    assert len(built) == 1 and len(found) == 1, (a.output, b.output)  # exactly one build
    builder, waiter = built[0], found[0]
    assert builder.decoded() == 50 and waiter.decoded() == 0
    assert f"being built by pid {builder.pid}" in waiter.output, waiter.output  # whose build, and how far
    assert "blocks built" in waiter.output or "publishing" in waiter.output, waiter.output
    assert tree_bytes(tmp / "a" / "train") == tree_bytes(tmp / "b" / "train")  # byte-identical, manifest too
    return builder, waiter


def _pull_seconds(url: str, tmp: Path) -> float:
    t0 = time.perf_counter()
    pull(url, tmp / "timed-pull", progress=False)
    return time.perf_counter() - t0


def _check_second_costs_a_pull(builder: Run, waiter: Run, url: str, tmp: Path) -> None:
    """Once the builder has published (its process ends right after), the waiter needs about a pull: its next look
    (every POLL_S), the pull, its exit."""
    pulled = _pull_seconds(url, tmp)
    after = waiter.stamp("end") - builder.stamp("end")
    print(f"builder {builder.stamp('end') - builder.stamp('start'):.2f} s; waiter ended {after:.2f} s after it; "
          f"a pull alone {pulled:.3f} s")
    assert after < store_build.POLL_S + 5 * pulled + 1.5, (after, pulled)


def test_two_requests_at_one_moment_make_one_build_in_a_shared_folder(imagenet_clean, tmp_path):
    store = tmp_path / "store"
    builder, waiter = _race(Path(imagenet_clean["root"]), str(store), tmp_path, {})
    (w,) = plan_wanted("imagenet", imagenet_clean["root"], **RECIPE)
    assert tree_bytes(tmp_path / "a" / "train") == tree_bytes(store / w.name)
    _check_second_costs_a_pull(builder, waiter, str(store / w.name), tmp_path)


def test_two_requests_at_one_moment_make_one_build_in_an_object_store(imagenet_clean, tmp_path, s3):
    store = s3.url("store")
    builder, waiter = _race(Path(imagenet_clean["root"]), store, tmp_path, s3.env)
    (w,) = plan_wanted("imagenet", imagenet_clean["root"], **RECIPE)
    _check_second_costs_a_pull(builder, waiter, f"{store}/{w.name}", tmp_path)


def _ref(info: dict[str, Any], tmp: Path) -> Path:
    """The same recipe built without interruption, in this process."""
    from cachebuild.builder.pipeline import build

    (w,) = plan_wanted("imagenet", info["root"], **RECIPE)
    return build(w.plan, tmp / "ref", w.opts).path


def _kill_when(run: Run, ready: Any, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not ready():
        time.sleep(0.02)
    got_there = ready()
    os.killpg(run.pid, signal.SIGKILL)
    run.finish()
    assert got_there, f"the builder did not get far enough: {run.output}"
    assert run.proc.returncode == -signal.SIGKILL


def test_a_builder_killed_part_way_is_taken_over_in_a_shared_folder(imagenet_clean, tmp_path):
    src, store = Path(imagenet_clean["root"]), tmp_path / "store"
    (w,) = plan_wanted("imagenet", src, **RECIPE)
    blocks = store / f"{w.name}.partial" / "blocks"
    builder = _start(src, str(store), tmp_path / "a", {}, slow=0.5)
    waiter = _start(src, str(store), tmp_path / "b", {})
    _go(builder)
    deadline = time.time() + 60
    while time.time() < deadline and len(list(blocks.glob("*.json"))) < 2:
        time.sleep(0.02)
    _go(waiter)
    assert waiter.proc.stdout is not None
    _kill_when(builder, lambda: len(list(blocks.glob("*.json"))) >= 3)
    waiter.finish()
    assert waiter.proc.returncode == 0, waiter.output
    assert f"being built by pid {builder.pid}" in waiter.output and "imagenet/train: built (" in waiter.output
    assert "blocks already built" in waiter.output, waiter.output  # it resumed from the dead builder's blocks
    assert same_cache(_ref(imagenet_clean, tmp_path), store / w.name)
    assert tree_bytes(store / w.name) == tree_bytes(tmp_path / "b" / "train")


def test_a_builder_killed_part_way_is_taken_over_in_an_object_store(imagenet_clean, tmp_path, s3):
    src, store = Path(imagenet_clean["root"]), s3.url("store")
    (w,) = plan_wanted("imagenet", src, **RECIPE)
    marker = s3.url(f"store/{w.name}/push-in-progress.json")
    builder = _start(src, store, tmp_path / "a", s3.env, slow=0.5)
    waiter = _start(src, store, tmp_path / "b", s3.env)
    _go(builder)
    deadline = time.time() + 60
    while time.time() < deadline and not s3.fs.exists(marker):
        time.sleep(0.05)
    _go(waiter)
    _kill_when(builder, lambda: len(list((tmp_path / "a" / "train.partial" / "blocks").glob("*.json"))) >= 3)
    waiter.finish()
    assert waiter.proc.returncode == 0, waiter.output
    assert f"being built by pid {builder.pid}" in waiter.output and "imagenet/train: built (" in waiter.output
    assert same_cache(_ref(imagenet_clean, tmp_path), tmp_path / "b" / "train")
    pull(f"{store}/{w.name}", tmp_path / "pulled", progress=False)
    assert tree_bytes(tmp_path / "pulled") == tree_bytes(tmp_path / "b" / "train")
    assert not s3.fs.exists(marker)


@pytest.mark.parametrize("where", ["folder", pytest.param("s3", marks=pytest.mark.slow)])
def test_the_waiter_says_whose_build_and_how_far(where, imagenet_clean, tmp_path, request):
    """A waiter's lines: the holder, and the blocks done so far, growing (in an object store's claim at each
    heartbeat: every tenth of CACHEBUILD_PUSH_STALE_S, 1 s here)."""
    src = Path(imagenet_clean["root"])
    env: dict[str, str] = {}
    if where == "s3":
        s3 = request.getfixturevalue("s3")
        store, env = s3.url("store"), {**s3.env, "CACHEBUILD_PUSH_STALE_S": "10"}
    else:
        store = str(tmp_path / "store")
    builder = _start(src, store, tmp_path / "a", env, slow=0.8)
    waiter = _start(src, store, tmp_path / "b", env)
    _go(builder)
    time.sleep(1.0)
    _go(waiter)
    builder.finish(), waiter.finish()
    lines = [line for line in waiter.output.splitlines() if line.startswith("waiting for")]
    assert lines and all(f"pid {builder.pid}" in line for line in lines), waiter.output
    done = [int(line.split(" of 7 blocks")[0].rsplit(" ", 1)[1]) for line in lines if " of 7 blocks" in line]
    assert done and done == sorted(done) and len(set(done)) >= 2, lines
