"""One writer per cache folder, and a lock that says who holds it.

A build or a pull of ``<out>`` holds an exclusive ``flock`` on ``<out>.lock`` for its whole run and writes
its holder into the file: host, pid, user, start time, command line (URLs redacted). A second process
either exits at once with an error naming that holder, or (``wait``) polls until the lock is free or the
wait runs out. The kernel drops a ``flock`` when its process dies, however it dies, so a killed holder's
lock is taken over by the next process without anyone cleaning up; the dead holder's name may stay in the
file until then and is overwritten by the new holder. The lock file itself is never deleted (removing a
lock file races with a process that just opened it).

Shared filesystems: on NFS, Linux turns ``flock`` into a POSIX lock that the server arbitrates (NFSv4, or
v3 with lockd; not with the ``nolock`` or ``local_lock=flock``/``all`` mount options, under which two hosts
can both "hold" it). When a client holding the lock crashes, the server frees it when the client's lease
runs out (NFSv4: 90 s by default) or lockd notices the reboot, so a takeover across hosts takes that long.
A holder on another host cannot be checked for liveness from here; its name in the message tells you whom
to ask.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from cachebuild.errors import LockHeldError
from cachebuild.processes import pid_alive
from cachebuild.storage.cache import command_line, current_host, current_user

__all__ = ["Holder", "exclusive_lock", "lock_path", "read_holder"]

log = logging.getLogger("cachebuild")

POLL_S = 0.2  # how often a waiting process tries again


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    user: str
    started: str
    command: str

    @classmethod
    def me(cls) -> Holder:
        import datetime as _dt

        started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        return cls(current_host(), os.getpid(), current_user(), started, command_line())

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (user {self.user}), since {self.started}: {self.command}"


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".lock")


def read_holder(lock: Path) -> Holder | None:
    """The holder named in ``lock`` (None: none named, unreadable, or mid-write)."""
    try:
        doc = json.loads(lock.read_bytes() or b"null")
        return Holder(str(doc["host"]), int(doc["pid"]), str(doc["user"]), str(doc["started"]), str(doc["command"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _holder_text(lock: Path) -> str:
    holder = read_holder(lock)
    if holder is None:
        return "holder not named in the lock file"
    if holder.host == current_host() and not pid_alive(holder.pid):
        # flock is held, so a live process holds it; the file names an older, dead one (its successor could
        # not write the file, e.g. another user without write permission on it).
        return f"holder not named in the lock file (it still names pid {holder.pid}, which is not running)"
    return holder.describe()


def _open(lock: Path) -> tuple[int, bool]:
    """(fd, writable). The file is made group-shareable as far as the umask allows (0666 minus the umask):
    teammates must be able to open it. Without write permission flock still works; the name is not written."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666), True
    except PermissionError:
        return os.open(lock, os.O_RDONLY | os.O_CLOEXEC), False


@contextlib.contextmanager
def exclusive_lock(out: str | os.PathLike[str], *, wait: float | None = None,
                   action: str = "building") -> Iterator[Path]:
    """Hold the lock of ``out`` (``<out>.lock``) for the ``with`` block; yields the lock file's path.

    ``wait``: None or 0, fail at once if another process holds it; N > 0, wait up to N seconds;
    ``math.inf``, wait as long as it takes. Failing raises :class:`~cachebuild.errors.LockHeldError`
    naming the holder.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = lock_path(out)
    fd, writable = _open(lock)
    try:
        deadline = time.monotonic() + (wait or 0)
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            holder = _holder_text(lock)
            if not wait or time.monotonic() >= deadline:
                waited = f" (waited {wait:g} s)" if wait else ""
                raise LockHeldError(
                    f"another cachebuild process is {action} {out}{waited}: {holder}; it holds {lock}. Wait for "
                    f"it to finish (--wait [SECONDS] waits), or stop that process: its lock is released when it "
                    f"ends, however it ends") from None
            if not announced:
                log.warning("waiting for the lock on %s: %s", out, holder)
                announced = True
            time.sleep(max(0.0, min(POLL_S, deadline - time.monotonic())))
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(asdict(Holder.me())) + "\n").encode(), 0)
        else:
            log.info("cannot write my name into %s (no write permission): waiting processes will not see it", lock)
        try:
            yield lock
        finally:
            if writable:
                os.ftruncate(fd, 0)  # released cleanly: nobody holds it any more
    finally:
        os.close(fd)  # drops the flock
