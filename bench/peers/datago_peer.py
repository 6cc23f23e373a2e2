"""datago (Photoroom's Rust loader) as a contender: its file source over the JPEG folder, decoded every
epoch by its Rust threads (``DATAGO_MAX_TASKS`` = the worker count); raw: its own crop-and-resize into the
square bucket; augmented: full-size images from it, then torchvision v2 per sample in Python (datago has
no augmentation of its own). Samples come one at a time; batches are stacked here. No cache writer.
Run by the datago venv's python (bench.peers)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import augment, files, load_groups, parse, time_epochs


def _epochs(a, aug: bool) -> list[float]:
    import datago
    import torch

    items = files(a.files)
    root = Path(os.path.commonpath([p for p, _ in items]))
    label_of = {p: k for p, k in items}
    config = {"source_type": "file", "limit": len(items), "samples_buffer_size": 4 * a.batch,
              "source_config": {"root_path": str(root), "random_sampling": True, "rank": 0, "world_size": 1}}
    if not aug:  # every image into the one square bucket: centre crop to 1:1, resize to size
        config["image_config"] = {"crop_and_resize": True, "default_image_size": a.size, "downsampling_ratio": 32,
                                  "min_aspect_ratio": 1.0, "max_aspect_ratio": 1.0, "pre_encode_images": False}
    client = datago.DatagoClient(json.dumps(config))
    tf = augment(a.size) if aug else None

    def epoch():
        client.start()  # one pass; get_sample answers None at its end
        xs, ys = [], []
        while (s := client.get_sample()) is not None:
            x = torch.from_numpy(s.image.to_numpy_array())
            xs.append(tf(x.permute(2, 0, 1)) if tf else x)
            ys.append(label_of[s.id.strip('"')])
            if len(xs) == a.batch:
                yield torch.stack(xs), torch.tensor(ys)
                xs, ys = [], []
        if xs:
            yield torch.stack(xs), torch.tensor(ys)

    return time_epochs(epoch, a.epochs, len(items))


if __name__ == "__main__":
    args = parse()
    if args.what == "build":
        raise SystemExit("datago has no cache writer: it decodes the JPEGs every epoch")
    os.environ["DATAGO_MAX_TASKS"] = str(args.workers)
    load_groups(args, lambda aug: _epochs(args, aug))
