"""A build through a team store (``--store``): use the store's cache of the recipe, or wait for the one being
built, or build it and publish it there. Built on what exists: the build and its lock, push and pull with their
checks, a push's claim with its heartbeats; no scheduler, no database.

For each split the build command plans (its cache's key and name: :mod:`cachebuild.share.store`):

- **The store holds it** (complete, its whole key, quick check passed): nothing is decoded. Its URL is printed;
  ``--out DIR`` pulls it into ``DIR/<split>`` (every file checked against its checksum).
- **A folder store** (local or NFS): the build runs into the store itself, ``<store>/<name>``, as any build: its
  lock ``<name>.lock`` is the claim (the kernel, or the NFS server, releases a dead builder's), its blocks go to
  ``<name>.partial/`` and the manifest is written last before the folder is renamed into place. A second request
  finds the lock held and waits, saying whose build it is and how many blocks are done (``--no-wait``: exits
  naming it); when the lock comes free it finds the cache, or (the builder died) takes the build over, resuming
  from the dead builder's blocks: the same bytes as an uninterrupted build.
- **An object store** (``s3://``...): the claim is the push marker of the cache's prefix
  (:mod:`cachebuild.share.claim`: taken with a conditional write, renewed every tenth of
  ``CACHEBUILD_PUSH_STALE_S``), taken before anything is decoded and carrying the build's progress. The build runs
  into ``--out`` (or the default output folder), the claim passes to the push (same process: the push takes it
  over at once), which sends the data files, then the file table, then the manifest. A waiter polls the manifest
  and the marker; a claim whose holder died (a process of this host that no longer runs, or a marker not renewed
  for its lifetime) is taken over, and the build runs again here.
- **An http(s) store** (``cachebuild serve``) is read-only: a cache it lacks is built here, at ``--out``, and not
  published.

``--dask-scheduler`` runs the blocks on a cluster as for any build (its workers must see the output folder: a
folder store's path, or ``--out``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cachebuild.atomic import write_json_atomic
from cachebuild.builder.block import record_path
from cachebuild.builder.locks import lock_path, read_holder
from cachebuild.builder.options import BuildResult
from cachebuild.builder.pipeline import build, default_out
from cachebuild.errors import LockHeldError, OptionError
from cachebuild.format.manifest import MANIFEST_NAME, Manifest
from cachebuild.share.claim import ClaimRaced, PushClaim, holder_text
from cachebuild.share.contents import PUSH_MARKER
from cachebuild.share.pull import PullResult, pull
from cachebuild.share.push import push
from cachebuild.share.store import Store, Wanted, plan_wanted
from cachebuild.storage.cache import staging_path

__all__ = ["StoreBusyError", "StoreResult", "build_with_store"]

log = logging.getLogger("cachebuild")

POLL_S = 1.0  # how often a waiting request looks again
REPORT_S = 30.0  # the longest silence of a wait: a progress line at least this often


class StoreBusyError(LockHeldError):
    """The cache is being built elsewhere and the request would not wait (``--no-wait``)."""


@dataclass(frozen=True)
class StoreResult:
    """What a build through a store did for one split: ``status`` is "found" (the store held it: nothing
    decoded), "built" (built and published) or "built here" (built at ``path``, not published: a read-only
    store). ``url``: the cache in the store ("" when not published); ``path``: the local copy (None: none)."""

    dataset: str
    split: str
    key: str
    status: str
    url: str
    path: Path | None
    count: int
    built: BuildResult | None = None
    pulled: PullResult | None = None
    waited_s: float = 0.0
    waited_for: str = ""

    def describe(self) -> str:
        what = f"{self.dataset}/{self.split}"
        if self.status == "found":
            line = (f"{what}: in the store ({self.count} samples, build key {self.key[:12]}; nothing decoded): "
                    f"{self.url}")
        elif self.status == "built":
            b = self.built
            took = f", {b.seconds:.1f} s" if b is not None and b.status == "built" else ""
            line = f"{what}: built ({self.count} samples{took}) and published: {self.url}"
            if self.path is not None and self.pulled is None:
                line += f"; built at {self.path}"
        else:
            line = (f"{what}: built at {self.path} ({self.count} samples); not published: an http(s) store is "
                    f"read-only (build with --store on the folder `cachebuild serve` serves, to share it)")
        if self.waited_s >= 1:
            line += f"; waited {self.waited_s:.0f} s for the build of {self.waited_for}"
        if self.pulled is not None:
            p = self.pulled
            line += (f"; pulled to {p.dest} ({p.fetched} files, {p.bytes_fetched / 1e6:.1f} MB, every file checked)"
                     if p.status == "pulled" else f"; {p.dest} holds it already")
        return line

    def summary(self) -> dict[str, Any]:
        """What ``--json FILE`` writes for this split."""
        return {"dataset": self.dataset, "split": self.split, "status": self.status, "url": self.url,
                "path": None if self.path is None else str(self.path), "count": self.count, "key": self.key,
                "decoded": 0 if self.built is None else self.built.decoded, "waited_s": round(self.waited_s, 3)}


def build_with_store(kind: str, src: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                     store: str | os.PathLike[str], wait: bool = True, size: int | None = None,
                     classes: list[str] | None = None, report: Callable[[StoreResult], None] | None = None,
                     storage_options: dict[str, Any] | None = None, **options: Any) -> list[StoreResult]:
    """``cachebuild KIND SRC --store STORE [--out OUT]``: each split's cache from the store, waited for, or built
    and published (the module docstring says how). ``wait=False`` raises :class:`StoreBusyError` naming a build
    running elsewhere instead of waiting for it; ``report`` is called with each split's result."""
    for flag in ("force", "update"):
        if options.get(flag):
            raise OptionError(f"--{flag} and --store exclude each other: a store's cache is never replaced (another "
                              f"source state or recipe is another build key, another cache)")
    st = Store(store, storage_options)
    root = Path(out) if out is not None else None
    results = []
    wanted = plan_wanted(kind, src, size=size, classes=classes, **options)
    for w in wanted:
        dest = None if root is None else root / w.plan.split
        if st.read_only:
            result = _from_read_only(st, w, dest)
        elif st.is_folder:
            result = _through_folder(st, w, dest, wait)
        else:
            result = _through_object_store(st, w, dest, wait)
        results.append(result)
        if report is not None:
            report(result)
    if wanted and wanted[0].opts.summary is not None:  # --json FILE
        write_json_atomic(Path(wanted[0].opts.summary), {"store": st.url, "splits": [r.summary() for r in results]})
    return results


def _result(st: Store, w: Wanted, status: str, m: Manifest | None, dest: Path | None, built: BuildResult | None,
            pulled: PullResult | None, wait: _Wait) -> StoreResult:
    count = m.count if m is not None else (built.count if built is not None else 0)
    url = st.url_of(w.name) if status != "built here" else ""
    local = pulled.dest if pulled is not None else dest
    return StoreResult(w.plan.dataset, w.plan.split, w.key, status, url, local, count, built, pulled, wait.waited_s,
                       wait.whose)


def _pull(st: Store, w: Wanted, dest: Path | None) -> PullResult | None:
    if dest is None:
        return None
    return pull(st.cache(w.name), dest, wait=w.opts.lock_wait, progress=w.opts.progress)[0]


# ---------------------------------------------------------------- waiting, with what is happening

class _Wait:
    """A request waiting for another's build: progress lines when something changes (at least every
    :data:`REPORT_S`), and how long it waited for whom."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.started: float | None = None
        self.whose = ""
        self._said = ("", 0.0)

    @property
    def waited_s(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def tell(self, whose: str, progress: str) -> None:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        self.whose = whose
        line = f"{whose}; {progress}"
        if line != self._said[0] or now - self._said[1] >= REPORT_S:
            log.info("waiting for %s: being built by %s", self.url, line)
            self._said = (line, now)


def _busy(url: str, whose: str, progress: str) -> StoreBusyError:
    return StoreBusyError(f"{url} is being built elsewhere: by {whose}; {progress}. Run again later (its cache is "
                          f"then there), or without --no-wait to wait for it")


def _blocks(w: Wanted) -> int:
    n = len(w.plan)
    return len(range(0, n, w.opts.resolved_block(n)))


def _blocks_done(out: Path) -> int:
    """Block records of the build running into ``out`` (its staging folder), or 0."""
    folder = record_path(staging_path(out), 0).parent
    try:
        return sum(1 for _ in folder.glob("block-*.json"))
    except OSError:
        return 0


def _progress(done: int, total: int) -> str:
    return f"{done} of {total} blocks built ({done / total:.0%})" if total else "starting"


# ---------------------------------------------------------------- a folder store: its build's lock is the claim

def _through_folder(st: Store, w: Wanted, dest: Path | None, wait: bool) -> StoreResult:
    waiting = _Wait(st.url_of(w.name))
    m = st.find(w)
    built = None
    if m is None:
        target = st.location.local_path(w.name)
        opts = replace(w.opts, lock_wait=None)  # the lock is polled here, to say how far the other build is
        while True:
            try:
                built = build(w.plan, target, opts)
                break
            except LockHeldError:
                holder = read_holder(lock_path(target))
                whose = holder.describe() if holder is not None else "a process that does not name itself"
                progress = _progress(_blocks_done(target), _blocks(w))
                if not wait:
                    raise _busy(st.url_of(w.name), whose, progress) from None
                waiting.tell(whose, progress)
                time.sleep(POLL_S)
        st.mark()
        m = st.find(w)
        if built.status == "up to date":  # built by the one this request waited for
            built = None
    pulled = _pull(st, w, dest)
    st.record_use(w.name)
    return _result(st, w, "found" if built is None else "built", m, dest, built, pulled, waiting)


# ---------------------------------------------------------------- an object store: the push marker is the claim

def _through_object_store(st: Store, w: Wanted, dest: Path | None, wait: bool) -> StoreResult:
    loc = st.cache(w.name)
    waiting = _Wait(loc.describe())
    while True:
        claim = PushClaim(loc, PUSH_MARKER)
        claim.watch(MANIFEST_NAME)  # a manifest published after this is seen when claiming (ClaimRaced)
        m = st.find(w)
        if m is not None:
            pulled = _pull(st, w, dest)
            st.record_use(w.name)
            return _result(st, w, "found", m, dest, None, pulled, waiting)
        try:
            found = claim.found()
            # a push's marker taken over keeps what it says for that push's rerun (files to remove...)
            claim.write({**{k: v for k, v in found.items() if k not in ("holder", "token", "renewed")},
                         "building": _building(w, 0)})
            break
        except ClaimRaced:
            continue
        except LockHeldError:
            doc = claim.marker()
            whose, progress = holder_text(doc), _marker_progress(doc)
            if not wait:
                raise _busy(loc.describe(), whose, progress) from None
            waiting.tell(whose, progress)
            time.sleep(POLL_S)
    local = dest if dest is not None else default_out(w.plan.dataset, w.opts.size, w.opts.fit,
                                                      w.opts.storage) / w.plan.split
    try:
        with _reporting(claim, w, local):
            built = build(w.plan, local, w.opts)
    except BaseException:
        claim.abandon()  # a waiter takes it over at once
        raise
    finally:
        claim.release()  # the push below takes the marker over: same process, no longer renewed
    push(local, loc, jobs=8, progress=w.opts.progress)
    st.mark()
    m = st.find(w)
    st.record_use(w.name)
    return _result(st, w, "built", m, local, built, None, waiting)  # its local copy: where it was built


def _building(w: Wanted, done: int) -> dict[str, Any]:
    return {"what": w.what, "blocks_done": done, "blocks": _blocks(w), "samples": len(w.plan)}


def _marker_progress(doc: dict[str, Any]) -> str:
    b = doc.get("building")
    if isinstance(b, dict) and isinstance(b.get("blocks_done"), int) and isinstance(b.get("blocks"), int):
        return _progress(b["blocks_done"], b["blocks"])
    return "publishing: its files are being uploaded, the manifest last" if doc else "starting"


@contextlib.contextmanager
def _reporting(claim: PushClaim, w: Wanted, out: Path) -> Iterator[None]:
    """While the build runs: its progress in the claim's marker, at each heartbeat (the marker is renewed then
    anyway), so a waiter can say how far it is."""
    stop = threading.Event()

    def run() -> None:
        said = 0
        while not stop.wait(claim.heartbeat_s):
            done = _blocks_done(out)
            if done != said:
                try:
                    claim.write({"building": _building(w, done)})
                    said = done
                except Exception as e:  # the claim's own checks decide whether the build may publish
                    log.info("could not note the build's progress in its claim: %s", e)

    thread = threading.Thread(target=run, name="cachebuild-store-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=max(5.0, math.ceil(claim.heartbeat_s)))


# ---------------------------------------------------------------- a read-only store: build here, say so

def _from_read_only(st: Store, w: Wanted, dest: Path | None) -> StoreResult:
    waiting = _Wait(st.url_of(w.name))
    m = st.find(w)
    if m is not None:
        return _result(st, w, "found", m, dest, None, _pull(st, w, dest), waiting)
    local = dest if dest is not None else default_out(w.plan.dataset, w.opts.size, w.opts.fit,
                                                      w.opts.storage) / w.plan.split
    built = build(w.plan, local, w.opts)
    log.warning("%s does not hold %s of this recipe and cannot be written (http(s)): built it here, at %s",
                st.url, w.what, local)
    return _result(st, w, "built here", None, local, built, None, waiting)
