"""``cachebuild gc STORE``: keep a team store within a byte budget and/or an age, removing whole caches, least
recently used first, never one in use. A dry run unless ``yes``.

The caches are the store's own (complete caches directly under it); each one's last use is the latest of its
record of use (``resolve``, a ``--store`` build that found it, a reader giving up its lease) and of its leases'
renewals, or, with neither, its build time. A cache is in use, and kept, while

- a reader holds a live lease on it (``.store/leases/<cache>/``: jobs reading it from a URL, ``cachebuild serve``
  for its HTTP readers), renewed within ``CACHEBUILD_LEASE_S``;
- in a folder store, a process holds it open (its readers' shared lock on ``manifest.json``: a job reading
  the folder, a pull from it), or its build lock (a build or pull of it);
- in an object store, a push or a build holds its claim (``push-in-progress.json``).

A cache is taken down as a replaced one is: in a folder store it is renamed aside while no reader holds it,
then deleted (only if it holds nothing but the files its manifest names); in an object store its manifest goes
first (new readers see no cache), then the files its table lists. A reader whose lease had run out finds its
files gone: an error there, never another cache's bytes (its reads are pinned: ``storage.remote.pinning``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

from cachebuild.builder.destination import check_replaceable
from cachebuild.builder.locks import exclusive_lock, lock_path
from cachebuild.errors import CacheBuildError, LockHeldError, OptionError, RemoteError
from cachebuild.format.manifest import MANIFEST_NAME
from cachebuild.share.contents import PUSH_MARKER, read_contents
from cachebuild.share.listing import cache_bytes, find_caches
from cachebuild.share.store import Store
from cachebuild.storage.cache import parse_manifest
from cachebuild.storage.locations import is_locked, set_aside
from cachebuild.storage.remote.lease import leases_folder, used_name, utc_now

__all__ = ["Entry", "GcReport", "collect", "describe", "parse_age", "parse_bytes"]

log = logging.getLogger("cachebuild")

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_bytes(text: str) -> int:
    """``500G``, ``1.5TB``, ``200GiB``, ``1000000``: a number of bytes (k, M, G, T: powers of 1000; Ki, Mi...:
    of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?)?b?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"{text!r} is not a size: write e.g. 500G, 1.5T or 200GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``45m``, ``90s``, ``2w`` (a bare number: seconds): an age in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"{text!r} is not an age: write e.g. 30d, 12h or 90m")
    return float(m.group(1)) * _AGES[(m.group(2) or "s").lower()]


@dataclass(frozen=True)
class Entry:
    """One cache of the store as gc sees it; ``held_by`` says what uses it ("": nothing)."""

    name: str
    bytes: int
    last_used: _dt.datetime
    held_by: str = ""


@dataclass
class GcReport:
    """What gc found and did: every cache, those removed (or, in a dry run, that would be), those kept in use
    that it would otherwise have removed, and the store's bytes before and after."""

    entries: list[Entry]
    removed: list[Entry] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name -> why it was not removed
    dry_run: bool = True
    max_bytes: int | None = None
    before: int = 0
    after: int = 0

    @property
    def over_budget(self) -> bool:
        return self.max_bytes is not None and self.after > self.max_bytes


def _ago(t: _dt.datetime, now: _dt.datetime) -> str:
    s = max(0.0, (now - t).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit} ago"
    return f"{s:.0f} s ago"


def _size(n: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def describe(report: GcReport) -> list[str]:
    """The report as lines: one per cache removed (or to be) and per cache kept in use, then the totals."""
    now = utc_now()
    verb = "would remove" if report.dry_run else "removed"
    lines = [f"{verb} {e.name}: {_size(e.bytes)}, last used {_ago(e.last_used, now)}" for e in report.removed]
    lines += [f"kept {name}: {why}" for name, why in report.kept.items()]
    budget = f" (budget {_size(report.max_bytes)})" if report.max_bytes is not None else ""
    left = len(report.entries) - len(report.removed)
    lines.append(f"{len(report.entries)} caches, {_size(report.before)}; after: {left}, {_size(report.after)}{budget}"
                 + ("; a dry run: nothing was removed (--yes removes)" if report.dry_run else ""))
    if report.max_bytes is not None and report.over_budget:
        lines.append(f"still over the budget by {_size(report.after - report.max_bytes)}: the caches left are in use")
    return lines


# ---------------------------------------------------------------- what the store holds and what uses it

def _held_here(st: Store, name: str) -> str:
    """What uses the cache ``name`` besides leases: a reader or a writer of a folder store's cache, a push (or a
    build) of an object store's."""
    if st.is_folder:
        folder = st.location.local_path(name)
        if is_locked(folder / MANIFEST_NAME):
            return "a process holds it open (a job reading the folder, or a pull from it)"
        lock = lock_path(folder)
        if lock.exists() and is_locked(lock):
            return "a build or a pull of it is running"
        return ""
    try:
        if st.cache(name).exists(PUSH_MARKER):
            return "a push (or a build) is writing it"
    except (OSError, RemoteError) as e:
        return f"cannot tell whether a push is writing it ({e})"
    return ""


def _held_by(st: Store, name: str) -> str:
    leases = st.usage(name).leases
    if leases:
        more = f" (and {len(leases) - 1} more)" if len(leases) > 1 else ""
        return f"in use: {leases[0].describe()}{more}"
    here = _held_here(st, name)
    return f"in use: {here}" if here else ""


def survey(st: Store) -> list[Entry]:
    """Every complete cache directly under the store, its size, its last use and what holds it."""
    entries = []
    for found in find_caches(st.location, max_depth=1):
        if found.state != "complete" or not found.path:
            continue  # unfinished builds resume; replaced folders go with the next build of their name
        loc = st.cache(found.path)
        try:
            m = parse_manifest(loc.read_bytes(MANIFEST_NAME), loc.describe(MANIFEST_NAME))
        except (CacheBuildError, OSError) as e:
            log.warning("%s: not considered (%s)", loc.describe(), str(e).splitlines()[0])
            continue
        usage = st.usage(found.path)
        created = _dt.datetime.fromisoformat(m.created) if m.created else utc_now()
        if created.tzinfo is None:
            created = created.replace(tzinfo=_dt.timezone.utc)
        last = usage.last_used if usage.last_used is not None else created
        entries.append(Entry(found.path, cache_bytes(loc, m) or 0, last, _held_by(st, found.path)))
    return entries


def choose(entries: list[Entry], max_bytes: int | None, older_than_s: float | None,
           now: _dt.datetime) -> tuple[list[Entry], dict[str, str]]:
    """(the caches to remove, least recently used first; those in use that would otherwise go, and why)."""
    total = sum(e.bytes for e in entries)
    remove: list[Entry] = []
    kept: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: (e.last_used, e.name)):
        old = older_than_s is not None and (now - e.last_used).total_seconds() > older_than_s
        over = max_bytes is not None and total > max_bytes
        if not (old or over):
            continue
        if e.held_by:
            kept[e.name] = e.held_by
            continue
        remove.append(e)
        total -= e.bytes
    return remove, kept


# ---------------------------------------------------------------- taking a cache down

def _remove_folder_cache(st: Store, name: str) -> None:
    """Rename the folder store's cache ``name`` aside and delete it, holding its build lock (no build or pull
    of it meanwhile) and an exclusive lock on its manifest (no reader opens it meanwhile)."""
    folder = st.location.local_path(name)
    with exclusive_lock(folder, action="building or removing"):
        fd = os.open(folder / MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeldError(f"{folder}: a process opened it just now") from None
            check_replaceable(folder, None, other="to keep it")
            aside = set_aside(folder)
        finally:
            os.close(fd)
    shutil.rmtree(aside)


def _remove_remote_cache(st: Store, name: str) -> None:
    """The object store's cache ``name``: its manifest first (from then on a reader finds no cache), then the
    files its file table lists; anything else at its prefix is left."""
    loc = st.cache(name)
    contents = read_contents(loc)
    loc.remove(MANIFEST_NAME)
    names = [i.name for i in contents.items]
    if contents.table_name is not None:
        names.append(contents.table_name)
    loc.remove(*names)
    try:
        left = loc.list_files()
    except (OSError, RemoteError):
        left = {}
    if left:
        log.warning("%s: left %d file(s) that its manifest does not name", loc.describe(), len(left))


def _take_down(st: Store, e: Entry) -> str:
    """Remove the cache of ``e`` unless something took it up since the survey; "" or why it was kept."""
    held = _held_by(st, e.name)
    if held:
        return held
    try:
        if st.is_folder:
            _remove_folder_cache(st, e.name)
        else:
            _remove_remote_cache(st, e.name)
    except (LockHeldError, CacheBuildError, OSError) as err:
        return f"not removed: {str(err).splitlines()[0]}"
    for record in [used_name(e.name), *st.lease_files(e.name)]:
        with contextlib.suppress(OSError, RemoteError):  # a record left behind names no cache: harmless
            st.location.remove(record)
    if st.is_folder:
        with contextlib.suppress(OSError):  # emptied (a prefix of an object store vanishes with its last file)
            st.location.local_path(leases_folder(e.name)).rmdir()
    return ""


def collect(store: str | os.PathLike[str], *, max_bytes: int | None = None, older_than_s: float | None = None,
            yes: bool = False, storage_options: dict[str, Any] | None = None) -> GcReport:
    """Choose the caches of ``store`` to remove (see the module docstring) and, with ``yes``, remove them."""
    if max_bytes is None and older_than_s is None:
        raise OptionError("say what to keep: --max-bytes SIZE and/or --older-than AGE")
    st = Store(store, storage_options)
    if st.read_only:
        raise OptionError(f"{st.url} is served over http(s), read-only: run gc where the store is written, on the "
                          f"folder `cachebuild serve` serves")
    if not st.is_store():
        raise OptionError(f"{st.url} is not a cachebuild store (no .store/store.json): gc removes caches only from a "
                          f"store, whose URL readers hold leases; a --store build makes a folder or prefix a store")
    entries = survey(st)
    now = utc_now()
    remove, kept = choose(entries, max_bytes, older_than_s, now)
    report = GcReport(entries, dry_run=not yes, max_bytes=max_bytes, kept=kept,
                      before=sum(e.bytes for e in entries))
    for e in remove:
        why = _take_down(st, e) if yes else ""
        if why:
            report.kept[e.name] = why
        else:
            report.removed.append(e)
    report.after = report.before - sum(e.bytes for e in report.removed)
    return report
