"""A small /dev/shm (Docker's default is 64 MB): what fits in it still loads, what does not is named.

Each case runs in a child process with its own mount namespace whose /dev/shm is a fresh tmpfs of the
given size (``unshare -m``, as root; ``unshare -rm`` maps an unprivileged user to root there), so the
limit is the kernel's, as in a container.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loaders.dataset import CachedImageDataset, DatasetOptions
from tests.loaders_fixtures import make_cache
from tests.repo import REPO

_UNSHARE = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-rm"]


def _namespace_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run([*_UNSHARE, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


pytestmark = pytest.mark.skipif(not _namespace_ok(), reason="needs mount namespaces (unshare -m) to size a tmpfs")

_PRELUDE = """
import json, sys
import numpy as np, torch
from torch.utils.data import DataLoader
from loaders.batch_ring import ring_stats
from loaders.dataset import CachedImageDataset, DatasetOptions, collate_batch
from tests.loaders_fixtures import decode_index
root = sys.argv[1]
"""


def _run_with_shm(mb: int, script: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (after :data:`_PRELUDE`) where /dev/shm is a tmpfs of ``mb`` MB."""
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(script)
    shell = f'mount -t tmpfs -o size={mb}m tmpfs /dev/shm && exec "$0" -c "$1" "$2"'
    return subprocess.run([*_UNSHARE, "sh", "-c", shell, sys.executable, code, str(root)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)


def _answer(r: subprocess.CompletedProcess[str]) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache_45mb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root, _, _ = make_cache(tmp_path_factory.mktemp("shm") / "c", n=300, h=224, w=224, shard_size=64)
    return root


_EPOCH = """
ds = CachedImageDataset(root, DatasetOptions(in_memory=IN_MEMORY))
dl = DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=collate_batch, shuffle=True,
                persistent_workers=True)
seen = []
for _ in range(2):
    for x, _y in dl:
        seen.append(decode_index(x.numpy()))
print(json.dumps({"in_memory": ds.in_memory, "seen": sorted(np.concatenate(seen).tolist()),
                  "rings": ring_stats()["rings"]}))
"""


def test_auto_leaves_a_small_dev_shm_to_the_batches(cache_45mb: Path) -> None:
    # Fits RAM (and the host's /dev/shm), but would take 45 of Docker's 64 MB and starve the workers.
    assert CachedImageDataset(cache_45mb, DatasetOptions(in_memory="auto")).in_memory
    got = _answer(_run_with_shm(64, _EPOCH.replace("IN_MEMORY", '"auto"').replace("BATCH", "32"), cache_45mb))
    assert not got["in_memory"]
    assert got["seen"] == sorted(list(range(300)) * 2)


def test_rings_stand_aside_where_dev_shm_is_small(cache_45mb: Path) -> None:
    # 2 workers x 5 slots x 9.6 MB would take 96 MB; the fresh batches torch keeps in flight fit 64 MB.
    script = _EPOCH.replace("IN_MEMORY", "False").replace("BATCH", "64")
    got = _answer(_run_with_shm(64, script, cache_45mb))
    assert got["rings"] == 0 and got["seen"] == sorted(list(range(300)) * 2)
    got = _answer(_run_with_shm(1024, script, cache_45mb))  # room enough: the rings are used
    assert got["rings"] == 2 and got["seen"] == sorted(list(range(300)) * 2)


def test_shared_memory_that_does_not_fit_is_named(cache_45mb: Path) -> None:
    r = _run_with_shm(32, "CachedImageDataset(root, DatasetOptions(in_memory=True))", cache_45mb)
    assert r.returncode != 0
    assert "MemoryError: cannot allocate 45.2 MB of shared memory for a whole cache (in_memory=True)" in r.stderr
    assert "/dev/shm has 33.6 MB free" in r.stderr and "--shm-size" in r.stderr and "in_memory=False" in r.stderr

    # A single batch larger than /dev/shm: torch's own path fails too; the error says what to change.
    r = _run_with_shm(16, _EPOCH.replace("IN_MEMORY", "False").replace("BATCH", "128"), cache_45mb)
    assert r.returncode != 0
    assert "shared memory for a batch of shape (128, 224, 224, 3)" in r.stderr
    assert "/dev/shm has" in r.stderr and "--shm-size" in r.stderr and "smaller batch" in r.stderr


def test_auto_splits_dev_shm_between_the_ranks_of_a_node(tmp_path: Path) -> None:
    # torchrun starts LOCAL_WORLD_SIZE ranks at once, each loading its own copy: 20 MB fits half of a
    # 64 MB /dev/shm for one rank, not for each of two.
    root, _, _ = make_cache(tmp_path / "c", n=130, h=224, w=224, shard_size=64)
    script = """
    import os
    got = {}
    for ranks in ("2", "1"):  # 2 first: a copy loaded for 1 rank would itself fill /dev/shm
        os.environ["LOCAL_WORLD_SIZE"] = ranks
        got[ranks] = CachedImageDataset(root, DatasetOptions(in_memory="auto")).in_memory
    print(json.dumps(got))
    """
    assert _answer(_run_with_shm(64, script, root)) == {"2": False, "1": True}
