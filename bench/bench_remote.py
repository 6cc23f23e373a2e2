"""Reading a cache from a URL against reading it from a local path, in one run.

    python bench/bench_remote.py                                  # 4,000 samples at 224 (600 MB), batch 256
    python bench/bench_remote.py --baseline-tree /tmp/cb-base     # plus the local path of another checkout

Contenders, each a shuffled epoch (CacheSampler) through a DataLoader with 2 workers and collate_batch:
  local            CachedImageDataset(path): memory-mapped shards (page cache warm)
  baseline local   the same in a checkout given by --baseline-tree (e.g. the commit before the storage
                   seam), run in a subprocess with its own PYTHONPATH, rounds interleaved with "local"
  http cold        CachedImageDataset(url), no local cache: each batch fetches its rows by HTTP range
                   requests on 127.0.0.1 (aiohttp static server, files in the page cache)
  http block cache CachedImageDataset(url, local_cache=DIR): epoch 1 fills the block cache (cold), later
                   epochs read local disk (warm); persistent workers
  --faults RATE    the same URL epochs through the fault-injecting proxy of the tests (tests/fault_proxy.py:
                   500, 503 with Retry-After: 1, reset mid-body, short body, stalled answer; seeded), at RATE
                   of requests and at 0 (the fault-free figure: same proxy, same run, rounds interleaved):
                   a cold epoch (no block cache) and block-cache epochs (the first fills it, later ones warm).
                   CACHEBUILD_HTTP_TIMEOUT=1 there, so a stalled answer costs 1 s. --only-faults skips the rest;
                   --fault-kinds 500,reset,short draws only those.
Bytes fetched are counted at the server (Content-Length of every response) and divided by the samples
the epoch delivered; "needed" is the samples' pixel bytes. Worker start-up is excluded from img/s; the
first epoch of each warm contender is a warm-up and left out of its median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]


def make_cache(dest: Path, n: int, size: int) -> Path:
    """n samples at size x size cut from the real photos that ship in scikit-image / scikit-learn."""
    import cv2

    from cachebuild.samples.photos import photo_bank
    from cachebuild.storage.writer import write_cache

    bank = [cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA) for _, img in photo_bank()]
    rng = np.random.default_rng(0)
    images = np.stack([np.roll(bank[i % len(bank)], int(rng.integers(size)), axis=1) for i in range(n)])
    write_cache(dest, images, np.arange(n) % 10, [f"c{k}" for k in range(10)], shard_size=384, replace=True)
    return dest


class Server:
    """aiohttp's static file handler (Range requests) on 127.0.0.1 in a thread, counting bytes sent."""

    def __init__(self, root: Path) -> None:
        from aiohttp import web

        self.sent = 0
        self.requests = 0
        self.loop = asyncio.new_event_loop()

        async def count(request: Any, response: Any) -> None:
            self.requests += 1
            if request.method != "HEAD":  # a HEAD answer names the file's length but sends no body
                self.sent += int(response.headers.get("Content-Length", 0))

        async def start() -> str:
            app = web.Application()
            app.router.add_static("/", root)
            app.on_response_prepare.append(count)
            self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def epochs(ds: Any, args: argparse.Namespace, count: int, persistent: bool = True) -> list[float]:
    """img/s of ``count`` shuffled epochs of ``ds`` through a DataLoader (worker start-up excluded)."""
    from torch.utils.data import DataLoader

    from loaders.dataset import collate_batch
    from loaders.sampler import CacheSampler

    sampler = CacheSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers, collate_fn=collate_batch,
                    persistent_workers=persistent, prefetch_factor=4)
    rates = []
    for e in range(count):
        sampler.set_epoch(e)
        it = iter(dl)
        first = next(it)  # workers started and the first batch in: the clock starts here
        seen, t0 = 0, time.perf_counter()
        del first
        for x, _ in it:
            seen += len(x)
        rates.append(seen / (time.perf_counter() - t0))
    return rates


def median_warm(rates: list[float]) -> float:
    return statistics.median(rates[1:] if len(rates) > 2 else rates)


def fault_rounds(url_root: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Cold and warm-block-cache epochs through the fault proxy at ``args.faults`` and at 0, per round."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from loaders.dataset import CachedImageDataset
    from tests.fault_proxy import FaultProxy
    from tests.servers import _Loop

    os.environ.setdefault("CACHEBUILD_HTTP_TIMEOUT", "1")
    loop = _Loop()
    rows: dict[str, list[float]] = {k: [] for k in ("cold_clean", "cold_faulty", "warm_clean", "warm_faulty")}
    injected: dict[str, int] = {}
    for r in range(args.rounds):
        for label, rate in (("clean", 0.0), ("faulty", args.faults)):
            proxy = FaultProxy(url_root, rate=rate, seed=r, kinds=tuple(args.fault_kinds.split(",")))
            loop.run(proxy._start())
            url = f"{proxy.url}/cache"
            rows[f"cold_{label}"].append(epochs(CachedImageDataset(url), args, 1, persistent=False)[0])
            blocks = work / f"blocks-{label}-{r}"
            rates = epochs(CachedImageDataset(url, local_cache=blocks), args, max(3, args.epochs))
            rows[f"warm_{label}"].append(median_warm(rates))
            for k, v in proxy.faults.items():
                injected[k] = injected.get(k, 0) + v
            loop.run(proxy._stop())
            shutil.rmtree(blocks, ignore_errors=True)
    loop.close()
    out: dict[str, Any] = {f"faults_{k}_img_s": statistics.median(v) for k, v in rows.items()}
    for kind in ("cold", "warm"):
        ratios = [f / c for f, c in zip(rows[f"{kind}_faulty"], rows[f"{kind}_clean"], strict=True)]
        out[f"faults_{kind}_ratio"] = {"median": statistics.median(ratios), "rounds": ratios}
    out["faults_rate"] = args.faults
    out["faults_kinds"] = args.fault_kinds
    out["faults_injected"] = injected
    return out


def child(args: argparse.Namespace) -> None:
    """--child: the local contender in whatever tree PYTHONPATH names (the baseline)."""
    from loaders.dataset import CachedImageDataset

    print(json.dumps({"rates": epochs(CachedImageDataset(args.cache), args, args.epochs)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--faults", type=float, default=None, help="fault rate of the proxy section (e.g. 0.1)")
    p.add_argument("--only-faults", action="store_true", help="run only the --faults section")
    p.add_argument("--fault-kinds", default="500,503,reset,short,stall",
                   help="comma-separated kinds the proxy draws from (tests/fault_proxy.py KINDS)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    from loaders.dataset import CachedImageDataset

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    results: dict[str, Any] = {"n": args.n, "size": args.size, "batch": args.batch, "workers": args.workers}
    try:
        cache = make_cache(work / "site" / "cache", args.n, args.size)
        server = Server(work / "site")
        url = f"{server.url}/cache"
        if args.faults is not None:
            results.update(fault_rounds(server.url, work, args))
        if args.only_faults:
            server.close()
            raise SystemExit(_report(results, args))
        row = args.size * args.size * 3
        local_rates, base_rates, ratios = [], [], []
        for _ in range(args.rounds):
            local = median_warm(epochs(CachedImageDataset(cache), args, args.epochs))
            local_rates.append(local)
            if args.baseline_tree is not None:
                env = {**os.environ, "PYTHONPATH": str(args.baseline_tree)}
                out = subprocess.run([sys.executable, __file__, "--child", "--cache", str(cache), "--batch",
                                      str(args.batch), "--workers", str(args.workers), "--epochs", str(args.epochs)],
                                     env=env, capture_output=True, text=True, check=True)
                base = median_warm(json.loads(out.stdout.strip().splitlines()[-1])["rates"])
                base_rates.append(base)
                ratios.append(local / base)
        results["local_img_s"] = statistics.median(local_rates)
        if ratios:
            results["baseline_local_img_s"] = statistics.median(base_rates)
            results["local_vs_baseline"] = {"median": statistics.median(ratios), "rounds": ratios}

        server.sent = server.requests = 0
        cold = epochs(CachedImageDataset(url), args, 1, persistent=False)[0]
        results["http_cold_img_s"] = cold
        results["http_cold_bytes_per_image"] = server.sent / args.n
        results["http_cold_bytes_vs_needed"] = server.sent / (args.n * row)
        results["http_cold_requests_per_batch"] = server.requests / -(-args.n // args.batch)

        server.sent = 0
        ds = CachedImageDataset(url, local_cache=work / "blocks")
        rates = epochs(ds, args, max(3, args.epochs))
        results["http_block_cache_cold_img_s"] = rates[0]
        results["http_block_cache_warm_img_s"] = median_warm(rates)
        results["http_block_cache_bytes_vs_needed"] = server.sent / (args.n * row)  # all epochs together
        results["warm_vs_local"] = results["http_block_cache_warm_img_s"] / results["local_img_s"]
        server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(results, args)


def _report(results: dict[str, Any], args: argparse.Namespace) -> int:
    for k, v in results.items():
        print(f"{k:36s} {json.dumps(v) if isinstance(v, dict) else f'{v:,.2f}' if isinstance(v, float) else v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    main()
