"""LitData as a contender: ``optimize`` the file list into chunks, or time ``StreamingDataset`` +
``StreamingDataLoader``. Run by the LitData venv's python (bench.peers)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import answer, augment, files, load_groups, parse, square, time_epochs, warm_then_time


def _item(entry: tuple[str, int], size: int) -> dict:
    path, label = entry
    return {"image": square(path, size), "label": int(label)}


def build(a) -> None:
    import litdata

    def write(items: list[tuple[str, int]], out: Path) -> None:
        litdata.optimize(fn=functools.partial(_item, size=a.size), inputs=items, output_dir=str(out),
                         chunk_bytes="64MB", num_workers=a.workers, mode="overwrite")

    items = files(a.files)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    seconds = warm_then_time(write, items, a.out)
    answer(seconds=seconds, images=len(items), bytes_written=len(items) * a.size * a.size * 3)


def load(a) -> None:
    if a.remote:  # from S3 into a fresh cache_dir: epoch 1 downloads every chunk (cold), the others read it (warm)
        import shutil
        import tempfile

        from litdata.streaming import downloader

        # its obstore client refuses a plain-http endpoint (the loopback S3 server; real S3 is https) unless told
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

        cache = Path(tempfile.mkdtemp(prefix="litdata-cache-"))
        try:
            answer(groups={"remote": _epochs(a, False, where=a.remote, cache_dir=str(cache))})
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return
    load_groups(a, lambda augmented: _epochs(a, augmented))


def _epochs(a, augmented: bool, where: str | None = None, cache_dir: str | None = None) -> list[float]:
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    aug = augment(a.size) if augmented else None

    class Images(StreamingDataset):
        def __getitem__(self, index):
            s = super().__getitem__(index)
            x = torch.from_numpy(s["image"])
            return (aug(x.permute(2, 0, 1)) if aug else x), s["label"]

    ds = Images(where or str(a.data), shuffle=True, drop_last=False, seed=0, cache_dir=cache_dir)
    dl = StreamingDataLoader(ds, batch_size=a.batch, num_workers=a.workers)
    return time_epochs(lambda: dl, a.epochs, len(ds))


if __name__ == "__main__":
    args = parse()
    build(args) if args.what == "build" else load(args)
