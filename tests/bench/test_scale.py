"""The scale harness (bench/scale/) on a 20k-file ImageNet-shaped tree of the same generator: every step runs
and checks out, the kill-and-resume, val and Dask checks pass, and no reader or worker grows with N. Slow (a few
minutes on 2 cores): `make test-all`. The tree generator's counts are checked in the default run."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from bench.scale import tree
from bench.scale.harness import run
from bench.scale.steps import cpu_seconds_of_tree
from bench.scale.targets import check_targets


def test_class_counts_have_the_real_total_and_range():
    counts = tree.class_counts()
    assert counts.sum() == tree.FULL_TRAIN and len(counts) == tree.N_CLASSES
    assert counts.min() == tree.MIN_PER_CLASS and counts.max() == tree.MAX_PER_CLASS
    sub = tree.subset_counts(10_000, counts)
    assert sub.sum() == 10_000 and sub.min() >= 1 and np.all(sub <= counts)
    assert tree.wnid_list() == sorted(tree.wnid_list()) and len(set(tree.wnid_list())) == tree.N_CLASSES


@pytest.mark.slow
def test_the_scale_harness_on_a_20k_tree(tmp_path):
    full = tree.full_tree(tmp_path / "imagenet-20000", total=20_000, n_val=1_000, n_classes=1_000)
    files = [os.path.join(d, f) for d, _, fs in os.walk(full / "train") for f in fs]
    assert len(files) == 20_000 and len(os.listdir(full / "val")) == 1_000
    digests = {hashlib.sha1(Path(f).read_bytes()).digest() for f in files}
    assert len(digests) == 20_000  # every crop distinct
    out = tmp_path / "results"
    res = run([5_000, 20_000], 32, tmp_path, out, jobs=2, shard_size=512, timeout=900, full=full)
    assert {p.name for p in out.iterdir()} == {"scale.json", "scale.md", "scale.png"}
    assert json.loads((out / "scale.json").read_text())["curves"][1]["n"] == 20_000
    by_name = {t["target"].split(" at N=")[0]: t for t in res["targets"]}
    # rates on a shared 2-core box: measured, not asserted here; so is the --update's share of the full build,
    # whose start-up (~0.3 s) is a tenth of a 20k build's few seconds (the 5% holds at the harness's real N)
    timing = ("build img/s", "spawn first batch", "Dask build img/s", "--update of 10 touched files")
    failed = [t for name, t in by_name.items() if not t["passed"] and not name.startswith(timing)]
    assert not failed, failed
    update = res["update"]
    assert "error" not in update and (update["decoded"], update["reused"]) == (10, 19_990), update
    assert res["kill"]["blocks_kept"] >= 0.6 * res["kill"]["blocks_total"]
    assert res["val"]["count"] == 1_000 and res["val"]["same_classes"]


def _burn(seconds: float) -> list[str]:
    loop = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {seconds}: pass"
    return [sys.executable, "-c", loop]


def test_a_step_counts_the_cpu_of_its_live_and_reaped_children():
    before = cpu_seconds_of_tree()
    subprocess.run(_burn(0.4), check=True)  # reaped: counted through RUSAGE_CHILDREN
    live = subprocess.Popen([*_burn(0.4)[:2], _burn(0.4)[2] + "\ninput()"], stdin=subprocess.PIPE)
    try:
        time.sleep(0.1)
        while sum(psutil.Process(live.pid).cpu_times()[:2]) < 0.4:  # alive, its CPU spent: a loky worker's state
            time.sleep(0.05)
        assert cpu_seconds_of_tree() - before >= 0.75
    finally:
        live.communicate(b"\n", timeout=30)


def test_the_rate_target_shows_cpu_per_image_but_passes_on_the_wall_clock():
    def point(n: int, rate: float, cpu: float) -> dict[str, object]:
        return {"n": n, "build": {"img_per_s": rate, "cpu_us_per_img": cpu}}

    slow_box = check_targets({"curves": [point(10_000, 7000, 210), point(300_000, 5000, 110)]})[0]
    assert slow_box["measured"] == "0.71x (5,000 vs 7,000 img/s; CPU 110 vs 210 us/img)"
    assert not slow_box["passed"]  # the figure the issue sets is the wall-clock one
    old = check_targets({"curves": [point(10_000, 7000, 0), point(300_000, 7000, 0)]})[0]
    assert old["measured"] == "1.00x (7,000 vs 7,000 img/s)" and old["passed"]  # results without the CPU figure
