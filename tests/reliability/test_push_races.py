"""Pushes to one S3 prefix that race or die (moto's S3 on 127.0.0.1, real ``cachebuild`` processes).

- two pushes of different caches started at the same instant: exactly one exits 0; the other exits 1 naming
  it (or, started late on a loaded machine, meets its finished cache); the prefix then holds one complete
  cache that verifies and reads back as that push's pixels.
- a push SIGKILLed at a random moment, then rerun: the rerun completes and the prefix verifies.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.storage.cache import current_host
from tests import share_races

RACE_ROW = "two pushes of different caches to one S3 prefix at once"
KILL_ROW = "a push SIGKILLed at a random moment, then rerun"



def _holds(url: str, s3, prefix: str, caches: dict[str, tuple[Path, np.ndarray]]) -> str:
    """Which cache the prefix holds, after checking it is complete, verifies and reads back right."""
    doc = json.loads(s3.fs.cat(s3.url(f"{prefix}/manifest.json")))
    name = next(k for k, (root, _) in caches.items() if json.loads((root / "manifest.json").read_bytes()) == doc)
    root, images = caches[name]
    listed = sorted(p.split(f"/{prefix}/", 1)[1] for p in s3.fs.find(s3.url(prefix)))
    assert listed == sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()), listed
    r = CliRunner().invoke(main, ["verify", url])
    assert r.exit_code == 0, r.output
    assert np.array_equal(share_races.served(url, len(images)), images)
    return name


@pytest.mark.slow  # ~60 s: `make reliability`
def test_pushes_started_together(tmp_path: Path, s3, ledger) -> None:
    caches = share_races.two_caches(tmp_path)
    overlapped = named = 0
    for trial in range(8):
        with ledger.trial(RACE_ROW, f"trial {trial}"):
            prefix = f"race/{trial}"
            url = s3.url(prefix)
            order = [caches["a"][0], caches["b"][0]][:: 1 if trial % 2 else -1]
            runs = share_races.race(order, url, *(["--force"] if trial % 4 == 3 else []))
            won = [r for r in runs if r.rc == 0]
            lost = [r for r in runs if r.rc != 0]
            assert all("Traceback" not in r.output for r in runs), runs
            if share_races.overlapped(runs):
                overlapped += 1
                assert len(won) == 1 and [r.rc for r in lost] == [1], runs
                named += f"pid {won[0].pid} on {current_host()}" in lost[0].output
            _holds(url, s3, prefix, caches)
    ledger.note(RACE_ROW, f"{overlapped} of 8 trials ran both pushes at the same time; in {named} the loser "
                          f"named the winner's pid (else it met the finished cache or its manifest)")
    assert overlapped >= 4


@pytest.mark.slow  # ~60 s: `make reliability`
def test_pushes_killed_at_random_then_rerun(tmp_path: Path, s3, ledger) -> None:
    caches = share_races.two_caches(tmp_path)
    rng = random.Random(27)
    killed = 0
    for trial in range(6):
        with ledger.trial(KILL_ROW, f"trial {trial}"):
            prefix = f"kill/{trial}"
            url = s3.url(prefix)
            name = "ab"[trial % 2]
            if trial >= 3:  # a --force replacement killed part way, of the other cache
                assert CliRunner().invoke(main, ["push", str(caches["ab"[1 - trial % 2]][0]), url,
                                                 "--no-progress"]).exit_code == 0
            flags = ["--jobs", "1", *(["--force"] if trial >= 3 else [])]
            rc = share_races.kill_during(caches[name][0], url, rng.uniform(0.0, 0.8), *flags)
            killed += rc == -9
            r = CliRunner().invoke(main, ["push", str(caches[name][0]), url, "--no-progress", *flags])
            assert r.exit_code == 0, r.output
            assert _holds(url, s3, prefix, caches) == name
    ledger.note(KILL_ROW, f"{killed} of 6 pushes were killed while they ran (the rest had finished)")
