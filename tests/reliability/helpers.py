"""What the reliability tests share: running the CLI as a user would, and comparing caches byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachebuild.storage.cache import open_cache
from tests.repo import REPO

__all__ = ["FAULT_HOOKS", "REPO", "ReadTally", "bounded", "build_reference", "cli", "cli_env", "file_hashes",
           "one_line_error", "read_under_load", "run_bounded", "same_cache", "without_dac_override"]



FAULT_HOOKS = Path(__file__).resolve().parent / "fault_hooks"


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run: this checkout first on the path, one thread per library; with
    ``CB_FAULT=...`` the fault hooks too (tests/reliability/faults.py)."""
    hooks = [str(FAULT_HOOKS)] if extra.get("CB_FAULT") else []
    path = os.pathsep.join(p for p in (*hooks, str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def without_dac_override() -> list[str]:
    """A command prefix under which permission bits apply even to root (tests run as root here), or []
    when not root (they apply anyway)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("running as root without setpriv (util-linux): cannot make a file unreadable")
    return [setpriv, "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search", "--"]


def cli(*args: str, prefix: list[str] | None = None, timeout: float = 180, memory: int = 8 << 30,
        **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``python -m cachebuild ARGS`` in a fresh process, as a user runs it.

    In its own session (a fault that kills "the whole build" kills its process group, never the tests),
    with at most ``memory`` bytes of data per process (so a defect that reads without end fails the test,
    not the machine), and after ``timeout`` seconds its whole group is killed (workers stuck in a syscall
    included) and TimeoutExpired raised.
    """
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))

    with subprocess.Popen([*(prefix or []), sys.executable, "-m", "cachebuild", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=cli_env(**extra_env), start_new_session=True,
                          preexec_fn=limit) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def build_reference(*args: str) -> None:
    """A build whose process is not what the test is about (a reference to compare against, an older cache,
    the rerun after a kill): the same command, run in this process (a fresh interpreter spends seconds
    importing torch for the resize). It must succeed."""
    from click.testing import CliRunner

    from cachebuild.cli import main

    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` in a thread, bounded in time: a hang (a FIFO opened for reading waits for a writer forever) fails
    the trial instead of stopping the suite. Its exception, if any, is raised here."""
    import threading

    got: dict[str, Any] = {}

    def go() -> None:
        try:
            got["value"] = fn()
        except BaseException as e:  # handed to the caller
            got["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"{what} still runs after {timeout} s (a hang)")
    if "error" in got:
        raise got["error"]
    return got.get("value")


def run_bounded(*args: object, timeout: float = 60) -> tuple[int, str]:
    """``cachebuild ARGS`` in this process (click's CliRunner: stdout, stderr and log lines together), bounded in
    time; a traceback (any exception but SystemExit) fails. Returns (exit code, output)."""
    from click.testing import CliRunner

    from cachebuild.cli import main

    r = bounded(lambda: CliRunner().invoke(main, [str(a) for a in args]), timeout,
                f"cachebuild {' '.join(map(str, args))}")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"traceback: {type(r.exception).__name__}: {r.exception}\n{r.output}")
    return r.exit_code, r.output


def one_line_error(output: str) -> str:
    """The only line of ``output``, which must be an ``Error: ...`` line (no traceback, nothing else)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in output, output
    return lines[0]


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (symlinks as their target text), by relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def same_cache(a: Path, b: Path) -> list[str]:
    """Differences between two caches (empty: the same): every file byte-identical but the manifest,
    whose fields must be equal except the build time; and ``b`` must verify."""
    problems = []
    ha, hb = file_hashes(a), file_hashes(b)
    ha.pop("manifest.json", None)
    hb.pop("manifest.json", None)
    if ha.keys() != hb.keys():
        problems.append(f"files differ: only in {a.name}: {sorted(ha.keys() - hb.keys())[:5]}, "
                        f"only in {b.name}: {sorted(hb.keys() - ha.keys())[:5]}")
    problems += [f"{rel} differs" for rel in sorted(ha.keys() & hb.keys()) if ha[rel] != hb[rel]]
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    for m in (ma, mb):
        m.pop("created", None)
        m.pop("checksum", None)  # the manifest's own sha256 covers its build time too
        m.get("source", {}).get("inputs", {}).pop("listed_ns", None)  # when the source was listed: a time too
    if ma != mb:
        problems.append(f"manifests differ in {sorted(k for k in ma.keys() | mb.keys() if ma.get(k) != mb.get(k))}")
    problems += [f"verify: {p}" for p in open_cache(b).verify()]
    return problems


@dataclass
class ReadTally:
    """What a reader under load saw: whole batches; named errors (an honest answer); and mixed ones, other
    pixels than expected or an error that names nothing, which are never acceptable."""

    whole: int = 0
    mixed: int = 0
    named: int = 0
    first_mixed: str = ""
    first_named: str = ""

    @property
    def reads(self) -> int:
        return self.whole + self.mixed + self.named

    def batch(self, got: Any, expected: Any, why: str = "wrong pixels") -> None:
        import numpy as np

        if np.array_equal(got, expected):
            self.whole += 1
        else:
            self.mixed += 1
            self.first_mixed = self.first_mixed or why

    def error(self, e: BaseException) -> bool:
        """Count an exception; True when it is a named one (a cachebuild error)."""
        from cachebuild.errors import CacheBuildError

        if isinstance(e, CacheBuildError):
            self.named += 1
            self.first_named = self.first_named or str(e)
            return True
        self.mixed += 1
        self.first_mixed = self.first_mixed or f"{type(e).__name__}: {e}"
        return False

    def result(self) -> tuple[int, int, int, str]:
        return self.whole, self.mixed, self.named, self.first_mixed or self.first_named


def read_under_load(ds: Any, expected: Any, seconds: float, ready: Any, go: Any, *,
                    reopen: Callable[[], tuple[Any, Any]] | None = None, pause: float = 0.0,
                    why: Callable[[Any, Any], str] = lambda _got, _expected: "wrong pixels"
                    ) -> tuple[int, int, int, str]:
    """A reader process's loop: check the first batch (put on ``ready``), wait for ``go``, then gather random
    batches of 16 for ``seconds``, every 20th from a fresh copy of the dataset (what a DataLoader worker of
    the next epoch holds). After a named error, ``reopen`` (if given) opens again as a restarted job would;
    ``pause`` sleeps now and then (a long step). Returns (whole, mixed, named, first message)."""
    import numpy as np

    from cachebuild.errors import CacheBuildError

    ready.put(bool(np.array_equal(ds.gather(np.arange(4)), expected[:4])))
    go.wait(120)
    rng = np.random.default_rng(os.getpid())
    tally = ReadTally()
    deadline = time.time() + seconds
    while time.time() < deadline:
        if tally.reads % 20 == 0:
            ds = pickle.loads(pickle.dumps(ds))
        idx = np.sort(rng.choice(len(expected), 16, replace=False))
        try:
            batch = ds.gather(idx)
        except Exception as e:  # a named error is an honest answer; anything else (a broadcast error...) is not
            if tally.error(e) and reopen is not None:
                while time.time() < deadline:
                    try:
                        ds, expected = reopen()
                        break
                    except CacheBuildError:  # nothing to open right now (a replacement under way)
                        time.sleep(0.05)
            continue
        tally.batch(batch, expected[idx], why(batch, expected))
        if pause and rng.random() < 0.15:
            time.sleep(pause)
    return tally.result()
