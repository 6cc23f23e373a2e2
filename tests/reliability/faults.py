"""Faults injected into a real ``cachebuild`` process, at named points of a build.

``CB_FAULT=<action>:<point>:<n>`` in the environment of a CLI run, with ``tests/reliability/fault_hooks``
first on ``PYTHONPATH`` (its ``sitecustomize`` calls :func:`install` in every Python process of the
build, the loky workers included). Each process counts its own calls; the ``n``-th one fires.

actions: ``kill`` (SIGKILL the whole build: parent and workers, as a machine losing power or
``kill -9`` of the process group), ``kill-self`` (SIGKILL this process only: a worker taken by the
OOM killer), ``enospc`` / ``erofs`` (the call raises that ``OSError``, as a full disk or a filesystem
remounted read-only would).

points (where the build is when it fires):

- ``decode``: inside a worker, in the middle of a block (before the n-th image is decoded)
- ``record``: between blocks (just after the n-th block record is written)
- ``manifest``: during the manifest write (half of it written to the temporary file)
- ``rename``: just before the n-th folder rename of the commit (with ``--force``: 1 = before moving
  the old cache aside, 2 = between that and renaming the new one into place)
- ``rename-after``: just after the n-th rename of the commit
- ``compact``: during zarr compaction, before the n-th block move
- ``shard-write``: the n-th sample written to an npy shard (for ``enospc``, ``erofs``)

The points name today's functions (``cachebuild.builder.block``, ``cachebuild.storage.cache``, the storage kinds
``cachebuild.storage.kinds.zarr`` and ``cachebuild.storage.kinds.npy``); when they move, move the patches here,
not the tests.
"""

from __future__ import annotations

import errno
import os
import pathlib
import signal
from typing import Any

__all__ = ["install"]


def _fire(action: str) -> None:
    if action == "kill":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if action in ("kill", "kill-self"):
        os.kill(os.getpid(), signal.SIGKILL)
    if action in ("enospc", "erofs"):
        code = errno.ENOSPC if action == "enospc" else errno.EROFS
        raise OSError(code, os.strerror(code))
    raise ValueError(f"unknown fault action {action!r}")


class _Counter:
    def __init__(self, action: str, n: int) -> None:
        self.action, self.n, self.calls = action, n, 0

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            _fire(self.action)


def install(spec: str) -> None:
    action, point, n = spec.split(":")
    counter = _Counter(action, int(n))

    if point == "decode":
        import cachebuild.builder.block as decode  # the block module calls its decode_into at each sample

        real_decode = decode.decode_into

        def decode_into(*a: Any, **k: Any) -> Any:
            counter.tick()
            return real_decode(*a, **k)

        decode.decode_into = decode_into
    elif point == "record":
        import cachebuild.builder.block as block

        real_record = block.write_bytes_atomic

        def write_record(path: pathlib.Path, data: bytes, **k: Any) -> None:
            real_record(path, data, **k)
            if path.name.startswith("block-"):
                counter.tick()

        block.write_bytes_atomic = write_record
    elif point == "manifest":
        import cachebuild.storage.cache as writer

        real_write = writer.write_bytes_atomic

        def write_manifest(path: pathlib.Path, data: bytes, **k: Any) -> None:
            if path.name == "manifest.json":
                counter.tick()
                if counter.calls == counter.n:
                    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                    with open(tmp, "wb") as f:
                        f.write(data[: len(data) // 2])
                        f.flush()
                    _fire(action)
            real_write(path, data, **k)

        writer.write_bytes_atomic = write_manifest
    elif point in ("rename", "rename-after"):
        real_rename = pathlib.Path.rename

        def rename(self: pathlib.Path, target: Any) -> Any:
            commit = self.name.endswith(".partial") or ".replaced-" in str(target)  # the commit's two renames
            if commit and point == "rename":
                counter.tick()
            result = real_rename(self, target)
            if commit and point == "rename-after":
                counter.tick()
            return result

        pathlib.Path.rename = rename  # type: ignore[method-assign]
    elif point == "compact":
        import cachebuild.storage.kinds.zarr as zs

        real_open = zs.open_zarr_for_writing

        class Moves:
            def __init__(self, arr: Any) -> None:
                self._arr = arr

            def __getattr__(self, name: str) -> Any:
                return getattr(self._arr, name)

            def __getitem__(self, key: Any) -> Any:
                return self._arr[key]

            def __setitem__(self, key: Any, value: Any) -> None:
                counter.tick()
                self._arr[key] = value

        zs.open_zarr_for_writing = lambda path: Moves(real_open(path))
    elif point == "shard-write":
        import cachebuild.storage.kinds.npy as sinks

        real_commit = sinks.NpyShardSink.commit

        def commit(self: Any) -> None:
            counter.tick()
            real_commit(self)

        sinks.NpyShardSink.commit = commit  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown fault point {point!r}")
