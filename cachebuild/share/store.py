"""The team's store: caches kept at the place their build key names, so that whoever asks for a recipe gets the
one cache the team built (``--store`` on the build commands, ``cachebuild resolve``, ``cachebuild gc``).

A store is a folder (local or NFS), an object-store prefix (``s3://``...) or the URL of a ``cachebuild serve``
server (``http(s)://``, read-only), holding::

    <dataset>-<split>-<size>-<key16>/   a cache, at the name its build key gives it (cache_name)
    <name>.lock, <name>.partial/        in a folder store: the build of <name> running there, its lock and blocks
    <name>/push-in-progress.json        in an object store: the claim of the build or push of <name> (heartbeats)
    .store/store.json                   the mark: a store (its readers of URLs then hold leases)
    .store/leases/<name>/<token>.json   a reader's lease on <name> (cachebuild.storage.remote.lease), or a server's
    .store/used/<name>.json             the last use of <name>

The build key (:func:`~cachebuild.builder.options.build_key`: the source digest and every parameter that shapes
the bytes) comes from the plan of the source: a listing and a ``stat`` per file, nothing decoded. A cache of the
store is used only when its manifest holds that whole key and it passes the quick check (every file there at its
size, every header right); a pull then checks every file's checksum. What builds and publishes a missing cache:
:mod:`cachebuild.share.store_build`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachebuild.builder.options import BuildOptions, build_key
from cachebuild.builder.pipeline import plan_build
from cachebuild.errors import CacheCorruptError, CacheExistsError, CacheNotFoundError, OptionError, RemoteError
from cachebuild.format.manifest import MANIFEST_NAME, Manifest
from cachebuild.share.contents import read_manifest_bytes
from cachebuild.sources.plan import Plan
from cachebuild.storage import Location, open_location
from cachebuild.storage.cache import parse_manifest, quick_check
from cachebuild.storage.locations import is_web_url
from cachebuild.storage.remote.lease import (
    STORE_MARK,
    LeaseRecord,
    leases_folder,
    used_name,
    utc_now,
)

__all__ = ["Resolved", "Store", "Usage", "Wanted", "add_usage", "cache_name", "plan_wanted", "resolve", "resolve_all"]

log = logging.getLogger("cachebuild")

KEY_DIGITS = 16  # of the build key in a cache's name (64 bits); the manifest holds the whole key, checked on use


def _plain(text: str) -> str:
    """``text`` as a part of a name: letters, digits, ``_`` and ``.`` (no ``-``, which separates the parts)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("._")[:40] or "cache"


def cache_name(plan: Plan, opts: BuildOptions, key: str) -> str:
    """Where a store keeps the cache of build key ``key``: ``<dataset>-<split>-<size>-<first 16 digits>``."""
    return f"{_plain(plan.dataset)}-{_plain(plan.split)}-{opts.size}-{key[:KEY_DIGITS]}"


@dataclass(frozen=True)
class Wanted:
    """One cache asked for: a split's plan, the build's options, the build key and the cache's name in a store."""

    plan: Plan
    opts: BuildOptions
    key: str
    name: str

    @property
    def what(self) -> str:
        return f"{self.plan.dataset}/{self.plan.split}"


def plan_wanted(kind: str, src: str | os.PathLike[str], *, size: int | None = None,
                classes: list[str] | None = None, **options: Any) -> list[Wanted]:
    """The caches ``cachebuild KIND SRC`` with these options makes (one per split), each with its key and name:
    the source planned as the build plans it, nothing decoded."""
    plans, opts = plan_build(kind, src, size=size, classes=classes, **options)
    out = []
    for plan in plans:
        key, _ = build_key(plan, opts)
        out.append(Wanted(plan, opts, key, cache_name(plan, opts, key)))
    return out


@dataclass(frozen=True)
class Usage:
    """What a store records of one cache's use: its last use (None: none recorded) and the live leases on it."""

    last_used: Any = None  # datetime.datetime | None
    leases: list[LeaseRecord] = field(default_factory=list)


class Store:
    """A store at ``where`` (a folder, or a URL; ``storage_options`` as fsspec takes them)."""

    def __init__(self, where: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        text = os.fspath(where)
        self.location: Location = open_location(text, storage_options)
        if self.location.is_local:  # the URL printed for a folder store: a path any host mounting it can use
            self.location = open_location(Path(self.location.local_path()).absolute())
        self.storage_options = storage_options

    @property
    def url(self) -> str:
        return self.location.describe()

    @property
    def is_folder(self) -> bool:
        return self.location.is_local

    @property
    def read_only(self) -> bool:
        """An http(s) store: a ``cachebuild serve`` server, which nobody writes through."""
        return is_web_url(self.location.url)

    def cache(self, name: str) -> Location:
        return self.location.child(name)

    def url_of(self, name: str) -> str:
        return self.cache(name).describe()

    def find(self, wanted: Wanted) -> Manifest | None:
        """The manifest of the store's complete cache of ``wanted`` (None: there is none). One of another key at
        its name, or one that fails the quick check, is an error, never used."""
        loc = self.cache(wanted.name)
        raw = read_manifest_bytes(loc)
        if raw is None:
            return None
        m = parse_manifest(raw, loc.describe(MANIFEST_NAME))
        if m.build_key != wanted.key:
            raise CacheExistsError(f"{loc.describe()} holds another cache (build key {m.build_key[:12]}...; "
                                   f"{wanted.what} of this recipe has {wanted.key[:12]}...): it was put there by hand; "
                                   f"move it away")
        report = quick_check(loc)
        if report.problems:
            shown = "; ".join(report.problems[:3]) + (f" (and {len(report.problems) - 3} more)"
                                                      if len(report.problems) > 3 else "")
            raise CacheCorruptError(f"the store's cache {loc.describe()} fails its check: {shown}; it is not used: "
                                    f"remove it (`cachebuild gc` does not remove a damaged cache) and build again")
        return m

    # ---------------------------------------------------------------- the store's own records
    def is_store(self) -> bool:
        """Whether the store's mark is there (a folder of caches without it is no store: ``gc`` refuses it).
        One range read, not ``exists`` (s3fs lists a missing object's prefix to tell a folder from nothing)."""
        try:
            self.location.read_heads([STORE_MARK], 16)
        except (OSError, RemoteError):
            return False
        return True

    def mark(self) -> None:
        """Make the folder or prefix a store (its URL readers then hold leases): written once, by a publisher."""
        if not self.is_store():
            self.location.write_bytes(STORE_MARK, b'{"format": "cachebuild-store", "version": 1}\n')

    def record_use(self, name: str) -> None:
        """Record a use of the cache ``name`` now (best effort: a store this process cannot write keeps its
        older record)."""
        if self.read_only:
            return  # the server records what it serves
        try:
            self.location.write_bytes(used_name(name), LeaseRecord.now(0, "use").to_bytes())
        except (OSError, RemoteError) as e:
            log.info("could not record the use of %s: %s", self.url_of(name), e)

    def _record(self, name: str) -> LeaseRecord | None:
        try:
            return LeaseRecord.parse(self.location.read_bytes(name))
        except (OSError, RemoteError):
            return None

    def lease_files(self, name: str) -> dict[str, LeaseRecord | None]:
        """Every lease file on the cache ``name``: its name in the store -> its record (None: unreadable)."""
        folder = leases_folder(name)
        try:
            entries = self.location.list_dir(folder)
        except (OSError, RemoteError):
            return {}  # no lease was ever taken on it
        files = [f"{folder}/{n}" for n, is_dir, _ in entries if not is_dir and n.endswith(".json")]
        return {f: self._record(f) for f in files}

    def usage(self, name: str) -> Usage:
        """The cache ``name``'s last use (its record, or the latest renewal of a lease on it) and live leases."""
        now = utc_now()
        used = self._record(used_name(name))
        times = [used.when()] if used is not None else []
        live = []
        for record in self.lease_files(name).values():
            if record is None:
                continue
            times.append(min(record.when(), now))
            if record.live(now):
                live.append(record)
        return Usage(max(times) if times else None, live)


def add_usage(where: str | os.PathLike[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ls`` rows of the folder ``where`` with each store cache's last use (``last_used``, ISO 8601) and live
    leases (``readers``), when ``where`` is a store (its caches: the rows directly under it)."""
    st = Store(where)
    if not rows or not st.is_store():
        return rows
    for row in rows:
        if row.get("state") == "complete" and "/" not in row["path"] and row["path"] != ".":
            usage = st.usage(row["path"])
            row["last_used"] = usage.last_used.isoformat(timespec="seconds") if usage.last_used else None
            row["readers"] = len(usage.leases)
    return rows


# ---------------------------------------------------------------- resolve: a recipe to the URL of its cache

@dataclass(frozen=True)
class Resolved:
    """A recipe's cache in a store: its split, key, URL, and whether the store holds it."""

    dataset: str
    split: str
    key: str
    url: str
    found: bool


def resolve_all(store: str | os.PathLike[str], kind: str, src: str | os.PathLike[str], *, size: int | None = None,
                classes: list[str] | None = None, storage_options: dict[str, Any] | None = None,
                **options: Any) -> list[Resolved]:
    """Each cache (one per split) that ``cachebuild KIND SRC`` with these options makes, looked up in ``store``;
    the source is planned (its files listed and stat'ed), nothing decoded. A found cache's use is recorded."""
    st = Store(store, storage_options)
    out = []
    for w in plan_wanted(kind, src, size=size, classes=classes, **options):
        found = st.find(w) is not None
        if found:
            st.record_use(w.name)
        out.append(Resolved(w.plan.dataset, w.plan.split, w.key, st.url_of(w.name), found))
    return out


def resolve(store: str | os.PathLike[str], kind: str, src: str | os.PathLike[str], *, size: int | None = None,
            classes: list[str] | None = None, storage_options: dict[str, Any] | None = None,
            **options: Any) -> str:
    """The URL (or, in a folder store, the path) of the store's cache of this recipe: one split (pass
    ``split=``). Raises :class:`~cachebuild.errors.CacheNotFoundError` when the store does not hold it."""
    got = resolve_all(store, kind, src, size=size, classes=classes, storage_options=storage_options, **options)
    if len(got) != 1:
        splits = ", ".join(r.split for r in got)
        raise OptionError(f"{src} plans {len(got)} caches ({splits}); resolve one: pass split= (e.g. "
                          f"split={got[0].split!r})")
    r = got[0]
    if not r.found:
        raise CacheNotFoundError(f"{Store(store, storage_options).url} holds no cache of this recipe of "
                                 f"{r.dataset}/{r.split} (build key {r.key[:12]}...; it would be {r.url}): build it "
                                 f"with `cachebuild {kind} {src} --store {store}` and the same options")
    return r.url
