"""Cold epochs from a loopback URL: the exact shuffle against the shard-windowed one, HTTP and S3, in
interleaved rounds of one run (each round a fresh block cache), each figure with the 1-minute load average.

    PYTHONPATH=$PWD python -m bench.scripts.windowed_cold --n 5000 --size 32 --shards 40 --rounds 5

Both servers run in processes of their own (``bench.sections.peers_remote``'s), so no server shares this
process's interpreter. Prints one JSON line per figure and a summary: windowed / exact per store and round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.sections.peers_remote import _cachebuild_epochs, _http_server, _s3_server, _upload
from cachebuild.storage.cache import write_cache


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--shards", type=int, default=40)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stores", default="http,s3")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wincold-"))
    try:
        rng = np.random.default_rng(0)
        img = rng.integers(0, 256, (a.n, a.size, a.size, 3), dtype=np.uint8)
        write_cache(work / "c", img, np.arange(a.n) % 10, [f"c{k}" for k in range(10)], storage="npy",
                    shard_size=-(-a.n // a.shards))
        cfg = {"batch": a.batch, "workers": a.workers}
        ratios: dict[str, list[float]] = {}
        for store in a.stores.split(","):
            ctx = _s3_server(work) if store == "s3" else _http_server(work)
            with ctx as base:
                url = _upload(work / "c", "c") if store == "s3" else f"{base}/c"
                for r in range(a.rounds):
                    got = {}
                    for name, window in (("exact", None), ("windowed", a.window))[:: 1 if r % 2 == 0 else -1]:
                        blocks = work / f"blocks-{store}-{name}-{r}"
                        rate = _cachebuild_epochs(url, cfg, 1, blocks, True, window)[0]
                        shutil.rmtree(blocks, ignore_errors=True)
                        got[name] = rate
                        print(json.dumps({"store": store, "round": r, "order": name, "cold_img_s": round(rate, 1),
                                          "load1": _load()}), flush=True)
                    ratios.setdefault(store, []).append(round(got["windowed"] / got["exact"], 2))
        print(json.dumps({"windowed_over_exact": ratios}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
