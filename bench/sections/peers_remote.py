"""Load from a URL, for the peers that read one (MosaicML Streaming) and cachebuild, on the same loopback S3
server (moto, in a process of its own on 127.0.0.1, so neither contender's process serves the bytes).

Each contender reads its own build of the same files from ``s3://bench/<name>`` into a fresh local folder:
cachebuild ``CachedImageDataset(url, local_cache=DIR)`` (its block cache) through a DataLoader with
collate_batch, Streaming ``StreamingDataset(remote=url, local=DIR)`` through its StreamingDataLoader; same
batch, same workers, persistent for both. Epoch 1 is cold (every byte fetched, the workers' start-up
included), the others warm (read from the local folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import peers
from bench.children import ChildError, run_child
from bench.stats import summary

__all__ = ["run_remote_peers"]

BUCKET = "bench"
_SERVE = ("import sys, time\n"
          "from moto.moto_server.threaded_moto_server import ThreadedMotoServer\n"
          "s = ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False)\n"
          "s.start(); print('ready', flush=True)\n"
          "while True: time.sleep(60)\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _s3_server(home: Path) -> Iterator[str]:
    """A moto S3 server in a child process, and the AWS environment that sends every client to it (this
    process's and its children's): dummy credentials, no instance metadata, no user profiles."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url, "S3_ENDPOINT_URL": url,  # the last: Streaming's
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(home / "config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials")}
    saved = {k: os.environ.get(k) for k in (*env, "AWS_PROFILE", "AWS_SESSION_TOKEN")}
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the moto S3 server did not start")
        os.environ.update(env)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(10)


def _upload(folder: Path, key: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            fs.put_file(str(f), f"{BUCKET}/{key}/{f.relative_to(folder).as_posix()}")
    return f"s3://{BUCKET}/{key}"


def _cachebuild_epochs(url: str, cfg: dict[str, Any], epochs: int, local: Path) -> list[float]:
    from torch.utils.data import DataLoader

    from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
    from loaders.sampler import CacheSampler

    ds = CachedImageDataset(url, DatasetOptions(local_cache=local))
    sampler = CacheSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=cfg["workers"],
                    collate_fn=collate_batch, persistent_workers=cfg["workers"] > 0)
    rates = []
    for e in range(epochs):
        sampler.set_epoch(e)
        seen, t0 = 0, time.perf_counter()
        for x, _ in dl:
            seen += len(x)
        if seen != len(ds):
            raise RuntimeError(f"cachebuild from {url}: an epoch delivered {seen} of {len(ds)} samples")
        rates.append(seen / (time.perf_counter() - t0))
    return rates


def _row(label: str, rates: list[float]) -> dict[str, Any]:
    return {"label": label, "cold_img_s": round(rates[0], 1), "warm_img_s": summary(rates[1:], 1)}


def run_remote_peers(cfg: dict[str, Any], outputs: dict[str, Path], work: Path,
                     log: Callable[[str], None]) -> dict[str, Any]:
    """Rows cachebuild_npy_s3 and streaming_s3: cold epoch img/s, warm epochs img/s; ratios cachebuild/peer."""
    epochs = max(2, cfg["epochs"] + 1)
    w = cfg["workers"]
    result: dict[str, Any] = {"batch": cfg["batch"], "workers": w, "epochs": epochs, "rows": {}, "skipped": {}}
    py, why = peers.peer_python("streaming")
    if py is None or "cachebuild_npy" not in outputs:
        result["skipped"]["streaming_s3"] = why or "no cachebuild npy build"
        return result
    scratch = Path(tempfile.mkdtemp(prefix="remote-", dir=work))
    try:
        with _s3_server(scratch) as endpoint:
            ours = _upload(outputs["cachebuild_npy"], "cachebuild")
            theirs = _upload(outputs["streaming_raw"], "mds")
            log(f"  uploaded both builds to {endpoint}")
            rows = result["rows"]
            rows["cachebuild_npy_s3"] = _row(f"cachebuild npy from S3: CachedImageDataset(url, local_cache) + "
                                             f"DataLoader, {w} workers",
                                             _cachebuild_epochs(ours, cfg, epochs, scratch / "blocks"))
            cmd = [py, str(peers.HERE / "streaming_peer.py"), "load", "--remote", theirs, "--size", str(cfg["size"]),
                   "--batch", str(cfg["batch"]), "--workers", str(w), "--epochs", str(epochs)]
            try:
                ans, _ = run_child(cmd, timeout=cfg["child_timeout"], env=dict(os.environ))
                rows["streaming_s3"] = _row(f"Streaming from S3: StreamingDataset(remote, local) + "
                                            f"StreamingDataLoader, {w} workers", ans["groups"]["remote"])
            except ChildError as e:
                result["skipped"]["streaming_s3"] = str(e).splitlines()[0]
                log(f"  streaming_s3: FAILED {e}")
        for key, r in result["rows"].items():
            log(f"  {key}: cold {r['cold_img_s']:.0f} img/s, warm {r['warm_img_s']['median']:.0f} img/s")
        if len(result["rows"]) == 2:
            a, b = result["rows"]["cachebuild_npy_s3"], result["rows"]["streaming_s3"]
            result["x_streaming"] = {"cold": round(a["cold_img_s"] / b["cold_img_s"], 3),
                                     "warm": round(a["warm_img_s"]["median"] / b["warm_img_s"]["median"], 3)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
