"""SPDL (Meta) as a contender: its thread pipeline (``PipelineBuilder``: stages that release the GIL) over
the JPEG files, decoded every epoch by ``spdl.io.load_image`` (FFmpeg) with the resize and crop in FFmpeg's
filter graph; SPDL has no cache writer. Run by the SPDL venv's python (bench.peers)."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MEAN, STD, files, load_groups, parse, time_epochs


def _raw_filter(size: int) -> str:
    # Resize(size) on the short side + CenterCrop(size): what every cache stores
    return (f"scale=w={size}:h={size}:force_original_aspect_ratio=increase:flags=bicubic,"
            f"crop={size}:{size},format=rgb24")


def _rrc_filter(size: int, rng: random.Random) -> str:
    """RandomResizedCrop (area 8-100%, aspect 3/4-4/3, clamped to the image) + a coin-flip mirror, in the
    filter graph: FFmpeg crops before it scales, so only the crop is resized."""
    area = rng.uniform(0.08, 1.0)
    ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    u, v = rng.random(), rng.random()
    crop = (f"crop=w='min(iw,sqrt({area}*iw*ih*{ratio}))':h='min(ih,sqrt({area}*iw*ih/{ratio}))'"
            f":x='(iw-ow)*{u}':y='(ih-oh)*{v}'")
    return f"{crop},scale={size}:{size}:flags=bilinear" + (",hflip" if rng.random() < 0.5 else "") + ",format=rgb24"


def _epochs(a, aug: bool) -> list[float]:
    import numpy as np
    import spdl.io
    import torch
    from spdl.pipeline import PipelineBuilder

    items = files(a.files)
    rng = random.Random(0)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255

    def decode(item: tuple[str, int]):
        path, label = item
        desc = _rrc_filter(a.size, rng) if aug else _raw_filter(a.size)
        return spdl.io.to_numpy(spdl.io.load_image(path, filter_desc=desc)), label

    def collate(batch):
        x = torch.from_numpy(np.stack([b[0] for b in batch]))
        y = torch.tensor([b[1] for b in batch])
        if aug:  # to float CHW and normalise on the batch (torch releases the GIL)
            x = (x.permute(0, 3, 1, 2).float() - mean) / std
        return x, y

    def epoch():
        order = list(items)
        rng.shuffle(order)
        pipe = (PipelineBuilder().add_source(order).pipe(decode, concurrency=a.workers, output_order="completion")
                .aggregate(a.batch).pipe(collate).add_sink(3).build(num_threads=a.workers))
        with pipe.auto_stop():
            yield from pipe.get_iterator(timeout=600)

    return time_epochs(epoch, a.epochs, len(items))


if __name__ == "__main__":
    args = parse()
    if args.what == "build":
        raise SystemExit("SPDL has no cache writer: it decodes the JPEGs every epoch")
    load_groups(args, lambda aug: _epochs(args, aug))
