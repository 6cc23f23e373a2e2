"""File names inside a cache: what a manifest may name, and how a URL is shown without its secrets."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from cachebuild.errors import CacheCorruptError

__all__ = ["check_name", "is_url", "is_web_url", "redact"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(where: str) -> bool:
    """True for ``scheme://...`` (s3, gs, http(s), file, memory...)."""
    return bool(_SCHEME.match(where))


def is_web_url(where: str) -> bool:
    """True for ``http://`` and ``https://`` URLs, whose index pages link names percent-encoded."""
    return is_url(where) and where.split("://", 1)[0].lower() in ("http", "https")


def check_name(name: object, what: str = "file name") -> str:
    """A name a manifest gives for a file of the cache: plain, relative, inside the cache.

    Refused: absolute paths, ``..`` or ``.`` segments, empty segments, backslashes, URLs, control
    characters. A backend only ever opens ``<cache>/<name>`` for names that pass, so a crafted manifest
    cannot make a reader open ``/etc/passwd``, a sibling folder or another host.
    """
    if not isinstance(name, str) or not name:
        raise CacheCorruptError(f"manifest {what} must be a non-empty string, got {name!r}")
    bad = (
        name.startswith("/")
        or "\\" in name
        or is_url(name)
        or ":" in name.split("/", 1)[0]  # drive letters, "c:foo", scheme-like prefixes
        or any(ord(ch) < 32 for ch in name)
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise CacheCorruptError(
            f"manifest {what} {name!r} is not a plain relative name inside the cache (no '..', no absolute "
            f"path, no URL); the manifest is damaged or was crafted: rebuild or re-fetch the cache"
        )
    return name


def redact(url: str) -> str:
    """``url`` without user, password and query string (presigned URLs carry their credentials there)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
