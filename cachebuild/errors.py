"""The exceptions cachebuild raises, each co-inheriting the built-in a caller would catch."""

from __future__ import annotations

__all__ = [
    "CacheBuildError",
    "CacheCorruptError",
    "CacheExistsError",
    "CacheNotFoundError",
    "DecodeError",
    "OptionError",
    "OutputError",
    "SourceError",
    "UnsupportedFormatError",
]


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
