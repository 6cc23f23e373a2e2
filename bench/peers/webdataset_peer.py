"""WebDataset as a contender: tar shards of .npy samples written by `workers` processes, or time
``WebDataset`` + ``WebLoader``. Run by the WebDataset venv's python (bench.peers)."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import answer, augment, files, load_groups, parse, square, time_epochs, warm_then_time


def _write(job: tuple[int, list[tuple[int, str, int]], str, int, int]) -> int:
    import webdataset as wds

    worker, items, out, size, per_shard = job
    with wds.ShardWriter(f"{out}/w{worker}-%06d.tar", maxcount=per_shard, verbose=0) as sink:
        for i, path, label in items:
            sink.write({"__key__": f"{i:08d}", "npy": square(path, size), "cls": label})
    return len(items)


def build(a) -> None:
    def write(entries: list[tuple[str, int]], out: Path) -> None:
        items = [(i, p, k) for i, (p, k) in enumerate(entries)]
        out.mkdir(parents=True, exist_ok=True)
        per_shard = max(1, len(items) // (8 * a.workers))  # >= 8 shards a worker: every loader worker gets some
        parts = [items[w :: a.workers] for w in range(a.workers)]
        with multiprocessing.get_context("fork").Pool(a.workers) as pool:
            done = sum(pool.map(_write, [(w, parts[w], str(out), a.size, per_shard) for w in range(a.workers)]))
        (out / "count.json").write_text(json.dumps(done))

    items = files(a.files)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    seconds = warm_then_time(write, items, a.out)
    answer(seconds=seconds, images=len(items), bytes_written=sum(f.stat().st_size for f in a.out.glob("*.tar")))


def load(a) -> None:
    if a.remote:
        _remote(a)
        return
    load_groups(a, lambda augmented: _epochs(a, augmented))


def _remote(a) -> None:
    """The shards at ``--remote`` (names from the build folder ``--data``): HTTP through WebDataset's own curl
    opener, S3 through its documented ``pipe:aws s3 cp URL -``; ``cache_dir`` (its shard cache) a fresh
    folder, so epoch 1 downloads every shard (cold) and the others read them from it (warm)."""
    import os
    import shutil
    import tempfile

    names = sorted(p.name for p in a.data.glob("*.tar"))
    if a.remote.startswith("s3://"):
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        urls = [f"pipe:aws s3 cp --quiet --endpoint-url {endpoint} {a.remote}/{n} -" for n in names]
    else:
        urls = [f"{a.remote}/{n}" for n in names]
    cache = Path(tempfile.mkdtemp(prefix="wds-cache-"))
    try:
        answer(groups={"remote": _epochs(a, False, urls=urls, cache_dir=str(cache))})
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _epochs(a, augmented: bool, urls: list[str] | None = None, cache_dir: str | None = None) -> list[float]:
    import torch
    import webdataset as wds

    urls = urls or sorted(str(p) for p in a.data.glob("*.tar"))
    n = json.loads((a.data / "count.json").read_text())
    aug = augment(a.size) if augmented else None

    def image(x):
        t = torch.from_numpy(x)
        return aug(t.permute(2, 0, 1)) if aug else t

    ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, cache_dir=cache_dir).shuffle(1000).decode()
          .to_tuple("npy", "cls").map_tuple(image, None).batched(a.batch, partial=True))
    dl = wds.WebLoader(ds, batch_size=None, num_workers=a.workers)
    return time_epochs(lambda: dl, a.epochs, n)


if __name__ == "__main__":
    args = parse()
    build(args) if args.what == "build" else load(args)
