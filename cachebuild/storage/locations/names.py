"""URLs: which strings are one, and how one is shown without its secrets. What a manifest may name
(``check_name``) is the format's rule, re-exported here."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from cachebuild.format.manifest import URL_SCHEME, check_name

__all__ = ["check_name", "is_url", "is_web_url", "redact"]


def is_url(where: str) -> bool:
    """True for ``scheme://...`` (s3, gs, http(s), file, memory...)."""
    return bool(URL_SCHEME.match(where))


def is_web_url(where: str) -> bool:
    """True for ``http://`` and ``https://`` URLs, whose index pages link names percent-encoded."""
    return is_url(where) and where.split("://", 1)[0].lower() in ("http", "https")


def redact(url: str) -> str:
    """``url`` without user, password and query string (presigned URLs carry their credentials there)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
