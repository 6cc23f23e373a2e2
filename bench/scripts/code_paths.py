"""How much code a user's path runs through: files, functions and call depth of a real build and a real read.

    python -m bench.scripts.code_paths [--json OUT.json]

Four figures, each from a traced run in this process (``sys.setprofile``: every call of a function defined
under ``cachebuild/`` or ``loaders/``; module and class bodies, run by imports, and comprehensions are not
counted):

- ``product``: lines and modules of ``cachebuild/`` and ``loaders/`` (``wc -l`` of every ``.py``);
- ``build``: ``cachebuild folder SRC --size 64 --out OUT --jobs 1`` through the CLI (click's ``main`` in this
  process, npy, local), from the command to the committed cache: the files and functions it ran, and the
  deepest chain of our own frames;
- ``sample``: one sample's way from decode to its slot: the files of every call made beneath the block's
  per-sample loop (``SAMPLE_LOOP``) but the read of the file's bytes (the source kind's, and the block's digest of
  them as read: ``READ``), the depth counted from there;
- ``read``: ``cachebuild.open``'s equivalent through the dataset, ``CachedImageDataset(path)`` and its first
  batch of 32 through ``collate_batch``: files and functions.

The source is the train split of the built-in sample (real photos, 3 classes of 20), made in a temporary
folder. ``--jobs 1`` keeps every block in this process, where the profiler sees it; the code a block runs is
the same under any executor.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cachebuild", "loaders")
# The function of a block that runs the per-sample loop: every call beneath it is one sample's way to its slot
SAMPLE_LOOP = ("decode_run",)
# The block's reader of a file's bytes, which digests them as it reads: the read, not the decode
READ = ("_DigestingReader.__call__",)


def product_lines() -> dict[str, int]:
    files = [p for name in PACKAGES for p in (ROOT / name).rglob("*.py")]
    return {"lines": sum(p.read_text(encoding="utf-8").count("\n") for p in files), "modules": len(files)}


def _function(code: Any) -> bool:
    """A function's code: not a module or class body (run by an import), not a comprehension."""
    return bool(code.co_flags & inspect.CO_OPTIMIZED) and not code.co_name.startswith("<")


class Trace:
    """Our own calls, as (file, function) pairs, and the deepest chain of our frames seen."""

    def __init__(self) -> None:
        self.calls: set[tuple[str, str]] = set()
        self.depth = 0
        self.chain: list[str] = []
        self._roots = tuple(str(ROOT / name) + "/" for name in PACKAGES)

    def _ours(self, frame: Any) -> str | None:
        f = frame.f_code.co_filename
        return f[len(str(ROOT)) + 1 :] if f.startswith(self._roots) else None

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = self._ours(frame)
        if name is None or not _function(frame.f_code):
            return
        chain = self._chain(frame)
        if chain is None:
            return
        self.calls.add((name, frame.f_code.co_qualname))
        if len(chain) > self.depth:
            self.depth, self.chain = len(chain), chain

    def _chain(self, frame: Any) -> list[str] | None:
        """Our frames from the outermost to ``frame``, or None when this call is not counted."""
        chain = []
        f = frame
        while f is not None:
            if self._ours(f) is not None and _function(f.f_code):
                chain.append(f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}")
            f = f.f_back
        return chain[::-1]

    @contextmanager
    def running(self) -> Iterator[Trace]:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    def summary(self) -> dict[str, Any]:
        files = sorted({f for f, _ in self.calls})
        return {"files": len(files), "functions": len(self.calls), "depth": self.depth, "deepest": self.chain,
                "file_list": files}


def _in_read(frame: Any) -> bool:
    """Whether ``frame`` runs inside the block's reader of a file's bytes (``READ``)."""
    f = frame
    while f is not None:
        if f.f_code.co_qualname in READ:
            return True
        f = f.f_back
    return False


class SampleTrace(Trace):
    """Only the calls made beneath one of ``roots`` (function names), and the files they ran in."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        super().__init__()
        self.roots = roots

    def _chain(self, frame: Any) -> list[str] | None:
        if self._ours(frame).startswith("cachebuild/sources/") or _in_read(frame):  # type: ignore[union-attr]
            return None  # the read of a file's bytes (the source's, digested as read): before the decode
        chain = super()._chain(frame)
        assert chain is not None
        starts = [i for i, c in enumerate(chain) if c.split(":")[1] in self.roots]
        return chain[starts[0] :] if starts else None

def _tree(root: Path) -> Path:
    from cachebuild.samples.imagenet_layout import write_imagenet

    write_imagenet(root / "src", n_classes=3, train_per_class=20, val_per_class=1, seed=0, quirks=False,
                   broken=False)
    return root / "src" / "train"


def _run(fn: Callable[[], Any], trace: Trace) -> dict[str, Any]:
    with trace.running():
        fn()
    return trace.summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from click.testing import CliRunner

    from cachebuild.cli import main as cli

    out: dict[str, Any] = {"product": product_lines()}
    with tempfile.TemporaryDirectory() as tmp:
        src = _tree(Path(tmp))
        cache = Path(tmp) / "cache"

        def build() -> None:
            r = CliRunner().invoke(cli, ["folder", str(src), "--size", "64", "--out", str(cache), "--jobs", "1"])
            assert r.exit_code == 0, r.output

        out["build"] = _run(build, Trace())
        out["sample"] = _run(lambda: CliRunner().invoke(cli, ["folder", str(src), "--size", "64", "--out",
                                                               str(Path(tmp) / "again"), "--jobs", "1"]),
                             SampleTrace(SAMPLE_LOOP))

        def read() -> None:
            import torch

            from loaders import CachedImageDataset, collate_batch

            ds = CachedImageDataset(next(cache.rglob("manifest.json")).parent)
            dl = torch.utils.data.DataLoader(ds, batch_size=32, collate_fn=collate_batch)
            next(iter(dl))

        out["read"] = _run(read, Trace())
    for name in ("build", "sample", "read"):
        s = out[name]
        print(f"{name:7s} files {s['files']:3d}  functions {s['functions']:4d}  depth {s['depth']:3d}")
    print(f"product lines {out['product']['lines']:,}  modules {out['product']['modules']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
