"""Which cache is this? The fingerprint a job can pin: the manifest's build key (sha256 of the
source digest and every build parameter that shapes the bytes), shown by ``cachebuild info`` and ``ls`` as
its first 12 hex digits. A rebuild from a changed source or with other parameters gets another one, while
the same build repeated (or pulled elsewhere) keeps it, with the same bytes: builds are deterministic. The
key names the source by path, size and mtime, though, and not the decoder's version, so one key can hold
other bytes (a file rewritten keeping its size and time, a build with another OpenCV). What must never
mix two caches' bytes (local copies, the share commands' "same cache") compares ``Manifest.content_id``."""

from __future__ import annotations

import re

from cachebuild.errors import FingerprintMismatchError, OptionError
from cachebuild.format.manifest import Manifest

__all__ = ["SHOWN_DIGITS", "check_fingerprint", "different_cache", "fingerprint"]

SHOWN_DIGITS = 12
_PREFIX = re.compile(r"[0-9a-f]{8,64}")


def fingerprint(manifest: Manifest) -> str:
    """The fingerprint as shown: source digest and every build parameter hex digits."""
    return manifest.build_key[:SHOWN_DIGITS]


def different_cache(old: Manifest | None, new: Manifest, whose: str) -> str:
    """What a destination holds instead of ``new``, for a refusal: "a different cache (fingerprint ...)"."""
    if old is None:
        return "a different cache (its manifest is unreadable)"
    if old.build_key == new.build_key:
        return (f"a different cache with the same fingerprint {fingerprint(new)} (same source files by name, size "
                f"and time, same parameters) but other contents: a source file changed keeping its size and time, "
                f"or another OpenCV or decoder built one of them")
    return f"a different cache (fingerprint {fingerprint(old)}, {whose}'s is {fingerprint(new)})"


def check_fingerprint(manifest: Manifest, expected: str, where: str) -> None:
    """Raise unless the cache's build key starts with ``expected`` (8 to 64 hex digits)."""
    want = str(expected).strip().lower()
    if not _PREFIX.fullmatch(want):
        raise OptionError(f"expect_fingerprint must be 8 to 64 hex digits (a prefix of the fingerprint `cachebuild "
                         f"info` or `cachebuild ls` shows), got {expected!r}")
    key = manifest.build_key.lower()
    if not key.startswith(want):
        shown = key[: max(len(want), SHOWN_DIGITS)] or "(none)"
        raise FingerprintMismatchError(
            f"{where} has fingerprint {shown}, expected {want}: the cache was rebuilt (other source files or "
            f"build parameters) or is another cache; check the path, or expect the new fingerprint")
