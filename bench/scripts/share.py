"""Pull figures for docs/sharing.md: a cache served by the loopback HTTP server
(support/http_server.py, aiohttp on 127.0.0.1), pulled with `cachebuild pull`'s library call.

Reports, per storage kind: a cold pull (MB/s, files, every file checked on arrival by its checksum), a pull
interrupted after about half the files and resumed (bytes fetched by the resume, counted at the server),
and a rerun on the finished copy (up to date: bytes fetched). Loopback measures the tool's own cost
(hashing, fsync, staging), not a network.

    python bench/scripts/share.py --mb 256 --json bench-out/share.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cachebuild.share.pull import pull
from cachebuild.storage.cache import write_cache
from support.http_server import HttpServer
from support.loopback import EventLoopThread


def _cache(root: Path, mb: int, storage: str) -> int:
    h = w = 224
    n = max(64, mb * 1_000_000 // (h * w * 3))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    write_cache(root, images, np.arange(n) % 10, [f"c{k}" for k in range(10)], storage=storage,
                shard_size=256 if storage == "npy" else 64)
    return n


def run(mb: int, jobs: int) -> list[dict]:
    rows = []
    loop = EventLoopThread()
    try:
        for storage in ("npy", "zarr"):
            tmp = Path(tempfile.mkdtemp(prefix="bench-share-"))
            try:
                n = _cache(tmp / "site" / "c", mb, storage)
                server = HttpServer(tmp / "site")
                loop.run(server.start())
                url = server.url_for("c")
                t = time.perf_counter()
                cold = pull(url, tmp / "dest" / "c", jobs=jobs, progress=False)[0]
                cold_s = time.perf_counter() - t
                # An interrupted pull: the staged copy of the first run, minus its later half, minus the manifest.
                staged = tmp / "dest" / "again.partial"
                shutil.copytree(tmp / "dest" / "c", staged)
                (staged / "manifest.json").unlink()
                (staged / "files.json").unlink()
                manifest_sha = hashlib.sha256((tmp / "site" / "c" / "manifest.json").read_bytes()).hexdigest()
                (staged / "pull.json").write_text(json.dumps({"source": url, "manifest_sha256": manifest_sha}))
                files = sorted(p for p in staged.rglob("*") if p.is_file() and p.name != "pull.json")
                for p in files[len(files) // 2:]:
                    p.unlink()
                server.clear()
                resumed = pull(url, tmp / "dest" / "again", jobs=jobs, progress=False)[0]
                resumed_bytes = server.log.bytes()
                server.clear()
                again = pull(url, tmp / "dest" / "c", jobs=jobs, progress=False)[0]
                rows.append({
                    "storage": storage, "samples": n, "files": cold.files, "mb": round(cold.bytes_fetched / 1e6, 1),
                    "cold_s": round(cold_s, 2), "cold_mb_s": round(cold.bytes_fetched / 1e6 / cold_s, 1),
                    "resume_fetched_files": resumed.fetched, "resume_kept_files": resumed.kept,
                    "resume_bytes_at_server_mb": round(resumed_bytes / 1e6, 1),
                    "rerun": again.status, "rerun_bytes_at_server": server.log.bytes(),
                })
                loop.run(server.stop())
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        loop.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="Cache size in MB (224x224 samples).")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = run(args.mb, args.jobs)
    for r in rows:
        print(f"{r['storage']:5s} {r['files']:4d} files {r['mb']:7.1f} MB  cold {r['cold_s']:6.2f} s "
              f"{r['cold_mb_s']:6.1f} MB/s | resumed: {r['resume_fetched_files']} fetched, {r['resume_kept_files']} "
              f"kept, {r['resume_bytes_at_server_mb']} MB at the server | rerun: {r['rerun']}, "
              f"{r['rerun_bytes_at_server']} B")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
