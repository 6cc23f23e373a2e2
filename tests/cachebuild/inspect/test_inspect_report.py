"""``cachebuild report``: a static folder that states the manifest, counts, contact sheets, pixel statistics
(equal to numpy's over the stated sample), the skipped files with their reasons, and a run's curves."""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from cachebuild.builder.pipeline import BuildOptions, build
from cachebuild.inspect import ReportOptions, Selection, pick_per_class, pick_random, pixel_stats, show, write_report
from cachebuild.inspect.report import FILE_LIST
from cachebuild.sources.folder import folder_plan
from cachebuild.storage.cache import open_cache
from loaders.inspect_cli import report as report_command
from loaders.inspect_cli import run_curves
from loaders.train.metrics import MetricsWriter
from tests.inspect_fixtures import inspect_cache


@pytest.fixture(scope="module")
def broken_cache(imagenet_tree: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The class-folder tree with its broken files (cachebuild.samples.broken), built at 32 px."""
    out = tmp_path_factory.mktemp("report-src") / "train"
    build(folder_plan(imagenet_tree["train_dir"]), out, BuildOptions(size=32, jobs=1))
    return out


def _links(folder: Path) -> set[str]:
    found = set()
    for page in folder.glob("*.html"):
        found |= set(re.findall(r'(?:src|href)="([^"]+)"', page.read_text(encoding="utf-8")))
    return found


def test_report_states_the_manifest_and_the_skipped_files(broken_cache: Path, tmp_path: Path) -> None:
    reader = open_cache(broken_cache)
    m = reader.manifest
    assert len(m.failures) >= 5  # truncated, empty, text, bombs...
    res = CliRunner().invoke(report_command, [str(broken_cache), "--out", str(tmp_path / "r"), "--per-class", "4",
                                              "--classes-per-page", "3"])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    for f in m.failures:  # every skipped file, with its reason, in a table row
        assert f"<tr><td>{html.escape(f.path)}</td><td>{html.escape(f.reason)}</td></tr>" in page
    assert f"{len(m.failures)} source file(s) produced no sample" in page
    for fact in (m.build_key, str(m.source["fingerprint"]), str(m.source["root"]), m.created,
                 f"{m.built_by['user']}@{m.built_by['host']}", f"{m.count} samples of 32x32x3 uint8"):
        assert html.escape(fact) in page
    assert "<script" not in page.lower()
    pages = sorted(p.name for p in (tmp_path / "r").glob("classes-*.html"))
    assert pages == [f"classes-{k:03d}.html" for k in range(1, -(-len(m.classes) // 3) + 1)]
    first = (tmp_path / "r" / pages[0]).read_text(encoding="utf-8")
    counts = np.bincount(reader.labels, minlength=len(m.classes))
    for c in range(3):
        assert f"<h3>{c}: {m.classes[c]} ({counts[c]} samples)</h3>" in first
    links = _links(tmp_path / "r")
    assert {"img/counts.png", "img/samples.png", "img/histogram.png", "classes-001.html"} <= links
    for link in links:  # every relative link resolves inside the folder: it opens from disk
        assert (tmp_path / "r" / link).is_file(), link
    for png in (tmp_path / "r" / "img").glob("*.png"):
        Image.open(png).verify()


def test_class_sheets_show_that_class(broken_cache: Path, tmp_path: Path) -> None:
    reader = open_cache(broken_cache)
    write_report(reader, tmp_path / "r", ReportOptions(per_class=5, classes_per_page=2, seed=7))
    picks = pick_per_class(reader.labels, range(len(reader.manifest.classes)), 5, 7)
    for c, idx in enumerate(picks):
        assert (reader.labels[idx] == c).all() and len(idx) == min(5, int((reader.labels == c).sum()))
        want = show(reader, Selection(idx), columns=5).image
        got = np.asarray(Image.open(tmp_path / "r" / "img" / f"class-{c:05d}.png").convert("RGB"))
        assert np.array_equal(got, want)


@pytest.mark.parametrize("sample", [37, 10_000])
def test_pixel_statistics_are_numpys_over_the_stated_sample(tmp_path: Path, sample: int) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=120, h=20, w=28)
    reader = open_cache(root)
    st = pixel_stats(reader, sample=sample, seed=3)
    idx = pick_random(120, sample, 3)
    x = reader.gather(idx).astype(np.float64) / 255.0
    assert st.samples == len(idx) == min(sample, 120) and st.pixels == len(idx) * 20 * 28
    np.testing.assert_allclose(st.mean, x.mean(axis=(0, 1, 2)), rtol=0, atol=1e-12)
    np.testing.assert_allclose(st.std, x.std(axis=(0, 1, 2)), rtol=0, atol=1e-12)
    write_report(reader, tmp_path / "r", ReportOptions(stats_sample=sample, seed=3))
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    stated = "all samples" if sample >= 120 else f"a random sample of {sample} of the 120 samples (seed 3"
    assert f"Over {stated}" in page and f"{st.pixels} pixels per channel" in page
    mean = ", ".join(f"{v:.4f}" for v in st.mean)
    assert f"transforms.Normalize(mean=({mean}), std=(" in page


@pytest.mark.parametrize("storage", ["npy", "zarr", "jpeg", "url", "pad"])
def test_report_of_every_kind(tmp_path: Path, http_server, storage: str) -> None:
    kind = storage if storage in ("npy", "zarr", "jpeg") else "npy"
    root, *_ = inspect_cache(tmp_path / "site" / "c", kind, n=60, pad=storage == "pad")
    where = http_server(tmp_path / "site").url_for("c") if storage == "url" else str(root)
    res = CliRunner().invoke(report_command, [where, "--out", str(tmp_path / "r"), "--stats-sample", "25"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"{tmp_path / 'r' / 'index.html'}: report of 60 samples of ")
    reader = open_cache(where)
    st = pixel_stats(reader, 25, 0)
    x = reader.gather(pick_random(60, 25, 0)).astype(np.float64) / 255.0
    np.testing.assert_allclose(st.mean, x.mean(axis=(0, 1, 2)), atol=1e-12)
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    assert f"<td>R</td><td>{st.mean[0]:.4f}</td><td>{st.std[0]:.4f}</td>" in page
    assert ("letterbox padding included" in page) == (storage == "pad")
    assert (st.inside is not None) == (storage == "pad") == ("Over the real pixels only" in page)
    if st.inside is not None:  # numpy over the pixels inside each sample's box
        idx = pick_random(60, 25, 0)
        real = np.concatenate([reader.gather([i])[0, y0:y1, x0:x1].reshape(-1, 3)
                               for i, (y0, x0, y1, x1) in zip(idx, reader.boxes[idx].tolist(), strict=True)])
        np.testing.assert_allclose(st.inside.mean, (real / 255.0).mean(axis=0), atol=1e-12)
        np.testing.assert_allclose(st.inside.std, (real / 255.0).std(axis=0), atol=1e-12)
        assert st.inside.pixels == len(real) < st.pixels
    assert len(list((tmp_path / "r" / "img").glob("class-*.png"))) == 6


def test_training_curves_of_a_run_folder(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=30)
    run = tmp_path / "run"
    writer = MetricsWriter(run / "metrics.jsonl")
    for step in range(1, 9):
        writer.write("train", epoch=step // 4, global_step=step, loss=2.0 / step)
    writer.write("epoch", epoch=0, global_step=4, val_loss=1.1, val_top1=0.4, val_top5=0.9)
    writer.write("epoch", epoch=1, global_step=8, val_loss=0.7, val_top1=0.625, val_top5=0.95)
    (run / "summary.json").write_text(json.dumps({"epoch": 1, "val_top1": 0.625, "img_per_s": 1234.5}))
    res = CliRunner().invoke(report_command, [str(root), "--out", str(tmp_path / "r"), "--run", str(run)])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    assert "<h2>Training</h2>" in page and "<td>val top-1</td><td>62.5%</td>" in page
    assert "<td>epochs</td><td>2</td>" in page and "<td>val loss</td><td>0.7000</td>" in page
    assert "0.625" not in page and "val_top1" not in page  # figures in words, not raw floats and keys
    curves = np.asarray(Image.open(tmp_path / "r" / "img" / "curves.png").convert("RGB"))
    assert curves.shape[:2] == (400, 1000) and len(np.unique(curves.reshape(-1, 3), axis=0)) > 20
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert run_curves(empty, tmp_path / "x.png") is None
    res = CliRunner().invoke(report_command, [str(root), "--out", str(tmp_path / "r"), "--run", str(empty)])
    assert res.exit_code == 0 and "holds no metrics file" in (tmp_path / "r" / "index.html").read_text()
    assert not (tmp_path / "r" / "img" / "curves.png").exists()  # the earlier report's curves were its own


def test_report_replaces_only_its_own_files(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=30)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    res = CliRunner().invoke(report_command, [str(root), "--out", str(foreign)])
    assert res.exit_code == 1
    assert res.output.strip() == (f"Error: {foreign} is not empty and holds no cachebuild report: choose a new or "
                                  f"empty --out folder (a report never overwrites files it did not write)")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    out = tmp_path / "r"
    write_report(open_cache(root), out, ReportOptions(classes_per_page=1))
    assert len(list(out.glob("classes-*.html"))) == 6
    (out / "img" / "extra.png").write_bytes(b"user's")
    write_report(open_cache(root), out, ReportOptions(classes_per_page=6))
    assert [p.name for p in out.glob("classes-*.html")] == ["classes-001.html"]  # the old pages went
    assert (out / "img" / "extra.png").read_bytes() == b"user's"
    assert "classes-001.html" in (out / FILE_LIST).read_text().split()

    def killed(run: Path, png: Path) -> None:
        raise KeyboardInterrupt  # a report stopped half-way, its class pages written

    with pytest.raises(KeyboardInterrupt):
        write_report(open_cache(root), out, ReportOptions(classes_per_page=2), run=tmp_path, run_curves=killed)
    assert len(list(out.glob("classes-*.html"))) == 3 and not (out / "index.html").exists()
    write_report(open_cache(root), out, ReportOptions(classes_per_page=3))  # still replaced, file by file
    assert sorted(p.name for p in out.glob("classes-*.html")) == ["classes-001.html", "classes-002.html"]
    assert (out / "index.html").is_file() and (out / "img" / "extra.png").read_bytes() == b"user's"


def test_no_cache_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    res = CliRunner().invoke(report_command, [str(tmp_path / "none"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 1
    assert res.output.strip() == f"Error: {tmp_path / 'none'} is not a cachebuild cache (no manifest.json)"
    assert not (tmp_path / "r").exists()
    res = CliRunner().invoke(report_command, [str(tmp_path / "gone"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 1
    assert res.output.strip() == (f"Error: {tmp_path / 'gone'} does not exist: name the folder of a cache (the one "
                                  f"holding manifest.json)")
    assert not (tmp_path / "r").exists()
    root, *_ = inspect_cache(tmp_path / "c", n=10)
    (tmp_path / "file").write_text("x")
    res = CliRunner().invoke(report_command, [str(root), "--out", str(tmp_path / "file" / "r")])
    assert res.exit_code == 1 and res.output.startswith(f"Error: cannot write {tmp_path / 'file'}")
    assert len(res.output.strip().splitlines()) == 1


def test_report_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=10)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: the real guard runs
    res = CliRunner().invoke(report_command, [str(root), "--out", str(tmp_path / "r")])
    assert res.exit_code == 1 and res.output.strip() == (
        "Error: the report draws its charts with matplotlib: pip install 'cachebuild[plots]'")
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_resumed_three_epoch_run_reports_three_epochs_in_words(tmp_path: Path) -> None:
    """Killed in epoch 2 and resumed: the resumed process trains 2 epochs (its summary.json says epochs_run 2),
    the metrics file holds all 3; the report counts those, against the 3 the run's config plans."""
    root, *_ = inspect_cache(tmp_path / "c", n=30)
    run = tmp_path / "run"
    writer = MetricsWriter(run / "metrics.jsonl")
    figures = [(2.3456789, 0.1234567, 1834.56, 0.0312345), (1.8765432, 0.3456789, 1901.2, 0.02),
               (1.2345678, 0.2987654, 1950.7, 0.0123456)]
    for epoch, (loss, top1, rate, wait) in enumerate(figures):
        writer.write("epoch", epoch=epoch, global_step=4 * (epoch + 1), train_loss=loss, val_loss=loss + 0.1,
                     val_top1=top1, val_top5=min(1.0, top1 + 0.4), img_per_s=rate, data_wait=wait)
    (run / "config.json").write_text(json.dumps({"epochs": 3, "model": "resnet18"}))
    (run / "summary.json").write_text(json.dumps({"epochs_run": 2, "epoch": 2, "val_top1": 0.2987654}))
    res = CliRunner().invoke(report_command, [str(root), "--out", str(tmp_path / "r"), "--run", str(run)])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    section = page[page.index("<h2>Training</h2>"):]
    rows = dict(re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td></tr>", section))
    assert rows == {"epochs": "3 of 3", "last epoch": "3", "train loss": "1.2346", "val loss": "1.3346",
                    "val top-1": "29.9%", "val top-5": "69.9%", "throughput": "1,951 img/s",
                    "data wait": "1.2% of step time", "best val top-1": "34.6% (epoch 2)"}, rows
