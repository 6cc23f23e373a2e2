"""The copy-bound load rows again, in a process without ``GLIBC_TUNABLES`` (run by ``bench.sections.load`` when the
harness runs with it, so one run shows both).

    python -m bench.sections.load_child --src TRAIN_DIR --cache NPY_CACHE --size S --batch B --workers W --epochs E

Prints one JSON line: img/s of each timed epoch (one warm-up left out) of the npy DataLoader +
``collate_batch`` and the bare memmap gather, measured as in ``bench.sections.load``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.sections.load import COPY_BOUND, _bare_gather, _interleaved, _loaders
from cachebuild.storage.cache import open_cache


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True)
    for k in ("size", "batch", "workers", "epochs"):
        p.add_argument(f"--{k}", type=int, required=True)
    a = p.parse_args()
    cfg = {"size": a.size, "batch": a.batch, "workers": a.workers}
    loaders = _loaders(cfg, a.src, {"cachebuild_npy": a.cache}, aug=False)
    n = open_cache(a.cache).manifest.count
    contenders = {k: loaders[k][1] for k in COPY_BOUND}
    contenders["limit_bare_gather"] = _bare_gather(a.cache, a.batch)
    print(json.dumps(_interleaved(contenders, n, a.epochs, lambda _: None)))


if __name__ == "__main__":
    main()
