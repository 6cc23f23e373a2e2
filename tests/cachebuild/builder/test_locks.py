"""Locks that name their holder: a second build of one output exits naming the first, or waits for it; a
dead holder's lock is taken over; the result is a complete, verified cache."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from cachebuild.builder.locks import exclusive_lock, lock_path, read_holder
from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.cli import main
from cachebuild.errors import LockHeldError
from cachebuild.sources.folder import folder_plan
from cachebuild.storage.cache import current_host, current_user, read_manifest


def test_the_lock_names_its_holder_and_a_second_build_names_it_too(imagenet_clean, tmp_path):
    plan = folder_plan(imagenet_clean["train_dir"])
    out = tmp_path / "c"
    with exclusive_lock(out):
        holder = read_holder(lock_path(out))
        assert holder is not None and holder.pid == os.getpid() and holder.host == current_host()
        assert holder.user == current_user() and holder.started and holder.command
        with pytest.raises(LockHeldError) as e:
            build(plan, out, BuildOptions(size=16, jobs=1))
        msg = str(e.value)
        assert f"pid {os.getpid()} on {current_host()} (user {current_user()})" in msg and "--wait" in msg
        t0 = time.monotonic()
        with pytest.raises(LockHeldError, match=r"waited 0\.4 s"):
            build(plan, out, BuildOptions(size=16, jobs=1, lock_wait=0.4))
        assert time.monotonic() - t0 >= 0.4
        assert not out.exists() and not (tmp_path / "c.partial").exists()
    assert read_holder(lock_path(out)) is None  # released cleanly: the file names nobody


def test_a_waiting_build_goes_ahead_when_the_holder_is_done(imagenet_clean, tmp_path):
    plan = folder_plan(imagenet_clean["train_dir"])
    out = tmp_path / "c"
    held = threading.Event()

    def hold_briefly() -> None:
        with exclusive_lock(out):
            held.set()
            time.sleep(0.5)

    t = threading.Thread(target=hold_briefly)
    t.start()
    held.wait(10)
    result = build(plan, out, BuildOptions(size=16, jobs=1, lock_wait=math.inf))
    t.join()
    assert result.status == "built" and read_manifest(out).count == result.count


def test_lock_command_lines_never_show_url_credentials():
    from cachebuild.storage.cache import command_line

    shown = command_line(["/usr/bin/cachebuild", "pull", "https://bob:pw@host/c?X-Amz-Signature=abc", "/d"])
    assert shown == "cachebuild pull https://host/c /d"
    assert command_line(["/x/cachebuild/__main__.py", "ls", "s3://b/p"]) == "cachebuild ls s3://b/p"


def test_two_cli_builds_of_one_output_one_builds_the_other_exits_or_waits_and_takes_over(imagenet_tree, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cachebuild", "imagenet", str(imagenet_tree["root"]), "--split", "train",
           "--size", "224", "--shard-size", "4", "-j", "1", "--no-progress", "--out", str(out)]
    lock = out / "train.lock"
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    waiting = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline and getattr(read_holder(lock), "pid", None) != first.pid:
            time.sleep(0.002)
        os.killpg(first.pid, signal.SIGSTOP)  # frozen while it holds the lock: no race with its end
        assert first.poll() is None and read_holder(lock).pid == first.pid, "the first build must hold the lock"

        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        named = f"pid {first.pid} on {current_host()} (user {current_user()})"
        assert named in second.stderr and "imagenet" in second.stderr and "--wait" in second.stderr

        log = tmp_path / "waiting.log"
        with open(log, "w") as f:
            waiting = subprocess.Popen([*cmd, "--wait"], stdout=f, stderr=f, start_new_session=True)
        while time.time() < deadline and "waiting for the lock" not in log.read_text():
            time.sleep(0.02)
        assert "waiting for the lock" in log.read_text() and str(first.pid) in log.read_text()
        assert waiting.poll() is None
        os.killpg(first.pid, signal.SIGKILL)  # the holder dies: the kernel drops its lock
        first.wait()
        assert waiting.wait(timeout=120) == 0, log.read_text()
    finally:
        for proc in (first, waiting):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    r = CliRunner().invoke(main, ["verify", str(out / "train")])
    assert r.exit_code == 0, r.output
    m = read_manifest(out / "train")
    assert (m.count, len(m.failures)) == (len(imagenet_tree["train"]), len(imagenet_tree["broken"]))
    assert read_holder(lock) is None
