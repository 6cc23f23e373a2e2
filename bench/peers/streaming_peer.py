"""MosaicML Streaming as a contender: MDS shards written by ``MDSWriter`` (one writer per process, then
``merge_index``), read by ``StreamingDataset`` + ``StreamingDataLoader`` from the local folder, or from an
S3 URL (``--remote``: the harness's loopback S3 server) into a fresh local folder: a cold epoch that
downloads the shards, then warm ones. Run by the Streaming venv's python (bench.peers)."""

from __future__ import annotations

import multiprocessing
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import answer, augment, files, load_groups, parse, square, time_epochs, warm_then_time


def _write(job: tuple[int, list[tuple[str, int]], str, int]) -> int:
    from streaming import MDSWriter

    worker, items, out, size = job
    columns = {"image": f"ndarray:uint8:{size},{size},3", "label": "int"}
    with MDSWriter(out=f"{out}/{worker}", columns=columns, compression=None, size_limit="64mb",
                   progress_bar=False) as sink:
        for path, label in items:
            sink.write({"image": square(path, size), "label": int(label)})
    return len(items)


def build(a) -> None:
    from streaming.base.util import merge_index

    def write(entries: list[tuple[str, int]], out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        parts = [entries[w :: a.workers] for w in range(a.workers)]
        with multiprocessing.get_context("fork").Pool(a.workers) as pool:  # Streaming's parallel recipe
            pool.map(_write, [(w, parts[w], str(out), a.size) for w in range(a.workers)])
        merge_index(str(out), keep_local=True)

    items = files(a.files)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    seconds = warm_then_time(write, items, a.out)
    answer(seconds=seconds, images=len(items), bytes_written=sum(f.stat().st_size for f in a.out.rglob("*.mds")))


class _State:
    aug = None


def _dataset(a, **where):
    import torch
    from streaming import StreamingDataset

    class Images(StreamingDataset):
        def __getitem__(self, index):
            s = super().__getitem__(index)
            x = torch.from_numpy(s["image"])
            return (_State.aug(x.permute(2, 0, 1)) if _State.aug else x), s["label"]

    return Images(shuffle=True, shuffle_seed=0, batch_size=a.batch, **where)


def _loader(a, ds):
    from streaming import StreamingDataLoader

    # workers started once, kept across epochs (as the harness's own loaders)
    return StreamingDataLoader(ds, batch_size=a.batch, num_workers=a.workers, persistent_workers=a.workers > 0)


def load(a) -> None:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    if a.remote:
        local = Path(tempfile.mkdtemp(prefix="streaming-local-"))
        try:
            ds = _dataset(a, remote=a.remote, local=str(local))
            # epoch 1 downloads every shard (cold), the others read them from the local folder (warm)
            dl = _loader(a, ds)
            answer(groups={"remote": time_epochs(lambda: dl, a.epochs, len(ds))})
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return
    ds = _dataset(a, local=str(a.data))

    def epochs_of(augmented: bool) -> list[float]:
        _State.aug = augment(a.size) if augmented else None  # before the loader forks its workers
        dl = _loader(a, ds)
        return time_epochs(lambda: dl, a.epochs, len(ds))
    load_groups(a, epochs_of)


if __name__ == "__main__":
    args = parse()
    build(args) if args.what == "build" else load(args)
