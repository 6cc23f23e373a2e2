"""The npy sink's per-sample cost with each checksum algorithm (format 3's sha256, format 4's xxh3-128), side by side.

One process, the algorithms alternating block by block: each block is ``--samples`` 224 px samples written by
``NpyShardSink`` (the build's write path: one ``write`` and one hash update per sample) into a temporary folder,
closed and renamed as a build's block is. Also the bare hash of one sample's bytes. Prints a table and, with
``--json``, writes the figures::

    python -m bench.scripts.sink_digest --rounds 7 --json bench/results/NAME/sink_digest.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cachebuild.format.manifest import SHA256, XXH3_128, Digest
from cachebuild.storage.kinds.npy import NpyShardSink

ALGORITHMS = (SHA256, XXH3_128)


def _block(folder: Path, block: int, samples: np.ndarray, algorithm: Digest) -> float:
    """Seconds per sample to write one block of ``samples`` through the sink, close included."""
    t0 = time.perf_counter()
    sink = NpyShardSink(folder, block, len(samples), samples.shape[1:], algorithm)
    for s in samples:
        sink.next_slot()[...] = s
        sink.commit()
    sink.close()
    dt = (time.perf_counter() - t0) / len(samples)
    (folder / f"images-{block:05d}.npy").unlink()
    return dt


def _bare(sample: np.ndarray, algorithm: Digest, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        algorithm.of(sample)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--samples", type=int, default=256, help="samples per block")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    load = os.getloadavg()[0]  # at the start, before anything is measured
    rng = np.random.default_rng(0)
    samples = rng.integers(0, 256, (args.samples, args.size, args.size, 3), dtype=np.uint8)
    sink: dict[str, list[float]] = {a.name: [] for a in ALGORITHMS}
    bare: dict[str, list[float]] = {a.name: [] for a in ALGORITHMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds + 1):  # the first round warms the page cache and is dropped
            for a in ALGORITHMS if r % 2 == 0 else ALGORITHMS[::-1]:
                dt = _block(Path(tmp), r, samples, a)
                b = _bare(samples[0], a, 200)
                if r:
                    sink[a.name].append(dt)
                    bare[a.name].append(b)
    med = {k: {"sink_ms": statistics.median(sink[k]) * 1e3, "hash_ms": statistics.median(bare[k]) * 1e3}
           for k in sink}
    out = {"size": args.size, "sample_bytes": int(samples[0].nbytes), "samples_per_block": args.samples,
           "rounds": args.rounds, "load_average_at_start": load, "median": med,
           "sink_ms": {k: [v * 1e3 for v in vs] for k, vs in sink.items()},
           "hash_ms": {k: [v * 1e3 for v in vs] for k, vs in bare.items()}}
    print(f"{args.size} px samples ({samples[0].nbytes:,} bytes), {args.rounds} rounds of {args.samples}")
    print("| algorithm | sink, ms a sample | hash alone, ms a sample |")
    print("|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v['sink_ms']:.4f} | {v['hash_ms']:.4f} |")
    saved = med["sha256"]["sink_ms"] - med["xxh3-128"]["sink_ms"]
    print(f"saved per sample in the sink: {saved:.4f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
