"""One push at a time per URL prefix: the push marker is a claim, taken and kept with conditional writes.

``push`` writes ``push-in-progress.json`` before anything else and removes it last (``cachebuild.share.push``).
On S3 that write is atomic and exclusive: ``If-None-Match: *`` where there is no marker, ``If-Match: <etag>``
to take over one whose holder is gone. Of two pushes that start together exactly one gets the claim; the
other stops before it has written anything, with a :class:`~cachebuild.errors.LockHeldError` naming the
holder (host, pid, user, start time, command, as a build's lock does). The holder renews its marker every
tenth of the claim's lifetime, at most :data:`HEARTBEAT_S` (each write ``If-Match`` its last one), checks the
claim is still its own before it writes the file table and the manifest, and writes the manifest
``If-None-Match: *``: a push that lost its claim never publishes.

A marker's holder is gone when it is a process of this host that no longer runs (or this process, whose push
of it ended), when the marker was last renewed more than the claim's lifetime ago by the store's clock (a
holder on another host that stopped), or when it names no holder (a push that failed gives its marker up so).
A holder stops uploading on its own once its last renewal is older than half of that, so a takeover never
meets its writes. A push killed at any point and rerun on the same host resumes at once; rerun elsewhere,
after the lifetime: ``CACHEBUILD_PUSH_STALE_S`` seconds, read when a push starts (:mod:`cachebuild.settings`).

Stores without conditional writes (plain HTTP PUT servers, and every store but S3 here:
:attr:`~cachebuild.storage.Location.conditional_writes`) get the same checks with plain writes: a holder that
is alive is refused, but two pushes that start in the same instant are not locked out; the push warns once.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict
from typing import Any

from cachebuild.builder.locks import Holder, pid_alive
from cachebuild.errors import LockHeldError, RemoteNotFoundError, TransferError
from cachebuild.settings import settings
from cachebuild.storage import Location
from cachebuild.storage.cache import current_host
from cachebuild.storage.remote.pinning import etag_of

__all__ = ["HEARTBEAT_S", "ClaimRaced", "PushClaim", "holder_text"]

log = logging.getLogger("cachebuild")

HEARTBEAT_S = 30.0  # the longest wait between a holder's renewals

_ACTIVE: set[str] = set()  # tokens of the claims this process holds now
_LOST = object()


class ClaimRaced(LockHeldError):
    """The claim went to another push that has already ended: look at the prefix again."""


def holder_text(doc: dict[str, Any]) -> str:
    """The holder a marker ``doc`` names, as messages show it (host, pid, user, since when, command)."""
    h = doc.get("holder")
    if not isinstance(h, dict):
        return "holder not named in the marker"
    try:
        return Holder(str(h["host"]), int(h["pid"]), str(h["user"]), str(h["started"]), str(h["command"])).describe()
    except (KeyError, TypeError, ValueError):
        return "holder not named in the marker"


def _gone(doc: dict[str, Any], info: dict[str, Any], stale_s: float) -> bool:
    """Whether the holder of the marker ``doc`` (with the store's ``info`` of it) no longer pushes."""
    h = doc.get("holder")
    if not isinstance(h, dict) or not isinstance(h.get("pid"), int):
        return True  # given up by a push that failed, or a marker that names no holder
    if h.get("host") == current_host():
        if h["pid"] == os.getpid():
            return doc.get("token") not in _ACTIVE
        if not pid_alive(h["pid"]):
            return True
        # alive: still pushing, or a long-lived process (a notebook) whose push died without a word
    modified = info.get("LastModified")
    if not isinstance(modified, _dt.datetime):
        return True  # a store that does not say when (plain HTTP): the rerun takes over
    return (_dt.datetime.now(_dt.timezone.utc) - modified).total_seconds() > stale_s


class PushClaim:
    """This process's claim on the marker at ``dst``: :meth:`found` what is there, :meth:`write` the marker
    (the first write takes the claim), :meth:`publish` the manifest, :meth:`release`. Not reentrant."""

    def __init__(self, dst: Location, marker_name: str) -> None:
        self.dst = dst
        self.name = marker_name
        self.url = dst.describe()
        self.conditional = dst.conditional_writes
        self.token = secrets.token_hex(8)
        self.holder = asdict(Holder.me())
        self.stale_s = settings().push_stale_s  # a claim not renewed for this long is free
        self.hold_s = self.stale_s / 2  # a holder whose last renewal is older stops: nobody can have taken over
        self.heartbeat_s = min(HEARTBEAT_S, self.stale_s / 10)
        self._doc: dict[str, Any] = {}
        self._etag: str | None = None  # the marker's tag as we last wrote it (None: not ours yet)
        self._found_etag: str | None = None  # the tag of a marker we may take over
        self._renewed = 0.0
        self._watched: tuple[str, str | None] | None = None
        self._lost = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def taken(self) -> bool:
        return self._etag is not None

    # ---------------------------------------------------------------- what is there
    def found(self) -> dict[str, Any]:
        """The marker at the prefix, checked free to take over (else a LockHeldError naming its holder)."""
        info = self._info()
        if info is None:
            return {}
        doc = self._read_doc()
        if not doc and self._read(self.name) is None:  # removed since: that push ended; what it left decides
            raise ClaimRaced(f"{self.url}: another push ended while this one looked at it")
        if not _gone(doc, info, self.stale_s):
            raise self._held(doc)
        self._found_etag = etag_of(info)
        return doc

    def watch(self, name: str) -> None:
        """Note the version of ``name`` (the manifest) now, before the push looks at the prefix: if another
        push changes it before this one's claim is taken, the claim is given back and the push looks again."""
        self._watched = (name, etag_of(self._info(name) or {}) if self.conditional else None)

    def _unchanged(self) -> bool:
        if self._watched is None or not self.conditional:
            return True
        name, tag = self._watched
        return etag_of(self._info(name) or {}) == tag

    def _info(self, name: str = "") -> dict[str, Any] | None:
        try:
            return self.dst.stat(name or self.name, fresh=True)
        except RemoteNotFoundError:
            return None

    def _held(self, doc: dict[str, Any]) -> LockHeldError:
        return LockHeldError(
            f"another push is writing {self.url}: {holder_text(doc)}; its marker is "
            f"{self.dst.describe(self.name)}. Wait for it to finish; if it was stopped, rerun on its host (at "
            f"once) or anywhere once its marker is {self.stale_s:.0f} s old")

    # ---------------------------------------------------------------- writing under the claim
    def write(self, marker: dict[str, Any]) -> None:
        """Write the marker ``marker`` (plus holder and token); the first write takes the claim."""
        with self._lock:
            first = self._etag is None
            self._doc = {**marker, "holder": self.holder, "token": self.token}
            self._put(first)
        if first:
            _ACTIVE.add(self.token)
            self.check()  # read back: a store that raced two exclusive writes has one of them now
            if not self._unchanged():
                # Another push published while this one decided from what it saw before: give the claim
                # back untouched (nothing else written yet) and look again.
                self.dst.remove(self.name)
                self._etag = None
                _ACTIVE.discard(self.token)
                raise ClaimRaced(f"{self.url}: another push published there while this one looked")
            if not self.conditional:
                log.warning("%s offers no conditional writes: another push started at the same moment is not "
                            "locked out (run one push at a time there)", self.url)
            self._thread = threading.Thread(target=self._heartbeat, name="cachebuild-push-claim", daemon=True)
            self._thread.start()

    def _put(self, first: bool) -> None:
        doc = dict(self._doc, renewed=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"))
        data = json.dumps(doc).encode()
        if not self.conditional:
            self.dst.write_bytes(self.name, data)
            self._etag, self._renewed = "", time.monotonic()
            return
        # the first write: over the marker found (its tag), or only where there is none (None)
        match = (self._found_etag or None) if first else self._etag
        got = self._conditional_put(self.name, data, match)
        if got is _LOST:
            if first:
                doc = self._read_doc()
                if not doc:  # written and removed since: that push ended; what it left decides
                    raise ClaimRaced(f"{self.url}: another push claimed it at the same moment and has ended")
                raise self._held(doc)
            self._lost = f"its marker was taken over: {holder_text(self._read_doc())}"
            raise self._conflict()
        self._etag, self._renewed = got, time.monotonic()  # type: ignore[assignment]

    def _conditional_put(self, name: str, data: bytes, match: str | None) -> object:
        """The new ETag, or _LOST when the condition failed. A retried write whose first try landed fails
        its condition too: the marker's token says whether it was ours."""
        got = self.dst.write_if(name, data, match)
        if got is not None:
            return got or etag_of(self._info() or {})
        if name == self.name and self._read_doc().get("token") == self.token:
            return etag_of(self._info() or {})
        if name != self.name and self._read(name) == data:
            return ""
        return _LOST

    def _forget_listing(self) -> None:
        # s3fs sizes a whole-object read from its listings cache: a marker written since this process listed
        # the prefix would read as missing.
        self.dst.forget_listing(self.name)

    def _read(self, name: str) -> bytes | None:
        self._forget_listing()
        try:
            return self.dst.read_bytes(name)
        except RemoteNotFoundError:
            return None

    def _read_doc(self) -> dict[str, Any]:
        self._forget_listing()
        try:
            doc = json.loads(self.dst.read_bytes(self.name))
        except (ValueError, RemoteNotFoundError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def marker(self) -> dict[str, Any]:
        """The marker at the prefix now ({}: none, or not JSON)."""
        return self._read_doc()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                if self._lost or self._stop.is_set():
                    return
                try:
                    self._put(False)
                except TransferError:
                    return  # lost: check() says so to the push
                except Exception as e:  # a failed renewal is retried; check() bounds its age
                    log.info("could not renew %s: %s", self.dst.describe(self.name), e)

    def _conflict(self) -> TransferError:
        return TransferError(f"push to {self.url} stopped: {self._lost}; no manifest was written by this push")

    def check(self) -> None:
        """Raise unless the claim is still ours (and recent enough that nobody may take it over)."""
        if self._lost:
            raise self._conflict()
        if time.monotonic() - self._renewed > self.hold_s:
            self._lost = f"its claim was not renewed for {time.monotonic() - self._renewed:.0f} s"
            raise self._conflict()
        if self.conditional and etag_of(self._info() or {}) != self._etag:
            self._lost = f"its marker was taken over: {holder_text(self._read_doc())}"
            raise self._conflict()

    def publish(self, name: str, data: bytes) -> None:
        """Write ``name`` (the manifest) only where none is: another push's manifest is never replaced."""
        self.check()
        if not self.conditional:
            self.dst.write_bytes(name, data)
            return
        if self._conditional_put(name, data, None) is _LOST:
            self._lost = f"another push published {self.dst.describe(name)} first"
            raise self._conflict()

    def abandon(self) -> None:
        """The push failed: give the marker up (its holder removed, what it says for a rerun kept), so that a
        rerun anywhere takes it over at once. Best effort: a store that cannot be reached keeps it until
        the claim's lifetime has passed."""
        self._stop.set()
        with self._lock:
            if self._etag is None or self._lost:
                return
            doc = {k: v for k, v in self._doc.items() if k not in ("holder", "token")}
            try:
                if self.conditional:
                    self._conditional_put(self.name, json.dumps(doc).encode(), self._etag)
                else:
                    self.dst.write_bytes(self.name, json.dumps(doc).encode())
            except Exception as e:  # the push's own error is the one to report
                log.info("could not give up %s: %s", self.dst.describe(self.name), e)

    def release(self) -> None:
        """Stop renewing; the push then removes the marker (a push that failed leaves it for its rerun)."""
        self._stop.set()
        with self._lock:
            _ACTIVE.discard(self.token)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
