"""Remote reads tied to the files a reader opened: no pixel of a replaced cache is ever served.

A local cache is pinned by folder identity (``LocalLocation.pinned``). An object store or HTTP server has no
folder to keep: ``push --force`` takes the old cache down and uploads the new one under the same names, and a
job still reading would get the new bytes at its old offsets, silently. Instead every read of a pinned remote
cache carries the file's entity tag in an ``If-Match`` precondition (HTTP; S3's ``GetObject`` ``IfMatch``), and a
server holding another version answers 412: :class:`~cachebuild.errors.CacheChangedError`. A file's tag is taken
on its first read and vouched for by the *anchor* (the manifest), which ``push`` removes before it changes any
file and writes last. On a bucket with versioning each file's ``VersionId`` is pinned too and asked for, so a
job reads the old cache to its end (a file it had not touched before the replacement still fails, by name).

Where it applies: ``http(s)://`` servers with strong ETags that honour ``If-Match``, and ``s3://`` through s3fs (a
botocore event hook adds ``IfMatch`` and ``VersionId``). Other protocols, and servers without strong ETags, read
unpinned.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["PINNABLE_PROTOCOLS", "Pins", "etag_of", "install_s3_hook", "precondition_failed", "version_of"]

PINNABLE_PROTOCOLS = frozenset({"http", "https", "s3", "s3a"})


def etag_of(info: dict[str, Any]) -> str | None:
    """The strong entity tag in an fsspec ``info`` (HTTP's ``ETag`` header, S3's ``ETag``), or None. A weak
    tag (``W/"..."``) never satisfies ``If-Match`` (RFC 9110 compares strongly), so it counts as none."""
    tag = info.get("ETag") or info.get("etag")
    if not isinstance(tag, str) or not tag or tag.startswith("W/"):
        return None
    return tag


def version_of(info: dict[str, Any]) -> str | None:
    """The object version in an s3fs ``info`` (None: a bucket without versioning, or another store)."""
    version = info.get("VersionId")
    return version if isinstance(version, str) and version and version != "null" else None


def precondition_failed(exc: BaseException) -> bool:
    """A 412 answer: the file no longer has the tag this reader pinned. aiohttp raises it with ``status``;
    s3fs turns botocore's ``PreconditionFailed`` into an ``OSError`` whose cause holds the response."""
    if getattr(exc, "status", None) == 412:
        return True
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            if response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                return True
            if response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                return True
    return False


class Pins:
    """Path (as the filesystem names it, without protocol) -> pinned tag, shared by a location and its
    children, copied into DataLoader workers. ``None`` marks a file the server gives no strong tag."""

    def __init__(self, anchor_url: str) -> None:
        self.anchor_url = anchor_url
        self.anchor_tag = ""
        self.anchor_key = ""
        self.tags: dict[str, str | None] = {}
        self.versions: dict[str, str] = {}  # path -> VersionId, where the store keeps versions
        self._lock = threading.Lock()

    def set_anchor(self, key: str, tag: str, version: str | None = None) -> None:
        with self._lock:
            self.anchor_tag = tag
            self.anchor_key = key
            self.tags[key] = tag
            if version is not None:
                self.versions[key] = version

    def __getstate__(self) -> dict[str, Any]:
        return {"anchor_url": self.anchor_url, "anchor_tag": self.anchor_tag, "anchor_key": self.anchor_key,
                "tags": dict(self.tags), "versions": dict(self.versions)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def missing(self, paths: Sequence[str]) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(p for p in paths if p not in self.tags))

    def add(self, tags: dict[str, str | None], versions: dict[str, str | None] | None = None) -> None:
        with self._lock:
            for path, tag in tags.items():
                if path in self.tags:
                    continue  # a tag once pinned is never replaced (nor its version)
                self.tags[path] = tag
                version = (versions or {}).get(path)
                if version is not None and tag is not None:
                    self.versions[path] = version

    def tag(self, path: str) -> str | None:
        return self.tags.get(path)

    def version(self, path: str) -> str | None:
        return self.versions.get(path)


def install_s3_hook(session: Any, pins: Pins) -> None:
    """Make every ``GetObject`` that the clients of ``session`` send for a pinned key carry ``IfMatch``, and
    ``VersionId`` where one was pinned (botocore's documented event system: ``before-parameter-build``)."""

    def add_if_match(params: dict[str, Any], **_: Any) -> None:
        key = f"{params.get('Bucket')}/{params.get('Key')}"
        tag = pins.tag(key)
        if tag is not None and "IfMatch" not in params:
            params["IfMatch"] = tag
            version = pins.version(key)
            if version is not None and "VersionId" not in params:
                params["VersionId"] = version

    def add_version(params: dict[str, Any], **_: Any) -> None:
        # s3fs sizes a whole-object read with a HEAD first: of the pinned version, or a replaced file would
        # look missing. Never the anchor's: its check must see what is there now.
        key = f"{params.get('Bucket')}/{params.get('Key')}"
        version = pins.version(key)
        if version is not None and key != pins.anchor_key and "VersionId" not in params:
            params["VersionId"] = version

    session.register("before-parameter-build.s3.GetObject", add_if_match)
    session.register("before-parameter-build.s3.HeadObject", add_version)
