"""The whole run through the CLI: it learns, resumes exactly after a hard kill, runs under torchrun,
and refuses bad input with one line before training starts."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cachebuild.errors import OptionError
from cachebuild.storage.cache import write_cache
from loaders.train.cli import train
from loaders.train.config import TrainConfig
from loaders.train.run.fit import STOP_EXIT_CODE
from tests.train_fixtures import CLASSES, _colour_images
from tests.trees import tree_bytes


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("caches")
    tr, ytr = _colour_images(96, seed=0)
    va, yva = _colour_images(40, seed=1)
    out = {"train": root / "train", "val": root / "val", "val_other": root / "val_other"}
    write_cache(out["train"], tr, ytr, CLASSES, shard_size=40)
    write_cache(out["val"], va, yva, CLASSES, split="val")
    write_cache(out["val_other"], va, yva, ["red", "green", "blue", "purple"], split="val")
    return out


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "loaders.train", *args], capture_output=True, text=True,
                          env=e, timeout=300)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread here, as in the ``OMP_NUM_THREADS=1`` processes of :func:`_cli`: the same kernels, so
    runs in either place can be compared bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


RESUME_ARGS = ["--model", "tiny_cnn", "--epochs", "2", "--batch-size", "8", "--accum", "2",
               "--lr", "0.05", "--workers", "0", "--device", "cpu", "--amp", "off", "--seed", "3",
               "--augment", "imagenet", "--deterministic", "--log-every", "2", "--ckpt-every", "2"]


def test_resume_after_hard_kill_equals_uninterrupted_run(caches: dict[str, Path], tmp_path: Path) -> None:
    # 96 images / 8 = 12 micro-batches = 6 optimizer steps per epoch; 12 steps in all.
    # Only the kills need processes of their own (1 thread each); the runs that end run here, on 1 thread too.
    full, cut = tmp_path / "full", tmp_path / "cut"
    with _one_thread():
        res = _invoke(str(caches["train"]), "--out", str(full), *RESUME_ARGS)
    assert res.exit_code == 0, res.output
    # Killed at step 5 (last checkpoint: step 4, mid-epoch 1), resumed, killed at step 9 (checkpoint 8,
    # mid-epoch 2), resumed to the end.
    r = _cli(str(caches["train"]), "--out", str(cut), *RESUME_ARGS, "--stop-after-steps", "5")
    assert r.returncode == STOP_EXIT_CODE, r.stderr
    state = torch.load(cut / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["batch"], state["global_step"]) == (0, 8, 4)
    assert state["sampler"]["position"] == 64
    r = _cli(str(caches["train"]), "--out", str(cut), *RESUME_ARGS, "--resume", "--stop-after-steps", "9")
    assert r.returncode == STOP_EXIT_CODE, r.stderr
    assert "resumed from" in r.stdout
    with _one_thread():
        res = _invoke(str(caches["train"]), "--out", str(cut), *RESUME_ARGS, "--resume")
    assert res.exit_code == 0, res.output
    a, b = _weights(full), _weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    fs, cs = (torch.load(p / "checkpoint.pt", weights_only=True) for p in (full, cut))
    assert fs["global_step"] == cs["global_step"] == 12
    for k in fs["optimizer"]["state"]:
        torch.testing.assert_close(cs["optimizer"]["state"][k]["momentum_buffer"],
                                   fs["optimizer"]["state"][k]["momentum_buffer"], rtol=0, atol=0)
    assert cs["scheduler"]["last_epoch"] == fs["scheduler"]["last_epoch"] == 12


MIXED_ARGS = ["--model", "tiny_cnn", "--epochs", "2", "--batch-size", "8", "--lr", "0.05", "--workers", "0",
              "--device", "cpu", "--amp", "off", "--seed", "3", "--augment", "imagenet", "--crop", "24",
              "--mixup", "0.8", "--cutmix", "1.0", "--label-smoothing", "0.1", "--deterministic", "--ckpt-every", "2"]


def test_resume_refuses_any_change_to_training_and_needs_only_the_run_folder(caches: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """A resumed run trains as it started: a changed crop, mixing, smoothing or augmentation place was taken
    silently (and written to config.json); the run folder alone holds every option, so it is enough."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    with _one_thread():
        assert _invoke(str(caches["train"]), "--out", str(full), *MIXED_ARGS).exit_code == 0
    r = _cli(str(caches["train"]), "--out", str(cut), *MIXED_ARGS, "--stop-after-steps", "5")
    assert r.returncode == STOP_EXIT_CODE, r.stderr
    before = tree_bytes(cut)
    for change, said in ((["--crop", "16"], "crop: checkpoint 24 vs now 16"),
                         (["--mixup", "0"], "mixup: checkpoint 0.8 vs now 0.0"),
                         (["--cutmix", "0.5"], "cutmix: checkpoint 1.0 vs now 0.5"),
                         (["--label-smoothing", "0"], "label_smoothing: checkpoint 0.1 vs now 0.0"),
                         (["--augment-in", "workers"], "augment_in: checkpoint 'device' vs now 'workers'"),
                         (["--augment", "none"], "augment: checkpoint 'imagenet' vs now 'none'")):
        res = _invoke(str(caches["train"]), "--out", str(cut), *MIXED_ARGS, "--resume", *change)
        _assert_one_line_error(res, 1, "cannot resume with other training options", said)
        res = _invoke("--resume", "--out", str(cut), *change)  # the run folder alone, one option changed
        _assert_one_line_error(res, 1, said)
    other = tmp_path / "other"  # another cache of the same size and classes
    imgs, ys = _colour_images(96, seed=7)
    write_cache(other, imgs, ys, CLASSES, shard_size=40)
    _assert_one_line_error(_invoke(str(other), "--out", str(cut), "--resume"), 1, f"{other} is not the cache",
                           "build key")
    assert tree_bytes(cut) == before  # nothing written: config.json keeps the run's options
    _assert_one_line_error(_invoke("--out", str(cut)), 2, "CACHE", "--resume")
    with _one_thread():
        res = _invoke("--resume", "--out", str(cut), "--log-every", "1")  # how it reports may change
    assert res.exit_code == 0 and "resumed from" in res.output, res.output
    a, b = _weights(full), _weights(cut)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    saved = json.loads((cut / "config.json").read_text())
    assert (saved["crop"], saved["mixup"], saved["cutmix"], saved["label_smoothing"]) == (24, 0.8, 1.0, 0.1)
    assert saved["train"] == str(caches["train"]) and saved["log_every"] == 1


def test_every_option_is_kept_or_free_on_resume() -> None:
    """A new option must be sorted: kept by a resume (it changes what is trained) or free (where and how the
    run goes, what it reports)."""
    import dataclasses

    from loaders.train.config import RESUME_FREE, RESUME_KEEPS

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(RESUME_KEEPS) | set(RESUME_FREE) == names and not set(RESUME_KEEPS) & set(RESUME_FREE)
    assert {"crop", "mixup", "cutmix", "label_smoothing", "augment_in", "augment", "seed", "lr"} <= set(RESUME_KEEPS)


def test_it_learns_and_writes_the_run(tmp_path: Path) -> None:
    from tests.cifar_files import cifar_images

    n_classes = 5
    ytr, yva = np.arange(300) % n_classes, np.arange(150) % n_classes
    names = [f"class{k}" for k in range(n_classes)]
    write_cache(tmp_path / "tr", cifar_images(ytr, 0, n_classes), ytr, names)
    write_cache(tmp_path / "va", cifar_images(yva, 1, n_classes), yva, names, split="val")
    out = tmp_path / "run"
    res = CliRunner().invoke(train, [str(tmp_path / "tr"), "--val", str(tmp_path / "va"), "--out", str(out),
                                     "--model", "tiny_cnn", "--epochs", "3", "--batch-size", "32",
                                     "--lr", "0.05", "--workers", "0", "--device", "cpu", "--amp", "off",
                                     "--warmup-epochs", "0.5", "--log-every", "5"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_top1"] > 0.6, summary  # chance is 0.2
    assert summary["val_count"] == 150
    for word in ("cache", "throughput", "data wait", "accuracy", "img/s"):
        assert word in res.output
    assert (out / "metrics.png").stat().st_size > 1000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train", "epoch"}
    assert sum(r["kind"] == "epoch" for r in records) == 3
    # A share of each window's time; --workers 0 loads in the step, so every window waits for some of it,
    # and never for all of it. The summary's figures are the last epoch's and the epochs' mean.
    assert all(0.0 < r["data_wait"] < 1.0 for r in records)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert summary["data_wait"] == epochs[-1]["data_wait"]
    assert summary["mean_data_wait"] == pytest.approx(sum(r["data_wait"] for r in epochs) / len(epochs))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["resolved"]["steps_per_epoch"] == 10 and cfg["resolved"]["augment"] == "cifar"


def _invoke(*args: str):
    return CliRunner().invoke(train, list(args))


def _assert_one_line_error(res, exit_code: int, *needles: str) -> None:
    assert res.exit_code == exit_code, res.output
    assert "Traceback" not in res.output
    assert isinstance(res.exception, SystemExit)
    for needle in needles:
        assert needle in res.output, res.output


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--batch-size", "0"], ["--batch-size", "0 is not in the range x>=1"]),
        (["--accum", "0"], ["--accum"]),
        (["--amp", "fp16", "--device", "cpu"], ["--amp", "fp16 needs a CUDA device"]),
        (["--model", "no_such_net"], ["--model", "unknown model"]),
    ],
)
def test_bad_options_are_usage_errors(caches: dict[str, Path], tmp_path: Path, args: list[str],
                                      needles: list[str]) -> None:
    res = _invoke(str(caches["train"]), "--out", str(tmp_path), *args)
    _assert_one_line_error(res, 2, *needles)
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.parametrize("value", ["threads", "dataloader", "auto"])
def test_the_removed_loader_flag_is_an_error_naming_the_dataloader_way(caches: dict[str, Path], tmp_path: Path,
                                                                       value: str) -> None:
    """--loader chose ThreadLoader threads or DataLoader workers; batches are loaded one way now, by
    DataLoader workers (--workers 0: the main process): the flag is hidden, and refused with what to write."""
    assert "--loader" not in _invoke("--help").output
    res = _invoke(str(caches["train"]), "--out", str(tmp_path), "--loader", value)
    _assert_one_line_error(res, 2, "--loader is no longer a flag of train", "DataLoader worker processes",
                           "--workers 0 loads in the main process", "collate_fn=collate_batch")
    assert not tmp_path.joinpath("config.json").exists()
    with pytest.raises(OptionError, match=r"^loader: --loader is no longer a flag of train"):
        TrainConfig(train=str(caches["train"]), out=str(tmp_path), loader=value)


def test_val_cache_with_other_classes_is_refused(caches: dict[str, Path], tmp_path: Path) -> None:
    res = _invoke(str(caches["train"]), "--val", str(caches["val_other"]), "--out", str(tmp_path / "r"),
                  "--device", "cpu", "--workers", "0")
    _assert_one_line_error(res, 1, "Error: val cache", "only in train: ['yellow']", "only in val: ['purple']")
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_val_cache_of_another_resolution(caches: dict[str, Path], tmp_path: Path) -> None:
    """Refused where the eval transform does not resize (cifar); resized to the training crop, and said so,
    where it does."""
    va, yva = _colour_images(16, seed=1, size=48)
    write_cache(tmp_path / "val48", va, yva, CLASSES, split="val")
    res = _invoke(str(caches["train"]), "--val", str(tmp_path / "val48"), "--out", str(tmp_path / "r"),
                  "--device", "cpu", "--workers", "0")
    _assert_one_line_error(res, 1, "Error: val cache", "holds 48x48 images, train 32x32", "--size 32")
    assert not (tmp_path / "r").exists()
    res = _invoke(str(caches["train"]), "--val", str(tmp_path / "val48"), "--out", str(tmp_path / "r2"),
                  "--device", "cpu", "--workers", "0", "--augment", "imagenet", "--model", "linear", "--amp", "off")
    assert res.exit_code == 0, res.output
    assert "is 48x48, train 32x32: val images are resized to 37 (short side) and centre-cropped to 32" in res.output
    assert json.loads((tmp_path / "r2" / "summary.json").read_text())["val_count"] == 16


def test_missing_cache_and_missing_checkpoint(caches: dict[str, Path], tmp_path: Path) -> None:
    res = _invoke(str(tmp_path / "nope"), "--out", str(tmp_path / "r"), "--device", "cpu")
    _assert_one_line_error(res, 1, "Error:", "nope")
    res = _invoke(str(caches["train"]), "--out", str(tmp_path / "r"), "--device", "cpu", "--resume")
    _assert_one_line_error(res, 1, "Error: --resume: no checkpoint")


def test_checkpoint_of_another_model_is_refused(caches: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "r"
    common = ["--out", str(out), "--device", "cpu", "--workers", "0", "--batch-size", "48", "--amp", "off"]
    res = _invoke(str(caches["train"]), "--model", "linear", *common)
    assert res.exit_code == 0, res.output
    before = (out / "checkpoint.pt").read_bytes()
    res = _invoke(str(caches["train"]), "--model", "tiny_cnn", "--resume", *common)
    _assert_one_line_error(res, 1, "Error:", "holds a 'linear' model", "'tiny_cnn'")
    res = _invoke(str(caches["train"]), "--model", "linear", "--resume", *common[:-4], "--batch-size", "16")
    _assert_one_line_error(res, 1, "batch_size: checkpoint 48 vs now 16")
    assert (out / "checkpoint.pt").read_bytes() == before
    garbage = tmp_path / "g"
    garbage.mkdir()
    (garbage / "checkpoint.pt").write_bytes(b"not a checkpoint")
    res = _invoke(str(caches["train"]), "--model", "linear", "--resume", "--out", str(garbage), "--device", "cpu")
    _assert_one_line_error(res, 1, "is not a readable training checkpoint")


@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_torchrun_two_ranks_equals_single_process_on_the_global_batch(caches: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    from loaders.dataset import CachedImageDataset
    from loaders.sampler import CacheSampler
    from loaders.train.loop.step import EpochConfig, num_optimizer_steps, train_one_epoch
    from loaders.train.models import build_model
    from loaders.train.run.fit import TrainConfig, build_optimizer, build_scheduler, transforms_for

    out = tmp_path / "ddp"
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    bs, accum, seed = 8, 4, 5
    args = [str(caches["train"]), "--val", str(caches["val"]), "--out", str(out), "--model", "tiny_cnn",
            "--epochs", "1", "--batch-size", str(bs), "--accum", str(accum), "--lr", "0.05", "--workers", "0",
            "--device", "cpu", "--amp", "off", "--augment", "none", "--seed", str(seed), "--log-every", "1"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:  # a free port on 127.0.0.1 (--standalone would rendezvous on "localhost")
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([torchrun, "--nnodes", "1", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "loaders.train", *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("accuracy    val top-1") == 1  # only rank 0 reports
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["resolved"]["world_size"] == 2 and cfg["resolved"]["global_batch"] == 2 * bs * accum
    epoch_rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in epoch_rec].count("epoch") == 1
    assert epoch_rec[-1]["val_count"] == 40  # each val sample counted once over both ranks

    # The same epoch in one process: global batch t = rank 0's batch t + rank 1's batch t.
    ds = CachedImageDataset(caches["train"])
    shards = []
    for rank in (0, 1):
        s = CacheSampler(ds, shuffle=True, seed=seed, num_replicas=2, rank=rank)
        s.set_epoch(0)
        shards.append(np.fromiter(iter(s), dtype=np.int64))
    assert set(shards[0]).isdisjoint(shards[1]) and len(set(shards[0]) | set(shards[1])) == len(ds)
    n_batches = len(shards[0]) // bs  # 6: windows of 4 and 2
    batches = []
    for t in range(n_batches):
        idx = np.concatenate([sh[t * bs : (t + 1) * bs] for sh in shards])
        x = torch.from_numpy(ds.gather(idx)).permute(0, 3, 1, 2)
        batches.append((x, torch.from_numpy(ds.labels[idx])))
    tcfg = TrainConfig(train=str(caches["train"]), out=str(tmp_path), model="tiny_cnn", batch_size=2 * bs,
                       accum=accum, lr=0.05, seed=seed)
    torch.manual_seed(seed)
    model = build_model("tiny_cnn", len(CLASSES), image_size=32)
    opt = build_optimizer(model, tcfg)
    sched = build_scheduler(opt, num_optimizer_steps(n_batches, accum), tcfg)
    train_tf, _ = transforms_for("none", 32)
    res = train_one_epoch(model, batches, opt, EpochConfig(accum=accum), scheduler=sched, transform=train_tf)
    assert res.steps == 2
    ddp = _weights(out)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ddp[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_fit_with_dataloader_workers_leaves_no_batch_rings_mapped(caches: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """fit() through DataLoader worker processes: batches come through the workers' rings, and once it
    returns the main process no longer maps them (they would hold slots x batch bytes each)."""
    from loaders.batch_ring import drop_dead_rings, ring_stats
    from loaders.train import TrainConfig, fit
    from loaders.train.run import fit as run

    drop_dead_rings()
    seen: dict[str, int] = {}

    def spy() -> int:  # what fit() is about to drop
        seen.update(ring_stats())
        return drop_dead_rings()

    monkeypatch.setattr(run, "drop_dead_rings", spy)
    fit(TrainConfig(train=str(caches["train"]), out=str(tmp_path), model="tiny_cnn", epochs=2, batch_size=16,
                    lr=0.05, workers=2, device="cpu", amp="off"), echo=lambda _msg: None)
    assert seen["rings"] == 2 and seen["slot_batches"] >= 2 * 96 // 16  # both workers' rings carried batches
    assert ring_stats()["rings"] == 0


def test_a_fresh_run_refuses_an_out_holding_a_run(caches: dict[str, Path], tmp_path: Path) -> None:
    """Without --resume or --overwrite a second run into the same --out would append to the first one's
    metrics.jsonl and replace its checkpoint; --overwrite removes the run's files only, never others."""
    out = tmp_path / "r"
    common = [str(caches["train"]), "--out", str(out), "--model", "linear", "--device", "cpu", "--workers", "0",
              "--batch-size", "48", "--amp", "off", "--log-every", "1"]
    res = _invoke(*common)
    assert res.exit_code == 0, res.output
    (out / "notes.txt").write_text("mine")
    (out / "plots").mkdir()
    (out / "plots" / "config.json").write_text("{}")  # not the run's: in a subfolder
    (out / ".checkpoint.pt.123.0badc0de.tmp").write_bytes(b"a killed checkpoint write")
    before = tree_bytes(out)
    res = _invoke(*common, "--seed", "1")
    _assert_one_line_error(res, 1, f"Error: {out} already holds a run", "checkpoint.pt", "metrics.jsonl",
                           "--resume", "another --out", "--overwrite")
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert tree_bytes(out) == before
    _assert_one_line_error(_invoke(*common, "--resume", "--overwrite"), 2, "exclude each other")
    assert tree_bytes(out) == before

    res = _invoke(*common, "--seed", "1", "--overwrite")
    assert res.exit_code == 0, res.output
    after = tree_bytes(out)
    assert after["notes.txt"] == b"mine" and after["plots/config.json"] == b"{}"
    assert ".checkpoint.pt.123.0badc0de.tmp" not in after
    assert after["checkpoint.pt"] != before["checkpoint.pt"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if r["kind"] == "train"] == [1, 2]  # this run's only
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    res = _invoke(*common, "--resume")  # --resume is the way to continue it (here: already finished)
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output


def test_resume_with_another_schedule_is_refused(caches: dict[str, Path], tmp_path: Path) -> None:
    """The optimizer and LR schedule come back from the checkpoint: resuming with more --epochs trained the
    extra epochs at the old schedule's last LR (0), and another --lr was ignored."""
    out = tmp_path / "r"
    common = [str(caches["train"]), "--out", str(out), "--model", "linear", "--device", "cpu", "--workers", "0",
              "--batch-size", "48", "--amp", "off", "--lr", "0.1"]
    assert _invoke(*common, "--epochs", "1").exit_code == 0
    before = (out / "checkpoint.pt").read_bytes()
    res = _invoke(*common, "--epochs", "3", "--resume")
    _assert_one_line_error(res, 1, "cannot resume with other training options", "epochs: checkpoint 1 vs now 3")
    res = _invoke(*common[:-2], "--lr", "0.2", "--epochs", "1", "--resume")
    _assert_one_line_error(res, 1, "lr: checkpoint 0.1 vs now 0.2")
    assert (out / "checkpoint.pt").read_bytes() == before


def test_resume_drops_what_was_logged_after_the_checkpoint(caches: dict[str, Path], tmp_path: Path) -> None:
    """A kill after logging steps past the last checkpoint (and in the middle of a line): the resumed run
    logs those steps again, so they must go, and the torn line must not swallow the next record."""
    out = tmp_path / "cut"
    args = [str(caches["train"]), "--out", str(out), "--model", "linear", "--epochs", "2", "--batch-size", "8",
            "--accum", "2", "--workers", "0", "--device", "cpu", "--amp", "off", "--log-every", "1",
            "--ckpt-every", "2"]
    r = _cli(*args, "--stop-after-steps", "3")
    assert r.returncode == STOP_EXIT_CODE, r.stderr
    assert torch.load(out / "checkpoint.pt", weights_only=True)["global_step"] == 2
    with open(out / "metrics.jsonl", "a") as f:  # step 3 logged, then killed while writing step 4
        f.write(json.dumps({"kind": "train", "epoch": 0, "global_step": 3, "step": 3, "loss": 9.0}) + "\n")
        f.write('{"kind": "train", "epoch": 0, "glo')
    r = _invoke(*args, "--resume")  # in-process: only the kill needs a process of its own
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # all whole
    assert [x["global_step"] for x in records if x["kind"] == "train"] == list(range(1, 13))
    assert [x["epoch"] for x in records if x["kind"] == "epoch"] == [0, 1]
    assert 9.0 not in [x["loss"] for x in records if x["kind"] == "train"]


def test_accumulation_with_a_short_last_micro_batch_equals_the_union_batches(caches: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """96 images in micro-batches of 10 (nine, then 6), accum 4: the last window (10 + 6) must weigh its 16
    samples alike, as one batch of 16 would (it gave the 6 the weight of 10)."""
    from loaders.dataset import CachedImageDataset
    from loaders.sampler import CacheSampler
    from loaders.train import TrainConfig, fit
    from loaders.train.loop.step import train_one_epoch
    from loaders.train.models import build_model
    from loaders.train.run.fit import build_optimizer, build_scheduler, transforms_for

    cfg = TrainConfig(train=str(caches["train"]), out=str(tmp_path / "r"), model="linear", epochs=1,
                      batch_size=10, accum=4, lr=0.05, workers=0, device="cpu", amp="off", augment="none",
                      seed=5, log_every=0)
    fit(cfg, echo=lambda _msg: None)
    ds = CachedImageDataset(caches["train"])
    sampler = CacheSampler(ds, shuffle=True, seed=5)
    sampler.set_epoch(0)
    order = np.fromiter(iter(sampler), dtype=np.int64)
    windows = [order[lo : lo + 40] for lo in range(0, len(order), 40)]  # 40, 40, 16 samples
    batches = [(torch.from_numpy(ds.gather(idx)).permute(0, 3, 1, 2), torch.from_numpy(ds.labels[idx]))
               for idx in windows]
    torch.manual_seed(5)
    model = build_model("linear", len(CLASSES), image_size=32)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, len(windows), cfg)
    train_one_epoch(model, batches, opt, scheduler=sched, transform=transforms_for("none", 32)[0])
    got = _weights(tmp_path / "r")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_pad_cache_trains_on_crops_inside_its_boxes(tmp_path: Path, workers: int) -> None:
    """A letterboxed cache's training batches carry its boxes, and the train transform crops inside them:
    no pixel of the black bars reaches the model (batches used to come without boxes: crops took bars)."""
    from loaders.train.config import TrainConfig
    from loaders.train.data import build_data
    from loaders.train.distributed import DistInfo

    n, side = 24, 40
    images = np.zeros((n, side, side, 3), np.uint8)
    images[:, 10:30] = 200  # wide photos letterboxed: bars above and below
    boxes = np.tile(np.array([10, 0, 30, side], np.int32), (n, 1))
    write_cache(tmp_path / "pad", images, np.arange(n) % 3, ["a", "b", "c"], boxes=boxes, fit="pad")
    cfg = TrainConfig(train=str(tmp_path / "pad"), out=str(tmp_path / "run"), model="linear", batch_size=8,
                      workers=workers, device="cpu", augment="imagenet")
    data = build_data(cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    torch.manual_seed(0)
    inside = (200 / 255 - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    seen = 0
    for batch in data.loader:
        assert len(batch) == 3 and torch.equal(batch[2], torch.from_numpy(boxes[: len(batch[0])]))
        x = data.train_tf(batch[0].permute(0, 3, 1, 2), batch[2])
        assert torch.allclose(x, inside.view(1, 3, 1, 1).expand_as(x), atol=1e-4)  # every pixel from the box
        seen += len(x)
    assert seen == n


def test_resume_removes_temporaries_of_killed_checkpoint_writes(caches: dict[str, Path], tmp_path: Path) -> None:
    """Each kill during a checkpoint write leaves a checkpoint-sized temporary: a resume removes those of
    writers that are gone (repeated kills filled the disk), never a live writer's, never other files."""
    out = tmp_path / "r"
    common = [str(caches["train"]), "--out", str(out), "--model", "linear", "--device", "cpu", "--workers", "0",
              "--batch-size", "48", "--amp", "off"]
    assert _invoke(*common).exit_code == 0
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dead, live = out / f".checkpoint.pt.{gone}.0badc0de.tmp", out / f".checkpoint.pt.{os.getpid()}.1badc0de.tmp"
    other = out / f".notes.txt.{gone}.2badc0de.tmp"  # not a run file's temporary
    for f in (dead, live, other):
        f.write_bytes(b"x" * 1000)
    res = _invoke(*common, "--resume")
    assert res.exit_code == 0, res.output
    assert not dead.exists() and live.exists() and other.exists()


def test_the_options_take_their_choices_and_defaults_from_train_config() -> None:
    """Each choice and default is declared once, in loaders.train.config: the CLI cannot drift from it."""
    import dataclasses

    import click

    from loaders.train import config

    fields = {f.name: f.default for f in dataclasses.fields(config.TrainConfig)}
    params = {p.name: p for p in train.params}
    choices = {"amp": config.AMP_CHOICES, "optimizer": config.OPTIMIZERS, "augment": config.AUGMENTS,
               "in_memory": config.IN_MEMORY}
    for name, tuple_ in choices.items():
        assert isinstance(params[name].type, click.Choice) and tuple(params[name].type.choices) == tuple_, name
    assert list(params) == list(fields)  # one parameter per field, named as it, in field order
    # CACHE may be left out only by --resume (the run folder names it): TrainConfig refuses it otherwise
    assert not params["train"].required and isinstance(params["train"], click.Argument)
    with pytest.raises(OptionError, match="missing argument CACHE"):
        TrainConfig()
    for name, p in params.items():
        if name != "train":
            assert p.default == fields[name], name


def test_mixup_and_cutmix_reach_the_loss_as_soft_targets_smoothed_once(tmp_path: Path) -> None:
    """--mixup/--cutmix: the run's batch transform is MixUpCutMix with the run's alphas and label smoothing;
    its targets are soft and smoothed, and the loss then smooths nothing (smoothing twice would flatten them)."""
    from loaders.train.config import TrainConfig
    from loaders.train.data import build_data
    from loaders.train.distributed import DistInfo
    from loaders.train.run.fit import loss_function
    from loaders.transforms import MixUpCutMix

    n, classes = 16, ["a", "b", "c", "d"]
    labels = np.arange(n) % 4
    write_cache(tmp_path / "c", _colour_images(n, 0)[0], labels, classes)
    common = dict(train=str(tmp_path / "c"), out=str(tmp_path / "run"), model="linear", batch_size=8, workers=0,
                  device="cpu", label_smoothing=0.1)
    plain = build_data(TrainConfig(**common), DistInfo(0, 1, 0, torch.device("cpu")))
    assert plain.batch_tf is None and loss_function(TrainConfig(**common), plain).label_smoothing == 0.1
    cfg = TrainConfig(**common, mixup=0.8, cutmix=1.0)
    data = build_data(cfg, DistInfo(0, 1, 0, torch.device("cpu")))
    mix = data.batch_tf
    assert isinstance(mix, MixUpCutMix) and (mix.mixup_alpha, mix.cutmix_alpha) == (0.8, 1.0)
    assert loss_function(cfg, data).label_smoothing == 0.0
    torch.manual_seed(0)
    x = torch.rand(8, 3, 32, 32)
    y = torch.from_numpy(labels[:8]).long()
    _, t = mix(x, y)
    assert t.shape == (8, 4) and torch.allclose(t.sum(1), torch.ones(8))
    assert float(t.min()) >= 0.1 / 4 - 1e-6  # smoothed: no class below eps / C
    # mixed: each row weighs its own class and its partner's (the batch rolled by one: another label here)
    assert ((t > 0.1 / 4 + 1e-6).sum(1) == 2).all(), t


def test_a_run_with_mixup_and_cutmix_trains_and_records_them(tmp_path: Path) -> None:
    images, labels = _colour_images(64, 3)
    write_cache(tmp_path / "c", images, labels, [f"c{k}" for k in range(int(labels.max()) + 1)])
    out = tmp_path / "run"
    res = CliRunner().invoke(train, [str(tmp_path / "c"), "--out", str(out), "--model", "tiny_cnn", "--epochs", "1",
                                     "--batch-size", "16", "--workers", "0", "--device", "cpu", "--amp", "off",
                                     "--mixup", "0.8", "--cutmix", "1.0", "--label-smoothing", "0.1"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["mixup"], cfg["cutmix"], cfg["label_smoothing"]) == (0.8, 1.0, 0.1)
    assert math.isfinite(json.loads((out / "summary.json").read_text())["train_loss"])
