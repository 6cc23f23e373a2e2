"""matplotlib is an optional extra (``cachebuild[plots]``): without it a run trains and says in one line what
``metrics.png`` needs, and the report's training curves (``run_curves``) are a one-line error naming the
extra. The missing package is simulated the way Python sees one (``sys.modules[name] = None``), so the real
import guard runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachebuild.storage.cache import write_cache
from loaders.inspect_cli import run_curves
from loaders.train.cli import train
from loaders.train.metrics import PlotsUnavailableError
from tests.train_fixtures import CLASSES, colour_images

PLOTS = "pip install 'cachebuild[plots]'"


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)


def _cache(tmp_path: Path) -> Path:
    images, labels = colour_images(16, seed=0)
    write_cache(tmp_path / "c", images, labels, CLASSES)
    return tmp_path / "c"


def test_a_run_without_matplotlib_trains_and_says_what_metrics_png_needs(tmp_path: Path, no_matplotlib: None) -> None:
    out, cache = tmp_path / "run", _cache(tmp_path)
    res = CliRunner().invoke(train, [str(cache), "--out", str(out), "--model", "linear", "--epochs", "1",
                                     "--batch-size", "8", "--workers", "0", "--device", "cpu", "--amp", "off"])
    assert res.exit_code == 0, res.output
    said = [line for line in res.output.splitlines() if PLOTS in line]
    assert said == [f"metrics.png needs matplotlib: {PLOTS}"]
    assert (out / "checkpoint.pt").is_file() and (out / "summary.json").is_file() and (out / "metrics.jsonl").is_file()
    assert not (out / "metrics.png").exists()
    with pytest.raises(PlotsUnavailableError) as e:
        run_curves(out, tmp_path / "curves.png")
    assert str(e.value) == f"curves.png needs matplotlib: {PLOTS}"
