"""Sources: turn a dataset on disk into a :class:`Plan` (what to build, in which order, with which labels).

One :class:`~cachebuild.sources.kind.SourceKind` per kind of source, all in one registry
(:mod:`cachebuild.sources.registry`: plan, recipe, re-plan; the build commands are generated from it)."""

from cachebuild.sources.plan import FileReader, Plan, SampleReader, digest_files

__all__ = ["FileReader", "Plan", "SampleReader", "digest_files"]
