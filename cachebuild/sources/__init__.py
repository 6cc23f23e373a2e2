"""Sources: turn a dataset on disk into a :class:`Plan` (what to build, in which order, with which labels)."""

from cachebuild.sources.plan import FileReader, Plan, SampleReader, fingerprint_files

__all__ = ["FileReader", "Plan", "SampleReader", "fingerprint_files"]
