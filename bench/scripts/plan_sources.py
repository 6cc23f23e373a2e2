"""Planning rate of the shard sources: how long `cachebuild wds` / `cachebuild parquet` take to plan a set
before the first image is decoded, measured on generated sets and extrapolated to ImageNet-1k's 1,281,167
training samples.

WebDataset: --shards tar shards of --per-shard samples laid out as timm's imagenet1k-wds (KEY.cls, KEY.jpg,
KEY.json, sorted members, PAX format). The image members are --image-bytes long but left as holes (sparse
files), so offsets are realistic (one header per ~110 KB) while the set takes little disk; planning reads
headers and label members only, never image bytes. Parquet: as many files in the Hugging Face layout
(row groups of 100 rows, struct image column, ClassLabel metadata) with small image payloads; planning reads
footers and the label column only.

    python -m bench.scripts.plan_sources --shards 100 --per-shard 1251 --jobs 2 --json bench-out/plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

IMAGENET_TRAIN = 1_281_167


def write_sparse_shards(folder: Path, shards: int, per_shard: int, image_bytes: int, seed: int = 0) -> str:
    """timm-like shards whose image data are holes; returns their brace pattern."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        labels = rng.integers(0, 1000, per_shard)
        with open(folder / f"imagenet1k-train-{s:04d}.tar", "wb") as f:
            for i, label in enumerate(labels.tolist()):
                key = f"n{label:08d}_{s * per_shard + i}"
                meta = json.dumps({"filename": f"{key}.JPEG", "label": label}).encode()
                cls = str(label).encode()
                members: list[tuple[str, bytes | None, int]] = [  # (extension, data or a hole, size)
                    ("cls", cls, len(cls)), ("jpg", None, image_bytes), ("json", meta, len(meta))]
                for ext, data, size in members:
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = size
                    ti.mtime, ti.mode, ti.uname, ti.gname = 1700000000, 0o444, "bigdata", "bigdata"
                    f.write(ti.tobuf(tarfile.PAX_FORMAT))
                    padded = -(-ti.size // 512) * 512
                    if data is not None:
                        f.write(data + b"\0" * (padded - len(data)))
                    else:
                        f.seek(padded, os.SEEK_CUR)  # a hole: realistic offsets, no disk
            f.write(b"\0" * 1024)
    return str(folder / f"imagenet1k-train-{{0000..{shards - 1:04d}}}.tar")


def write_parquet(folder: Path, files: int, per_file: int, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from support.parquet_layout import hf_features_metadata

    rng = np.random.default_rng(seed)
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    meta = {b"huggingface": hf_features_metadata([f"n{i:08d}" for i in range(1000)])}
    for k in range(files):
        labels = rng.integers(0, 1000, per_file)
        image = pa.array([{"bytes": b"\xff\xd8" + bytes(30), "path": f"{k}_{i}.JPEG"} for i in range(per_file)])
        t = pa.table({"image": image, "label": pa.array(labels, pa.int64())}).replace_schema_metadata(meta)
        pq.write_table(t, data / f"train-{k:05d}-of-{files:05d}.parquet", row_group_size=100)
    return data


def _time(fn, rounds: int) -> tuple[float, int]:
    best, n = float("inf"), 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        plan = fn()
        best = min(best, time.perf_counter() - t0)
        n = len(plan)
    return best, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--per-shard", type=int, default=1251)  # timm's imagenet1k-wds: 1,281,167 / 1024
    ap.add_argument("--image-bytes", type=int, default=110_000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2, help="best of; the first round also warms the page cache")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the sets (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import logging

    logging.getLogger("cachebuild").setLevel(logging.ERROR)
    from cachebuild.sources.shards.parquet import parquet_plan
    from cachebuild.sources.shards.wds import wds_plan

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        pattern = write_sparse_shards(root / "wds", args.shards, args.per_shard, args.image_bytes)
        data = write_parquet(root / "hf", args.shards, args.per_shard)
        made = time.perf_counter() - t0
        results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   "shards": args.shards, "per_shard": args.per_shard, "jobs": args.jobs, "setup_s": made}
        for name, fn in (("wds", lambda: wds_plan(pattern, jobs=args.jobs)),
                         ("wds_1job", lambda: wds_plan(pattern, jobs=1)),
                         ("parquet", lambda: parquet_plan(data, jobs=args.jobs))):
            seconds, n = _time(fn, args.rounds)
            rate = n / seconds
            results[name] = {"samples": n, "seconds": seconds, "samples_per_s": rate,
                             "imagenet_train_s": IMAGENET_TRAIN / rate}
            print(f"{name:9s} {n} samples in {seconds:.2f} s: {rate:,.0f} samples/s; "
                  f"ImageNet-1k train ({IMAGENET_TRAIN:,}) would plan in {IMAGENET_TRAIN / rate:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
