"""The exceptions cachebuild raises, each co-inheriting the built-in a caller would catch."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["CacheBuildError", "CacheChangedError", "CacheCorruptError", "CacheExistsError", "CacheNotFoundError",
           "DecodeError", "FingerprintMismatchError", "LockHeldError", "MissingExtraError", "NoSuchBucketError",
           "OptionError", "OutputError", "RemoteError", "RemoteNotFoundError", "RemoteUnavailableError", "SourceError",
           "TransferError", "UnsupportedFormatError", "require_extra"]


class CacheBuildError(Exception):
    """Base class of every error raised on purpose by cachebuild."""


class CacheNotFoundError(CacheBuildError, FileNotFoundError):
    """A path that should hold a cache does not (no manifest.json)."""


class UnsupportedFormatError(CacheBuildError, ValueError):
    """A manifest of another format or a format version this release cannot read."""


class CacheCorruptError(CacheBuildError, ValueError):
    """A cache whose files disagree with its manifest (missing, truncated, wrong shape, bad checksum)."""


class CacheExistsError(CacheBuildError, FileExistsError):
    """A different complete cache is already at the output path and --force was not given."""


class CacheChangedError(CacheBuildError, RuntimeError):
    """The cache an open reader was serving was replaced or changed on disk; it stops rather than mix caches."""


class RemoteError(CacheBuildError, OSError):
    """A URL that cannot be read: not found, access denied, unreachable, or failing after retries.
    The message names the URL without credentials."""


class RemoteNotFoundError(RemoteError):
    """A URL that answers "not found" (404, or the store's own no-such-key)."""


class NoSuchBucketError(RemoteNotFoundError):
    """The bucket (or container) a URL names does not exist: no file under it can be read or written, so a
    command stops at once instead of treating it as an empty prefix."""


class RemoteUnavailableError(RemoteError):
    """A URL whose requests kept failing in a transient way (5xx, 429, dropped or stalled connections) past
    the retries or the time budget of the call. ``url``, ``status`` (the last HTTP status, or None) and
    ``attempts`` say which, how it last answered and how often it was asked."""

    def __init__(self, message: str, url: str = "", status: int | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.url, self.status, self.attempts = url, status, attempts

    def __reduce__(self):  # keep the fields across process boundaries (DataLoader workers)
        return (type(self), (str(self), self.url, self.status, self.attempts))


class LockHeldError(CacheBuildError, BlockingIOError):
    """Another process builds or pulls the same output; the message names it (host, pid, user, since, command)."""


class FingerprintMismatchError(CacheBuildError, ValueError):
    """A cache whose fingerprint (build key) is not the one the caller expected: rebuilt, or another cache."""


class TransferError(CacheBuildError, OSError):
    """A pull or push that could not move every file intact; the message names the files and why.
    What arrived whole and verified is kept, so the same command resumes."""


class OptionError(CacheBuildError, ValueError):
    """A build or training option with a value cachebuild does not accept (named in the message)."""


class OutputError(CacheBuildError, OSError):
    """The output location cannot take the build: no space left, read-only, no permission, a file where
    a folder must be. The message names the path and what to do; finished blocks are kept for a resume."""


class SourceError(CacheBuildError, ValueError):
    """A source dataset that is missing, empty or not in a layout cachebuild knows."""


class DecodeError(CacheBuildError, ValueError):
    """One source file could not be turned into an image; ``path`` and ``reason`` say which and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):  # keep both fields across process boundaries (joblib workers)
        return (type(self), (self.path, self.reason))


class MissingExtraError(CacheBuildError, ImportError):
    """A feature whose optional package is not installed; the message names the extra that installs it."""


def require_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """``module`` imported, or a :class:`MissingExtraError` saying that ``purpose`` needs it and how to install it
    (``pip install 'cachebuild[EXTRA]'``). Optional packages are imported only where a feature uses them."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{purpose} needs the optional package {module!r} ({e}); install it with "
                                f"pip install 'cachebuild[{extra}]'") from None
