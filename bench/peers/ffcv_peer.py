"""FFCV 1.0.2 as a contender: build a .beton from the file list, or time its Loader. Run by the FFCV
venv's python (bench.peers); see bench.peers.SETTINGS for the settings and why."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MEAN, STD, answer, files, load_groups, parse, square, time_epochs, warm_then_time


class _Images:
    """(uint8 (size, size, 3) array, label) by index, for ``from_indexed_dataset``: the same pixels as every
    other contender's cache (PIL Resize + CenterCrop), so the raw Loader reads fixed-size samples."""

    def __init__(self, items: list[tuple[str, int]], size: int) -> None:
        self.items, self.size = items, size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        return square(path, self.size), label


def build(a) -> None:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    def write(items: list[tuple[str, int]], out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        field = RGBImageField(write_mode=a.mode, max_resolution=a.size, jpeg_quality=90)
        DatasetWriter(str(out / "data.beton"), {"image": field, "label": IntField()},
                      num_workers=a.workers).from_indexed_dataset(_Images(items, a.size), chunksize=100)

    items = files(a.files)
    seconds = warm_then_time(write, items, a.out)
    answer(seconds=seconds, images=len(items), bytes_written=(a.out / "data.beton").stat().st_size)


def load(a) -> None:
    load_groups(a, lambda aug: _epochs(a, aug))


def _epochs(a, aug: bool) -> list[float]:
    import numpy as np
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage

    if aug:
        # FFCV's ImageNet order (ToTensor, ToDevice, ToTorchImage, NormalizeImage) normalises on the GPU; on
        # the CPU, NormalizeImage goes before ToTensor: in 1.0.2 a jitted stage after two non-jitted ones
        # never returns from Loader() (graph.group_operations does not reset its next front).
        image = [RandomResizedCropRGBImageDecoder((a.size, a.size)), RandomHorizontalFlip(),
                 NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255, np.float32), ToTensor(), ToTorchImage()]
    else:
        image = [SimpleRGBImageDecoder(), ToTensor()]  # its fastest decoder: every sample is size x size
    path = a.data / "data.beton"
    with open(path, "rb") as f:  # in the page cache, as every contender's data
        while f.read(16 << 20):
            pass
    loader = Loader(str(path), batch_size=a.batch, num_workers=a.workers, order=OrderOption.RANDOM, os_cache=True,
                    drop_last=False, seed=0, pipelines={"image": image, "label": [IntDecoder(), ToTensor()]})
    return time_epochs(lambda: loader, a.epochs, loader.reader.num_samples)


if __name__ == "__main__":
    args = parse()
    build(args) if args.what == "build" else load(args)
