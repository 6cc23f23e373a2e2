"""Training faults: a checkpoint truncated or with flipped bytes is refused with a message, never loaded
with other values; a run SIGKILLed at a random moment resumes to the same weights as an unbroken one."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cachebuild.storage.cache import write_cache
from loaders.train.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from loaders.train.cli import train
from loaders.train.models import build_model
from tests.reliability.helpers import cli_env

SEED = int(os.environ.get("RELIABILITY_SEED", "0"))
CLASSES = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    torch.manual_seed(0)
    model = build_model("tiny_cnn", 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pt"
    save_checkpoint(path, model=model, optimizer=opt, model_name="tiny_cnn", num_classes=4, epoch=1, batch=8,
                    global_step=12)
    return path, load_checkpoint(path)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _damaged_trials(ledger, row: str, path: Path, intact: dict, variants: list[tuple[str, bytes]],
                    tmp_path: Path) -> None:
    for name, data in variants:
        with ledger.trial(row, name):
            bad = tmp_path / "bad.pt"
            bad.write_bytes(data)
            try:
                state = load_checkpoint(bad)
            except CheckpointError as e:
                assert str(bad) in str(e) and "\n" not in str(e), e
                continue
            # Accepted only if what it holds is exactly what was saved (a flip in zip padding, say).
            assert _same(state, intact), "a damaged checkpoint loaded with other values"


def test_truncated_checkpoints_are_refused(checkpoint, ledger, tmp_path: Path) -> None:
    path, intact = checkpoint
    data = path.read_bytes()
    cuts = [0, 1, 100, len(data) // 4, len(data) // 2, len(data) - 200, len(data) - 22, len(data) - 1]
    _damaged_trials(ledger, "truncated checkpoint: refused with a message", path, intact,
                    [(f"cut at {n} of {len(data)} bytes", data[:n]) for n in cuts], tmp_path)


@pytest.mark.parametrize("flips", [pytest.param(40, id="fast"), pytest.param(400, id="full", marks=pytest.mark.slow)])
def test_corrupted_checkpoints_are_refused(checkpoint, ledger, tmp_path: Path, flips: int) -> None:
    path, intact = checkpoint
    data = path.read_bytes()
    rng = random.Random(f"{SEED}-{flips}")
    variants = []
    for _ in range(flips):
        at = rng.randrange(len(data))
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        variants.append((f"bit flipped at byte {at}", bytes(bad)))
    _damaged_trials(ledger, "checkpoint with a flipped bit: refused or identical", path, intact, variants, tmp_path)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    labels = np.arange(96) % 4
    images = (rng.normal(60 * labels[:, None, None, None] + 40, 30, (96, 32, 32, 3))).clip(0, 255).astype(np.uint8)
    out = tmp_path_factory.mktemp("traincache") / "train"
    write_cache(out, images, labels, CLASSES, shard_size=40)
    return out


ARGS = ["--model", "tiny_cnn", "--epochs", "3", "--batch-size", "8", "--accum", "2", "--lr", "0.05", "--workers", "0",
        "--device", "cpu", "--amp", "off", "--seed", "3", "--augment", "imagenet", "--deterministic",
        "--ckpt-every", "1", "--log-every", "0", "--no-progress"]


def test_resume_refuses_a_corrupted_checkpoint(cache: Path, ledger, tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(train, [str(cache), "--out", str(out), *ARGS[:3], "1", *ARGS[4:]])
    assert res.exit_code == 0, res.output
    ckpt = out / "checkpoint.pt"
    data = bytearray(ckpt.read_bytes())
    weights = data.index(b"archive/data/0") + 200  # inside the first tensor's bytes: torch.load would not notice
    data[weights] ^= 0x10
    ckpt.write_bytes(bytes(data))
    with ledger.trial("--resume from a corrupted checkpoint: one line, nothing trained"):
        res = CliRunner().invoke(train, [str(cache), "--out", str(out), *ARGS, "--resume"])
        assert res.exit_code == 1, res.output
        assert f"Error: {ckpt} is corrupted" in res.output and "Traceback" not in res.output, res.output
        assert ckpt.read_bytes() == bytes(data)


def _train(out: Path, cache: Path, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, "-m", "loaders.train", str(cache), "--out", str(out), *ARGS, *extra],
                                env=cli_env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _replacements(path: Path, seen: set[tuple[int, int]]) -> int:
    """How many different checkpoint files were seen (each is written aside and renamed in; inode numbers
    are reused, so a file is its inode and its mtime)."""
    with contextlib.suppress(FileNotFoundError):
        st = path.stat()
        seen.add((st.st_ino, st.st_mtime_ns))
    return len(seen)


@pytest.mark.slow
def test_sigkill_mid_epoch_resumes_to_the_same_weights(cache: Path, ledger, tmp_path: Path) -> None:
    """3 epochs of 6 optimizer steps, a checkpoint after every step; each run is killed at a random moment
    after 1-4 more checkpoints (inside a step or a checkpoint write), resumed, 3 kills a trial, then run
    to the end: the same weights as the unbroken run."""
    full, log = tmp_path / "full", tmp_path / "log.txt"
    assert _train(full, cache, log).wait(timeout=600) == 0, log.read_text()
    ref = torch.load(full / "checkpoint.pt", weights_only=True)
    rng = random.Random(SEED)
    row, total = "training SIGKILLed mid-epoch, resumed: same weights", 0
    for trial in range(3):
        out = tmp_path / f"cut{trial}"
        with ledger.trial(row, f"trial {trial}"):
            kills = 0
            while True:
                resume = ["--resume"] if (out / "checkpoint.pt").exists() else []
                p = _train(out, cache, log, *resume)
                seen: set[tuple[int, int]] = set()
                target = _replacements(out / "checkpoint.pt", seen) + rng.randint(1, 4)
                while kills < 3 and p.poll() is None and _replacements(out / "checkpoint.pt", seen) < target:
                    time.sleep(0.002)
                time.sleep(rng.uniform(0, 0.05))
                if kills == 3 or p.poll() is not None:  # done killing, or it finished first (near the end)
                    assert p.wait(timeout=600) == 0, log.read_text()[-2000:]
                    break
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                kills += 1
            assert kills >= 1
            total += kills
            ledger.note(row, f"{total} kills in all, each resumed from the last checkpoint")
            got = torch.load(out / "checkpoint.pt", weights_only=True)
            assert got["global_step"] == ref["global_step"] == 18
            for k in ref["model"]:
                torch.testing.assert_close(got["model"][k], ref["model"][k], rtol=0, atol=0, msg=k)
            for k in ref["optimizer"]["state"]:
                torch.testing.assert_close(got["optimizer"]["state"][k]["momentum_buffer"],
                                           ref["optimizer"]["state"][k]["momentum_buffer"], rtol=0, atol=0)
