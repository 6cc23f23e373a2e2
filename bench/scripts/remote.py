"""Reading a cache from a URL against reading it from a local path, in one run.

    python bench/scripts/remote.py                                  # 4,000 samples at 224 (600 MB), batch 256
    python bench/scripts/remote.py --baseline-tree /tmp/cb-base     # plus the local path of another checkout

Contenders, each a shuffled epoch (CacheSampler) through a DataLoader with 2 workers and collate_batch:
  local            CachedImageDataset(path): memory-mapped shards (page cache warm)
  baseline local   the same in a checkout given by --baseline-tree (e.g. the commit before the storage
                   seam), run in a subprocess with its own PYTHONPATH, rounds interleaved with "local"
  http cold        CachedImageDataset(url), no local cache: each batch fetches its rows by HTTP range
                   requests on 127.0.0.1 (aiohttp static server, files in the page cache)
  http block cache CachedImageDataset(url, local_cache=DIR): epoch 1 fills the block cache (cold), later
                   epochs read local disk (warm); persistent workers
  --faults RATE    the same URL epochs through the loopback fault-injecting proxy (support/fault_proxy.py:
                   500, 503 with Retry-After: 1, reset mid-body, short body, stalled answer; seeded), at RATE
                   of requests and at 0 (the fault-free figure: same proxy, same run, rounds interleaved):
                   a cold epoch (no block cache) and block-cache epochs (the first fills it, later ones warm).
                   CACHEBUILD_HTTP_TIMEOUT=1 there, so a stalled answer costs 1 s. --only-faults skips the rest;
                   --fault-kinds 500,reset,short draws only those; --fault-sets '500;stall;500,stall' runs
                   each set in every round (rounds interleaved, one fault-free epoch per round).
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
    from cachebuild.storage.cache import write_cache

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


def epochs(ds: Any, args: argparse.Namespace, count: int, persistent: bool = True, whole: bool = False) -> list[float]:
    """img/s of ``count`` shuffled epochs of ``ds`` through a DataLoader (worker start-up and the first batch
    excluded; ``whole``: included, the clock starts when the epoch is asked for)."""
    from torch.utils.data import DataLoader

    from loaders.dataset import collate_batch
    from loaders.sampler import CacheSampler

    sampler = CacheSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                    collate_fn=collate_batch, persistent_workers=persistent, prefetch_factor=4)
    rates = []
    for e in range(count):
        sampler.set_epoch(e)
        t_ask = time.perf_counter()
        it = iter(dl)
        first = next(it)  # workers started and the first batch in: the clock starts here
        seen, t0 = 0, time.perf_counter()
        if whole:
            seen, t0 = len(first[0]), t_ask
        del first
        for x, _ in it:
            seen += len(x)
        rates.append(seen / (time.perf_counter() - t0))
    return rates


def median_warm(rates: list[float]) -> float:
    return statistics.median(rates[1:] if len(rates) > 2 else rates)


def _fault_epochs(url: str, work: Path, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """img/s of ``url``: a cold epoch (no block cache), and with a block cache its first epoch (the fill:
    1 MiB blocks, a few requests a batch; the first batch and the workers' start counted, as the first batch
    of a small cache fetches most of its blocks) and the median of the later (warm) ones."""
    from loaders.dataset import CachedImageDataset, DatasetOptions

    cold = epochs(CachedImageDataset(url), args, 1, persistent=False)[0]
    blocks = work / f"blocks-{tag}"
    ds = CachedImageDataset(url, DatasetOptions(local_cache=blocks))
    fill = epochs(ds, args, 1, persistent=False, whole=True)[0]
    rates = epochs(ds, args, max(3, args.epochs))
    shutil.rmtree(blocks, ignore_errors=True)
    return {"cold": cold, "fill": fill, "warm": median_warm(rates)}


def fault_rounds(url_root: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Cold and warm-block-cache epochs through the fault proxy at 0 and at ``args.faults`` with each set of
    fault kinds, every set once per round (rounds interleaved); ratios are faulty / fault-free of one round."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from support.fault_proxy import FaultProxy
    from support.loopback import EventLoopThread

    os.environ.setdefault("CACHEBUILD_HTTP_TIMEOUT", "1")
    sets = args.fault_sets.split(";") if args.fault_sets else [args.fault_kinds]
    loop = EventLoopThread()
    clean: dict[str, list[float]] = {"cold": [], "fill": [], "warm": []}
    faulty: dict[str, dict[str, list[float]]] = {k: {"cold": [], "fill": [], "warm": []} for k in sets}
    injected: dict[str, dict[str, int]] = {k: {} for k in sets}
    for r in range(args.rounds):
        for kinds in [None, *sets]:
            names, _, wait = (kinds or "500").partition("@")  # "503@0": Retry-After 0 s instead of 1 s
            proxy = FaultProxy(url_root, rate=0.0 if kinds is None else args.faults, seed=r,
                               kinds=tuple(names.split(",")), retry_after=float(wait or 1))
            loop.run(proxy.start())
            got = _fault_epochs(f"{proxy.url}/cache", work, args, f"{kinds}-{r}")
            into = clean if kinds is None else faulty[kinds]
            for k, v in got.items():
                into[k].append(v)
            for k, v in proxy.faults.items():
                if kinds is not None:
                    injected[kinds][k] = injected[kinds].get(k, 0) + v
            loop.run(proxy.stop())
            figures = ", ".join(f"{k} {v:,.0f}" for k, v in got.items())
            print(f"round {r} {kinds or 'fault-free'}: {figures} img/s (load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
    loop.close()
    out: dict[str, Any] = {"faults_rate": args.faults, "faults_clean_cold_img_s": statistics.median(clean["cold"]),
                           "faults_clean_fill_img_s": statistics.median(clean["fill"]),
                           "faults_clean_warm_img_s": statistics.median(clean["warm"]), "faults_clean": clean,
                           "faults_by_set": {}}
    for kinds in sets:
        row: dict[str, Any] = {"injected": injected[kinds]}
        for kind in ("cold", "fill", "warm"):
            ratios = [f / c for f, c in zip(faulty[kinds][kind], clean[kind], strict=True)]
            row[f"{kind}_img_s"] = faulty[kinds][kind]
            row[f"{kind}_ratio"] = {"median": statistics.median(ratios), "rounds": ratios}
        out["faults_by_set"][kinds] = row
    if len(sets) == 1:  # the keys of a one-set run, as before
        only = out["faults_by_set"][sets[0]]
        out.update(faults_cold_ratio=only["cold_ratio"], faults_warm_ratio=only["warm_ratio"],
                   faults_kinds=sets[0], faults_injected=only["injected"])
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
                   help="comma-separated kinds the proxy draws from (support/fault_proxy.py KINDS)")
    p.add_argument("--fault-sets", default=None,
                   help="';'-separated sets of kinds, each run in every round, e.g. '500;503;stall;500,503,stall'; "
                        "'503@0': the 503s ask for Retry-After: 0 (default 1 s)")
    p.add_argument("--machine", action="store_true", help="record the machine (bench/machine.py) and the commit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    from loaders.dataset import CachedImageDataset, DatasetOptions

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    results: dict[str, Any] = {"n": args.n, "size": args.size, "batch": args.batch, "workers": args.workers,
                               "loadavg_start": os.getloadavg()}
    if args.machine:
        results.update(_provenance())
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
        ds = CachedImageDataset(url, DatasetOptions(local_cache=work / "blocks"))
        rates = epochs(ds, args, max(3, args.epochs))
        results["http_block_cache_cold_img_s"] = rates[0]
        results["http_block_cache_warm_img_s"] = median_warm(rates)
        results["http_block_cache_bytes_vs_needed"] = server.sent / (args.n * row)  # all epochs together
        results["warm_vs_local"] = results["http_block_cache_warm_img_s"] / results["local_img_s"]
        server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(results, args)


def _provenance() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.machine import machine_info

    machine = machine_info()
    git = machine["git"] or {}  # this tree's commit, as bench.machine.git_commit found it
    return {"machine": machine, "git_commit": git.get("commit", "unknown"), "git_dirty": git.get("dirty"),
            "command": " ".join(sys.argv)}


def _report(results: dict[str, Any], args: argparse.Namespace) -> int:
    results["loadavg_end"] = os.getloadavg()
    for k, v in results.items():
        print(f"{k:36s} {json.dumps(v) if isinstance(v, dict) else f'{v:,.2f}' if isinstance(v, float) else v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    main()
