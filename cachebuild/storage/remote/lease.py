"""A reader's lease on a cache of a team store: while a job reads a cache at a URL, a record in the store says so,
and ``cachebuild gc`` never removes a cache with a live lease.

A store (``cachebuild.share.store``) keeps its own records beside its caches, under :data:`RECORDS` (a dot name:
no cache and no listing of caches uses it): :data:`STORE_MARK` marks the folder or prefix a store;
``.store/leases/<cache>/<token>.json`` is one reader's lease (:func:`lease_name`); ``.store/used/<cache>.json``
the cache's last use (:func:`used_name`). A reader of a URL cache whose parent is a store writes its lease when
it opens the cache, writes it again every :func:`renew_every` seconds from a thread of its own while the reader
lives, and removes it when the reader is dropped, recording the last use. A lease not renewed within its
``ttl_s`` is dead: its reader was killed or hangs. A reader over plain HTTP cannot write: its renewal is a
``HEAD`` of the manifest, and ``cachebuild serve`` writes the leases of the caches it serves.

The records hold who reads (host, pid, user) and when, never a command line or a credential.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RECORDS", "STORE_MARK", "Lease", "LeaseRecord", "lease_name", "leases_folder", "new_token", "renew_every",
           "used_name", "utc_now"]

log = logging.getLogger("cachebuild")

RECORDS = ".store"  # a store's own records, beside its caches
STORE_MARK = f"{RECORDS}/store.json"  # a folder or prefix holding this file is a store
RENEW_MAX_S = 60.0  # the longest wait between two renewals of a lease


def leases_folder(cache: str) -> str:
    """The folder of the leases on the store's cache ``cache`` (its name in the store)."""
    return f"{RECORDS}/leases/{cache}"


def lease_name(cache: str, token: str) -> str:
    return f"{leases_folder(cache)}/{token}.json"


def used_name(cache: str) -> str:
    """The record of the last use of the store's cache ``cache``."""
    return f"{RECORDS}/used/{cache}.json"


def new_token() -> str:
    return secrets.token_hex(8)


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def renew_every(ttl_s: float) -> float:
    """How often a lease of lifetime ``ttl_s`` is renewed: every tenth of it, at most every :data:`RENEW_MAX_S`."""
    return min(RENEW_MAX_S, ttl_s / 10)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container uid without a passwd entry
        return f"uid {os.getuid()}"


@dataclass(frozen=True)
class LeaseRecord:
    """One lease (or, with ``ttl_s`` 0, one use) as the store holds it."""

    host: str
    pid: int
    user: str
    renewed: str  # ISO 8601, UTC, by the holder's clock
    ttl_s: float
    what: str = "reader"  # "reader" (a job), "serve" (a server of the store), "use" (a record of the last use)

    @classmethod
    def now(cls, ttl_s: float, what: str = "reader", at: _dt.datetime | None = None) -> LeaseRecord:
        """This process's record, renewed now (or ``at``, a UTC time)."""
        return cls(socket.gethostname() or "unknown-host", os.getpid(), _user(),
                   (at or utc_now()).isoformat(timespec="milliseconds"), float(ttl_s), what)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes) -> LeaseRecord | None:
        """The record in ``data`` (None: not one: a record written by something else is not trusted)."""
        try:
            doc: Any = json.loads(data)
            record = cls(str(doc["host"]), int(doc["pid"]), str(doc["user"]), str(doc["renewed"]),
                         float(doc["ttl_s"]), str(doc.get("what", "reader")))
            record.when()
        except (ValueError, TypeError, KeyError):
            return None
        return record

    def when(self) -> _dt.datetime:
        at = _dt.datetime.fromisoformat(self.renewed)
        return at if at.tzinfo is not None else at.replace(tzinfo=_dt.timezone.utc)

    def live(self, now: _dt.datetime | None = None) -> bool:
        """Renewed within its lifetime (a record of use never is)."""
        return (((now or utc_now()) - self.when()).total_seconds() <= self.ttl_s) if self.ttl_s > 0 else False

    def describe(self) -> str:
        return f"{self.what} pid {self.pid} on {self.host} (user {self.user}), renewed {self.renewed}"


class Lease:
    """One lease kept alive: ``renew()`` now (unless not ``now``), then every ``every_s`` seconds from a daemon
    thread; ``release()`` by :meth:`close` (also when the owner is dropped or the process exits; never in a forked
    child, whose copy of the owner is not the reader that holds the lease). A failed renewal is logged and tried
    again at the next turn: the job reads on (its cache is then not protected from ``gc`` once the lease runs
    out)."""

    def __init__(self, renew: Callable[[], None], release: Callable[[], None], every_s: float, shown: str, *,
                 now: bool = True) -> None:
        self._renew, self._release, self.every_s, self.shown = renew, release, every_s, shown
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._warned = False
        if now:  # before the reader reads: a gc that has not seen the lease yet has seen no reader either
            self._beat()
        self._thread = threading.Thread(target=self._run, name="cachebuild-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        try:
            self._renew()
        except Exception as e:  # the job reads on; say once what it risks
            if not self._warned:
                log.warning("could not renew the lease on %s (%s): `cachebuild gc` may remove it while this job "
                            "reads it", self.shown, str(e).splitlines()[0] if str(e) else type(e).__name__)
                self._warned = True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._beat()

    @property
    def active(self) -> bool:
        return not self._stop.is_set()

    def close(self) -> None:
        """Stop renewing and give the lease up (best effort: a lease left behind runs out by itself)."""
        if self._stop.is_set() or os.getpid() != self._pid:
            return
        self._stop.set()
        try:
            self._release()
        except Exception as e:
            log.info("could not release the lease on %s: %s", self.shown, e)
