"""Pushes run as real ``cachebuild`` processes against moto on 127.0.0.1, started at one instant or killed part
way: shared by tests/test_share_concurrent.py and the reliability rows."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cachebuild.errors import RemoteError
from cachebuild.storage.cache import open_cache
from cachebuild.storage.locations.url import FsspecLocation
from tests.loaders_fixtures import make_cache
from tests.repo import REPO


def two_caches(tmp_path: Path) -> dict[str, tuple[Path, np.ndarray]]:
    """Caches "a" and "b" under ``tmp_path``: different pixels and counts, so a mix of the two is seen."""
    out = {}
    for name, n, w in (("a", 70, 12), ("b", 54, 10)):
        root, images, _ = make_cache(tmp_path / name, n=n, shard_size=8, h=16, w=w)
        out[name] = (root, images)
    return out


@contextlib.contextmanager
def upload_fails_on(file_name: str) -> Iterator[None]:
    """Uploads of ``file_name`` fail as a reset connection does (every other file uploads as usual). Not the
    fixture's monkeypatch: undoing that would drop the s3 fixture's AWS environment."""
    real = FsspecLocation.put_file

    def dies_on_one(self: FsspecLocation, name: str, local: Path) -> None:
        if name == file_name:
            raise RemoteError(f"{self.describe(name)}: cannot upload it: connection reset")
        real(self, name, local)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FsspecLocation, "put_file", dies_on_one)
        yield

# Everything a push imports is imported first; then the process says it is ready and waits for a line (or the
# end) of its standard input, the go: pushes released together start within a millisecond of each other, as
# soon as the slowest has imported (no fixed head start to guess on a loaded machine). Each says when it
# started and ended pushing: whether two runs overlapped is then known, not assumed.
_READY = "race-ready"
_AT = f"""
import atexit, sys, time
import s3fs, aiobotocore.session
import cachebuild.share.push, cachebuild.share.claim
from cachebuild.cli import main
print("{_READY}", flush=True)
sys.stdin.readline()
print(f"race-start {{time.time():.6f}}", flush=True)
atexit.register(lambda: print(f"race-end {{time.time():.6f}}", flush=True))
main(sys.argv[1:], prog_name="cachebuild")
"""


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def start_push(src: Path, url: str, *flags: str, **extra: str) -> subprocess.Popen[str]:
    """A push in its own process, held after its imports until :func:`go` (or ``communicate()``, which closes
    its standard input) lets it start."""
    return subprocess.Popen([sys.executable, "-c", _AT, "push", str(src), url, "--no-progress", *flags],
                            env=env(**extra), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def go(procs: list[subprocess.Popen[str]]) -> None:
    """Wait until every push of ``procs`` has imported, then let them all start at once."""
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()  # its imports print nothing before this line; "" if it died
        if line.strip() != _READY:
            raise AssertionError(f"a push did not get ready (rc {p.wait()}): {line}{p.stdout.read()}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()


@dataclass(frozen=True)
class Run:
    rc: int
    output: str
    pid: int
    start: float  # when it began pushing (inf: never got there)
    end: float


def race(sources: list[Path], url: str, *flags: str) -> list[Run]:
    """Push each of ``sources`` to ``url`` from its own process, all released at one instant."""
    procs = [start_push(s, url, *flags) for s in sources]
    go(procs)
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=120)
        stamps = dict(line.split() for line in text.splitlines() if line.startswith("race-"))
        out.append(Run(p.returncode, text, p.pid, float(stamps.get("race-start", "inf")),
                       float(stamps.get("race-end", "inf"))))
    return out


def overlapped(runs: list[Run]) -> bool:
    return max(r.start for r in runs) < min(r.end for r in runs)


def kill_during(src: Path, url: str, after_s: float, *flags: str) -> int:
    """A push SIGKILLed ``after_s`` after it starts pushing (all imports done); its exit code (-9: killed
    while it ran, 0: it had finished)."""
    p = start_push(src, url, *flags)
    go([p])
    try:
        p.communicate(timeout=after_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)
    return p.returncode


def served(url: str, n: int) -> np.ndarray:
    return open_cache(url).gather(np.arange(n))
