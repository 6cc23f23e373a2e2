"""Load from a URL: cachebuild and the peers that read one (MosaicML Streaming, LitData, WebDataset), each from
its own build of the same files on the same loopback store: moto's S3, and an aiohttp HTTP server
(``support.http_server``), each in a process of its own on 127.0.0.1, so no contender's process serves bytes.

cachebuild reads ``CachedImageDataset(url, DatasetOptions(local_cache=DIR))`` (its block cache) through a
DataLoader with collate_batch, three times from a fresh DIR: shuffled (``CacheSampler(shuffle=True)``: every
row fetched as its batch needs it), shard-windowed (``CacheSampler(shard_window=4)``: shards shuffled, then rows
within groups of 4 shards, each shard fetched whole; not a uniform shuffle, as Streaming's block shuffle is not)
and sequential (``shuffle=False``: the shards read ahead whole, ``cachebuild.storage.remote.block_cache.Readahead``).
The peers read with their own local copy: Streaming
``StreamingDataset(remote=url, local=DIR)``, LitData ``StreamingDataset(url, cache_dir=DIR)``, WebDataset
``WebDataset(urls, cache_dir=DIR)`` (S3 through ``pipe:aws s3 cp``, HTTP through its curl opener); every peer
shuffles. The row ``cachebuild_npy_serve`` reads the same cache with the same loader as the shuffled S3 row, from
``cachebuild serve`` (a child process, with a bearer token). Same batch, same workers. Epoch 1 is cold (every
byte fetched, the workers' start-up included), the others warm (read from the local copy). Ratios: cachebuild's
faster cold (and warm) row of that store against each peer's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
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

__all__ = ["run_remote_peers", "serve_row"]

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


_SERVE_HTTP = ("import sys, time\n"
               "from pathlib import Path\n"
               "from support.http_server import HttpServer\n"
               "from support.loopback import EventLoopThread\n"
               "loop = EventLoopThread(); s = HttpServer(Path(sys.argv[1])); loop.run(s.start())\n"
               "s.log = type(s.log)(); s.log.append = lambda item: None  # an epoch's requests: not kept\n"
               "print(s.url, flush=True)\n"
               "while True: time.sleep(60)\n")


@contextlib.contextmanager
def _http_server(root: Path) -> Iterator[str]:
    """``support.http_server`` serving ``root`` in a child process; yields its base URL."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_HTTP, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=repo)
    try:
        url = proc.stdout.readline().strip() if proc.stdout is not None else ""
        if not url.startswith("http://"):
            raise RuntimeError("the loopback HTTP server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


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
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def _serve(root: Path, scratch: Path) -> Iterator[str]:
    """``cachebuild serve ROOT`` in a child process, with a token of its own, which this process's environment
    holds meanwhile (``CACHEBUILD_HTTP_TOKEN``: the loader's workers inherit it); yields the server's base URL."""
    repo = Path(__file__).resolve().parents[2]
    token = secrets.token_hex(16)
    token_file = scratch / "serve-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "cachebuild", "serve", str(root), "--token-file", str(token_file),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=repo)
    saved = os.environ.get("CACHEBUILD_HTTP_TOKEN")
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if " at http://" not in line:
            raise RuntimeError("`cachebuild serve` did not start")
        os.environ["CACHEBUILD_HTTP_TOKEN"] = token
        yield line.split(" at ", 1)[1].split("/ ", 1)[0]
    finally:
        if saved is None:
            os.environ.pop("CACHEBUILD_HTTP_TOKEN", None)
        else:
            os.environ["CACHEBUILD_HTTP_TOKEN"] = saved
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def serve_row(cache: Path, cfg: dict[str, Any], epochs: int, scratch: Path) -> dict[str, Any]:
    """The row of ``cache`` read from ``cachebuild serve`` (its parent folder served) as the S3 row reads it from
    S3: the same loader, shuffled, with a block cache; epoch 1 cold."""
    with _serve(cache.parent, scratch) as base:
        rates = _cachebuild_epochs(f"{base}/{cache.name}", cfg, epochs, scratch / "blocks-serve", True)
    return _row(f"cachebuild npy from `cachebuild serve` (HTTP, bearer token): CachedImageDataset(url, local_cache) "
                f"+ DataLoader, {cfg['workers']} workers, shuffled", rates)


def _upload(folder: Path, key: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            fs.put_file(str(f), f"{BUCKET}/{key}/{f.relative_to(folder).as_posix()}")
    return f"s3://{BUCKET}/{key}"


def _cachebuild_epochs(url: str, cfg: dict[str, Any], epochs: int, local: Path, shuffle: bool,
                       shard_window: int | None = None) -> list[float]:
    from torch.utils.data import DataLoader

    from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
    from loaders.sampler import CacheSampler

    ds = CachedImageDataset(url, DatasetOptions(local_cache=local))
    sampler = CacheSampler(ds, shuffle=shuffle, seed=0, shard_window=shard_window)
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


# (peer, its build output, the stores it reads, its label)
_PEERS = (("streaming", "streaming_raw", ("s3",), "Streaming: StreamingDataset(remote, local) + StreamingDataLoader"),
          ("litdata", "litdata_raw", ("s3",), "LitData: StreamingDataset(url, cache_dir) + StreamingDataLoader"),
          ("webdataset", "webdataset_raw", ("s3", "http"), "WebDataset: WebDataset(urls, cache_dir) + WebLoader"))
_STORES = {"s3": "S3", "http": "HTTP"}
SHARD_WINDOW = 4  # shards shuffled together in the windowed row (Streaming's shuffle block is several shards)
# (shuffle, shard_window, row key suffix, how)
_ORDERS = ((True, None, "", "shuffled"),
           (True, SHARD_WINDOW, "_windowed",
            f"shard-windowed shuffle (shard_window={SHARD_WINDOW}), shards fetched whole"),
           (False, None, "_sequential", "sequential, shards read ahead"))


def _ours(result: dict[str, Any], store: str, url: str, cfg: dict[str, Any], epochs: int, scratch: Path) -> None:
    w = cfg["workers"]
    for shuffle, window, suffix, how in _ORDERS:
        result["rows"][f"cachebuild_npy_{store}{suffix}"] = _row(
            f"cachebuild npy from {_STORES[store]}: CachedImageDataset(url, local_cache) + DataLoader, {w} workers, "
            f"{how}", _cachebuild_epochs(url, cfg, epochs, scratch / f"blocks-{store}{suffix}", shuffle, window))


def _peer(result: dict[str, Any], peer: str, store: str, url: str, data: Path, label: str, cfg: dict[str, Any],
          epochs: int, log: Callable[[str], None]) -> None:
    key = f"{peer}_{store}"
    py, why = peers.peer_python(peer)
    if py is None:
        result["skipped"][key] = why
        return
    cmd = [py, str(peers.HERE / f"{peer}_peer.py"), "load", "--remote", url, "--data", str(data), "--size",
           str(cfg["size"]), "--batch", str(cfg["batch"]), "--workers", str(cfg["workers"]), "--epochs", str(epochs)]
    try:
        ans, _ = run_child(cmd, timeout=cfg["child_timeout"], env=dict(os.environ))
        result["rows"][key] = _row(f"{label} from {_STORES[store]}, {cfg['workers']} workers", ans["groups"]["remote"])
    except ChildError as e:
        result["skipped"][key] = str(e).splitlines()[0]
        log(f"  {key}: FAILED {e}")


def _ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each peer row against cachebuild's faster row of the same store, cold and warm."""
    rows, out = result["rows"], {}
    for key, r in rows.items():
        if key.startswith("cachebuild_"):
            continue
        store = key.rsplit("_", 1)[1]
        ours = [v for k, v in rows.items() if k.startswith(f"cachebuild_npy_{store}")]
        if not ours:
            continue
        cold = max(o["cold_img_s"] for o in ours)
        warm = max(o["warm_img_s"]["median"] for o in ours)
        out[key] = {"cold": round(cold / r["cold_img_s"], 3), "warm": round(warm / r["warm_img_s"]["median"], 3)}
    return out


def run_remote_peers(cfg: dict[str, Any], outputs: dict[str, Path], work: Path,
                     log: Callable[[str], None]) -> dict[str, Any]:
    """Rows cachebuild_npy_{s3,http}[_windowed|_sequential], cachebuild_npy_serve (shuffled, as the S3 row) and
    {peer}_{store}: cold epoch img/s, warm epochs img/s;
    ``x``: cachebuild / peer per peer row (cachebuild's faster row of that store)."""
    epochs = max(2, cfg["epochs"] + 1)
    result: dict[str, Any] = {"batch": cfg["batch"], "workers": cfg["workers"], "epochs": epochs, "rows": {},
                              "skipped": {}}
    if "cachebuild_npy" not in outputs:
        result["skipped"]["cachebuild_npy"] = "no cachebuild npy build"
        return result
    scratch = Path(tempfile.mkdtemp(prefix="remote-", dir=work))
    try:
        with _s3_server(scratch) as endpoint:
            _ours(result, "s3", _upload(outputs["cachebuild_npy"], "cachebuild"), cfg, epochs, scratch)
            for peer, build, stores, label in _PEERS:
                if "s3" in stores and build in outputs and cfg["peers"]:
                    _peer(result, peer, "s3", _upload(outputs[build], peer), outputs[build], label, cfg, epochs, log)
            log(f"  S3 at {endpoint}: done")
        # the same cache and loader from `cachebuild serve`, a team's store without object storage
        result["rows"]["cachebuild_npy_serve"] = serve_row(outputs["cachebuild_npy"], cfg, epochs, scratch)
        with _http_server(work) as base:
            def url(folder: Path) -> str:
                return f"{base}/{folder.resolve().relative_to(work.resolve()).as_posix()}"

            _ours(result, "http", url(outputs["cachebuild_npy"]), cfg, epochs, scratch)
            for peer, build, stores, label in _PEERS:
                if "http" in stores and build in outputs and cfg["peers"]:
                    _peer(result, peer, "http", url(outputs[build]), outputs[build], label, cfg, epochs, log)
        for key, r in result["rows"].items():
            log(f"  {key}: cold {r['cold_img_s']:.0f} img/s, warm {r['warm_img_s']['median']:.0f} img/s")
        result["x"] = _ratios(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
