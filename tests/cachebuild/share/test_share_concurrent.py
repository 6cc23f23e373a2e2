"""Two pushes to one S3 prefix at the same time: exactly one wins, the other stops naming it before it has
written anything, and the prefix holds one complete cache that verifies. A push killed at any point and rerun
completes. Real processes against moto's S3 server on 127.0.0.1 (its conditional writes: ``If-None-Match``,
``If-Match``)."""

from __future__ import annotations

import datetime
import importlib
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cachebuild.cli import main
from cachebuild.storage.cache import current_host
from tests import share_races
from tests.loaders_fixtures import make_cache, make_images
from tests.share_races import upload_fails_on

MARKER = "push-in-progress.json"
push_module = importlib.import_module("cachebuild.share.push")  # the package exports push(), the function


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])



def _check_one_cache(url: str, caches: dict[str, tuple[Path, np.ndarray]], s3, prefix: str) -> str:
    """The name of the cache at ``url``, after checking it is whole, verifies and has no file of the other."""
    doc = json.loads(s3.fs.cat(s3.url(f"{prefix}/manifest.json")))
    name = next(k for k, (root, _) in caches.items() if json.loads((root / "manifest.json").read_bytes()) == doc)
    root, images = caches[name]
    listed = sorted(p.split(f"/{prefix}/", 1)[1] for p in s3.fs.find(s3.url(prefix)))
    assert listed == sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    r = _cli("verify", url)
    assert r.exit_code == 0, r.output
    assert np.array_equal(share_races.served(url, len(images)), images)
    return name


def _check_race(runs: list[share_races.Run], url: str, forced: bool) -> None:
    """Overlapping pushes: one wins, the other names it. Pushes that did not overlap (a loaded machine started
    one late): the second meets the first's finished cache, refused unless forced (then it replaces it)."""
    won = [r for r in runs if r.rc == 0]
    lost = [r for r in runs if r.rc != 0]
    assert all("Traceback" not in r.output for r in runs), runs
    if share_races.overlapped(runs):
        assert len(won) == 1 and len(lost) == 1 and lost[0].rc == 1, runs
        # It met the winner's claim (named), or its finished cache, or (forced, taking that over) the
        # winner's manifest published under it: never both published.
        assert (f"another push is writing {url}: pid {won[0].pid} on {current_host()}" in lost[0].output
                or "holds a different cache" in lost[0].output
                or (forced and f"another push published {url}/manifest.json first" in lost[0].output)), lost[0].output
    elif forced:
        assert len(won) == 2, runs
    else:
        assert len(won) == 1 and "holds a different cache" in lost[0].output, runs


def test_two_pushes_started_together_one_wins_the_other_names_it(tmp_path, s3):
    caches = share_races.two_caches(tmp_path)
    overlaps = 0
    for trial in range(2):  # released together after their imports: they overlap (make reliability runs 8)
        prefix = f"team/c{trial}"
        url = s3.url(prefix)
        runs = share_races.race([caches["a"][0], caches["b"][0]], url)
        _check_race(runs, url, forced=False)
        overlaps += share_races.overlapped(runs)
        _check_one_cache(url, caches, s3, prefix)
        assert not s3.fs.exists(s3.url(f"{prefix}/{MARKER}"))
    assert overlaps, "no trial had its two pushes running at the same time"


@pytest.mark.slow  # 17 s; the plain race above is the fast one
def test_two_push_force_replacements_started_together_leave_one_cache(tmp_path, s3):
    caches = share_races.two_caches(tmp_path)
    c, _, _ = make_cache(tmp_path / "c", n=40, shard_size=8, h=16, w=8)
    for trial in range(3):
        prefix = f"team/r{trial}"
        url = s3.url(prefix)
        assert _cli("push", c, url, "--no-progress").exit_code == 0
        runs = share_races.race([caches["a"][0], caches["b"][0]], url, "--force")
        _check_race(runs, url, forced=True)
        _check_one_cache(url, caches, s3, prefix)


@pytest.fixture
def held_push(tmp_path, s3):
    """Cache A's push from this process, stopped after it took its claim (its data files not yet sent)."""
    caches = share_races.two_caches(tmp_path)
    url = s3.url("team/h")
    go, waiting = threading.Event(), threading.Event()
    real = push_module.upload

    def held(*args, **kwargs):
        waiting.set()
        go.wait(60)
        return real(*args, **kwargs)

    result: list[object] = []
    push_module.upload = held
    thread = threading.Thread(target=lambda: result.append(_cli("push", caches["a"][0], url, "--no-progress")))
    thread.start()
    try:
        assert waiting.wait(60)
        yield caches, url, go, thread, result
    finally:
        go.set()
        thread.join(60)
        push_module.upload = real


def test_a_push_meeting_a_running_push_stops_before_writing_anything(held_push, s3):
    caches, url, go, thread, result = held_push
    before = s3.fs.cat(s3.url(f"team/h/{MARKER}"))
    s3.log.clear()
    p = share_races.start_push(caches["b"][0], url)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 1, text
    assert re.search(rf"another push is writing {re.escape(url)}: pid \d+ on {re.escape(current_host())} \(user ",
                     text), text
    assert "push-in-progress.json" in text and "Traceback" not in text
    assert not [q for q in s3.log if q.method in ("PUT", "POST", "DELETE")]  # nothing written by the loser
    assert s3.fs.cat(s3.url(f"team/h/{MARKER}")) == before
    go.set()
    thread.join(60)
    assert result[0].exit_code == 0, result[0].output  # type: ignore[attr-defined]
    assert _check_one_cache(url, caches, s3, "team/h") == "a"


def test_a_claim_renewed_by_its_holder_is_refused_and_one_left_by_a_stopped_host_expires(tmp_path, s3, monkeypatch):
    """A marker naming a holder on another host: refused while it is recent, taken over once it is older than
    the claim's lifetime (the host died, or its push was killed there)."""
    caches = share_races.two_caches(tmp_path)
    url = s3.url("team/x")
    holder = {"host": "gpu-node-7", "pid": 4242, "user": "ada", "started": "2026-01-01T00:00:00+00:00",
              "command": "cachebuild push a s3://team.invalid/x"}
    s3.fs.pipe(s3.url(f"team/x/{MARKER}"), json.dumps({"manifest_sha256": "0" * 64, "trust_sizes": True,
                                                         "holder": holder, "token": "t"}).encode())
    r = _cli("push", caches["b"][0], url, "--no-progress")
    assert r.exit_code == 1 and "another push is writing" in r.output, r.output
    assert "pid 4242 on gpu-node-7 (user ada)" in r.output, r.output
    # The claim's lifetime is read when a push starts (CACHEBUILD_PUSH_STALE_S): at 2 s the marker expires 2 s
    # after it was written, and this push renews its own claim every 0.2 s and would stop if it went 1 s without.
    monkeypatch.setenv("CACHEBUILD_PUSH_STALE_S", "2")
    written = s3.fs.info(s3.url(f"team/x/{MARKER}"), refresh=True)["LastModified"]
    while (datetime.datetime.now(datetime.timezone.utc) - written).total_seconds() <= 2:
        time.sleep(0.1)
    r = _cli("push", caches["b"][0], url, "--no-progress")
    assert r.exit_code == 0, r.output
    assert _check_one_cache(url, caches, s3, "team/x") == "b"


def test_a_push_that_lost_its_claim_never_writes_its_manifest(tmp_path, s3):
    """Another push took the marker over (this one was presumed dead): this one stops at its next check."""
    caches = share_races.two_caches(tmp_path)
    url = s3.url("team/l")
    real = push_module.upload

    def taken_over(folder, items, dst, **kw):
        s3.fs.pipe(s3.url(f"team/l/{MARKER}"), json.dumps({"holder": {"host": "other", "pid": 1, "user": "bob",
                   "started": "now", "command": "cachebuild push"}, "token": "t"}).encode())
        return real(folder, items, dst, **kw)

    push_module.upload = taken_over
    try:
        r = _cli("push", caches["a"][0], url, "--no-progress")
    finally:
        push_module.upload = real
    assert r.exit_code == 1 and "its marker was taken over: pid 1 on other (user bob)" in r.output, r.output
    assert not s3.fs.exists(s3.url("team/l/manifest.json"))


@pytest.mark.parametrize("lost", [MARKER, "manifest.json"])
def test_an_exclusive_write_whose_answer_was_lost_is_known_as_its_own(tmp_path, s3, fault_proxy, monkeypatch, lost):
    """The claim's (or the manifest's) ``If-None-Match: *`` write lands, but its answer is lost: the proxy
    cuts the connection once moto has applied it. The retry fails its condition, and the push must see the
    object is its own (the marker's token, the manifest's bytes), not another push's."""
    caches = share_races.two_caches(tmp_path)
    proxy = fault_proxy(s3.endpoint_url, every=1, kinds=("reset",), limit=1,
                        only=lambda method, path: method == "PUT" and path.endswith("/" + lost))
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(name, proxy.url)
    url = s3.url("team/lost")
    r = _cli("push", caches["a"][0], url, "--no-progress")
    assert r.exit_code == 0, r.output
    assert proxy.faults["reset"] == 1  # the write went through the proxy and its answer was cut
    assert _check_one_cache(url, caches, s3, "team/lost") == "a"
    assert not s3.fs.exists(s3.url(f"team/lost/{MARKER}"))


# 5 s each: the middle point runs by default, the early and late ones in `make test-all`
@pytest.mark.parametrize("after_s", [pytest.param(0.05, marks=pytest.mark.slow), 0.3,
                                     pytest.param(0.6, marks=pytest.mark.slow)])
def test_a_push_killed_at_any_point_and_rerun_completes(tmp_path, s3, after_s):
    caches = share_races.two_caches(tmp_path)
    url = s3.url("team/k")
    rc = share_races.kill_during(caches["a"][0], url, after_s, "--jobs", "1")
    assert rc in (-9, 0)
    r = _cli("push", caches["a"][0], url, "--no-progress")
    assert r.exit_code == 0, r.output
    assert _check_one_cache(url, caches, s3, "team/k") == "a"
    # And another cache's push --force after a killed one: the dead holder's claim is taken over at once.
    rc = share_races.kill_during(caches["b"][0], url, after_s, "--force", "--jobs", "1")
    r = _cli("push", caches["b"][0], url, "--no-progress", "--force")
    assert r.exit_code == 0, r.output
    assert _check_one_cache(url, caches, s3, "team/k") == "b"


def test_a_store_without_conditional_writes_says_pushes_are_not_locked_out(tmp_path, http_server):
    root, images, _ = make_cache(tmp_path / "a", n=20, shard_size=8, h=16, w=12)
    server = http_server(tmp_path / "site", writable=True)
    url = server.url_for("c")
    r = _cli("push", root, url, "--no-progress")
    assert r.exit_code == 0, r.output
    assert r.output.count("offers no conditional writes") == 1 and "not locked out" in r.output, r.output
    assert np.array_equal(share_races.served(url, 20), make_images(20, 16, 12))
    assert np.array_equal(images, make_images(20, 16, 12))


def test_a_push_that_failed_gives_its_claim_up_to_a_push_from_anywhere(tmp_path, s3):
    """Before: the failed push's marker named a live process (this one), and another process's push was
    refused until this process ended."""
    caches = share_races.two_caches(tmp_path)
    url = s3.url("team/f")
    with upload_fails_on("images-00003.npy"):
        r = _cli("push", caches["a"][0], url, "--no-progress")
    assert r.exit_code == 1 and "connection reset" in r.output, r.output
    assert "holder" not in json.loads(s3.fs.cat(s3.url(f"team/f/{MARKER}")))
    p = share_races.start_push(caches["a"][0], url)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "already there" in text, text
    assert _check_one_cache(url, caches, s3, "team/f") == "a"


def test_a_marker_left_beside_a_complete_cache_is_removed_by_the_next_push_of_it(tmp_path, s3):
    """A push killed after its manifest and before removing its marker: the rerun finds the cache up to date
    and removes the marker (before: it stayed for good)."""
    caches = share_races.two_caches(tmp_path)
    url = s3.url("team/m")
    assert _cli("push", caches["a"][0], url, "--no-progress").exit_code == 0
    s3.fs.pipe(s3.url(f"team/m/{MARKER}"), json.dumps({"manifest_sha256": "0" * 64, "trust_sizes": True,
               "holder": {"host": current_host(), "pid": 2 ** 22 + 17, "user": "x", "started": "t",
                          "command": "c"}, "token": "t"}).encode())
    r = _cli("push", caches["a"][0], url, "--no-progress")
    assert r.exit_code == 0 and "up to date" in r.output, r.output
    assert _check_one_cache(url, caches, s3, "team/m") == "a"
