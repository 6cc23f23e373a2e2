"""Merged into :mod:`cachebuild.options`; this module stays only until the build commands and the loaders
import :func:`~cachebuild.options.field_options` from there (then it goes, with its line in pyproject's
layers contract)."""

from cachebuild.options import field_options

__all__ = ["field_options"]
