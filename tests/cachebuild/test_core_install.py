"""The hard dependencies are enough for the core: a build, info, verify, status and a first batch, in a process
where every optional extra's package is missing (each import of one fails, as where it is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.repo import REPO

# the packages of the extras (pyproject.toml's optional-dependencies), as imported
OPTIONAL = ("fsspec", "s3fs", "aiohttp", "zarr", "numcodecs", "braceexpand", "scipy", "matplotlib", "pyarrow",
            "torchcodec", "dask", "distributed", "lightning", "timm", "skimage", "sklearn", "psutil", "tenacity")

CHILD = """
import sys
missing = set(sys.argv[1].split(","))

class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Missing())
from click.testing import CliRunner
from cachebuild.cli import main
src, out = sys.argv[2], sys.argv[3]
for args in (["imagenet", src, "--size", "48", "--out", out, "-j", "2"], ["info", out + "/train"],
             ["verify", out + "/train"], ["status", out + "/train"]):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (args, r.output, r.exception)
import torch
from loaders import CachedImageDataset, collate_batch
ds = CachedImageDataset(out + "/val")
x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate_batch)))
assert tuple(x.shape) == (8, 48, 48, 3) and x.dtype == torch.uint8
print(sorted(m for m in sys.modules if m.split(".")[0] in missing))
"""


def test_the_core_needs_no_extra(tmp_path: Path) -> None:
    from cachebuild.samples.imagenet_layout import write_imagenet

    write_imagenet(tmp_path / "src", n_classes=3, train_per_class=6, val_per_class=3, seed=0)
    args = [",".join(OPTIONAL), str(tmp_path / "src"), str(tmp_path / "out")]
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"  # not one of them imported
