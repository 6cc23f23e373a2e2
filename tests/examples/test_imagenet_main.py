"""examples/imagenet_main.py, PyTorch's imagenet/main.py ported to the cache (docs/porting.md), run as a user runs
it: on caches built from the built-in sample, two short epochs on the CPU (``--no-accel``), in a child process.

The child records what a wrong port would get wrong: the train sampler's order each epoch (every sample of the
train cache once per epoch, a new order each epoch: upstream calls ``set_epoch`` only under DDP) and what the model
is given (float batches at the crop, normalised from the uint8 batches on the device, every sample of each cache:
the train transform in ``train()``, the eval transform in the CPU path of ``validate()``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cachebuild
from cachebuild.samples.imagenet_layout import write_imagenet
from tests.repo import REPO

CROP = 28  # caches at round(28 / 0.875) = 32 px, as the script's --crop help says
BATCH = 4

# The script's own main(), with its train sampler and its model recorded; upstream's code runs unchanged.
DRIVER = """
import json, sys
from examples import imagenet_main as port

orders, inputs = [], []

class RecordingSampler(port.CacheSampler):
    def __iter__(self):
        order = []
        orders.append(order)
        for i in super().__iter__():
            order.append(i)
            yield i

def recording_resnet18(**kw):
    model = make(**kw)
    def record(module, args):
        x = args[0]
        inputs.append({"training": module.training, "dtype": str(x.dtype), "shape": list(x.shape),
                       "device": x.device.type, "min": float(x.min()), "max": float(x.max())})
    model.register_forward_pre_hook(record)
    return model

make = port.models.resnet18
port.models.__dict__["resnet18"] = recording_resnet18
port.CacheSampler = RecordingSampler
sys.argv = ["imagenet_main.py", *sys.argv[1:]]
port.main()
print("RECORD " + json.dumps({"orders": [o for o in orders if o], "inputs": inputs}))
"""


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ and val/ caches of the built-in sample (its quirks and broken files included), at 32 px."""
    tmp = tmp_path_factory.mktemp("imagenet_main")
    write_imagenet(tmp / "sample", n_classes=3, train_per_class=4, val_per_class=1, val_layout="folders", seed=0,
                   quirks=True, broken=True)
    cachebuild.build("imagenet", tmp / "sample", tmp / "caches", size=round(CROP / 0.875))
    return tmp / "caches"


def run_port(caches: Path, workdir: Path, *args: str) -> tuple[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", DRIVER, str(caches), *args], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record = next(line for line in r.stdout.splitlines() if line.startswith("RECORD "))
    return r.stdout, json.loads(record.removeprefix("RECORD "))


def test_the_port_trains_and_validates_every_sample_reshuffled_each_epoch(caches: Path, tmp_path: Path) -> None:
    n_train, n_val = len(cachebuild.open(caches / "train")), len(cachebuild.open(caches / "val"))
    assert n_train > BATCH and n_val > 0
    out, rec = run_port(caches, tmp_path, "--crop", str(CROP), "-b", str(BATCH), "--epochs", "2", "-j", "0",
                        "--lr", "0.01", "--seed", "0", "--no-accel", "-p", "1")
    assert "Using device: cpu" in out

    # the sampler: each epoch every train sample once, and a new order in the second epoch
    orders = rec["orders"]
    assert len(orders) == 2
    assert all(sorted(order) == list(range(n_train)) for order in orders)
    assert orders[0] != orders[1]

    # the model: float32 batches at the crop, normalised (ImageNet's mean and std put 0..255 in about -2.1..2.7)
    inputs = rec["inputs"]
    assert {(x["dtype"], x["device"], tuple(x["shape"][1:])) for x in inputs} == {("torch.float32", "cpu",
                                                                                    (3, CROP, CROP))}
    assert all(x["min"] > -2.2 and x["max"] < 2.7 for x in inputs)
    assert max(x["max"] for x in inputs) > 1.0 and min(x["min"] for x in inputs) < -1.0  # not in 0..1 either
    # train() then validate() each epoch, each over its whole cache
    per_pass = []
    for x in inputs:
        if not per_pass or per_pass[-1][0] != x["training"]:
            per_pass.append([x["training"], 0])
        per_pass[-1][1] += x["shape"][0]
    assert per_pass == [[True, n_train], [False, n_val], [True, n_train], [False, n_val]]

    # what upstream prints: two epochs of progress, and validate()'s summary after each
    assert len(re.findall(rf"^Epoch: \[[01]\]\[\s*{-(-n_train // BATCH)}/{-(-n_train // BATCH)}\]", out,
                          re.M)) == 2
    summaries = re.findall(r"^ \*\s+Acc@1 ([\d.]+) Acc@5 ([\d.]+)$", out, re.M)
    assert len(summaries) == 2 and all(0.0 <= float(v) <= 100.0 for pair in summaries for v in pair)
    assert (tmp_path / "checkpoint.pth.tar").is_file()
