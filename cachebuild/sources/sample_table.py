"""Per-sample columns of a plan (which shard, where in it) that a reader looks samples up in, sliced per block.

A reader of shard formats needs a row of numbers per sample (tar: shard, offset, size; Parquet: file, row
group, row). The whole table of a 1.28M-sample plan is tens of MB: a block's task ships only its own
slice (:meth:`SampleTable.slice`, through the reader's ``for_block``), a few KB. Samples found bad while
planning (no label, no image, a cut shard) keep their slot in the plan and carry their reason here; the
reader raises it as a :class:`~cachebuild.errors.DecodeError`, so the build lists them like any bad file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import numpy as np

from cachebuild.errors import DecodeError

__all__ = ["SampleTable"]

T = TypeVar("T")


@dataclass(frozen=True)
class SampleTable:
    start: int  # plan index of row 0
    columns: Mapping[str, np.ndarray]  # equal lengths
    problems: Mapping[int, str] = field(default_factory=dict)  # plan index -> why it cannot be a sample

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def slice(self, start: int, stop: int) -> SampleTable:
        """The rows of plan indices [start, stop) (copies, so pickling ships only them)."""
        lo, hi = max(start - self.start, 0), max(min(stop - self.start, len(self)), 0)
        bad = self._problem_indices
        first, last = np.searchsorted(bad, [self.start + lo, self.start + hi])
        return SampleTable(
            start=self.start + lo,
            columns={k: np.ascontiguousarray(v[lo:hi]) for k, v in self.columns.items()},
            problems={i: self.problems[i] for i in bad[first:last].tolist()},
        )

    def only_used(self, column: str, items: tuple[T, ...]) -> tuple[tuple[T, ...], SampleTable]:
        """``items`` cut to those this table's ``column`` indexes (e.g. the shards a block reads), and the table
        with that column renumbered to match: a block's task ships its few shards, not all 1024."""
        used, renumbered = np.unique(self.columns[column], return_inverse=True)
        columns = {**self.columns, column: renumbered.astype(self.columns[column].dtype).reshape(-1)}
        return tuple(items[i] for i in used.tolist()), SampleTable(self.start, columns, self.problems)

    @cached_property
    def _problem_indices(self) -> np.ndarray:
        return np.asarray(sorted(self.problems), dtype=np.int64)

    def row(self, index: int, key: str) -> int:
        """The row of plan index ``index``; raises DecodeError for a sample found bad while planning."""
        reason = self.problems.get(index)
        if reason is not None:
            raise DecodeError(key, reason)
        row = index - self.start
        if not 0 <= row < len(self):
            raise IndexError(f"plan index {index} is outside this reader's rows "
                             f"[{self.start}, {self.start + len(self)})")
        return row
