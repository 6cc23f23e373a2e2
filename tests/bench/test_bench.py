"""The benchmark harness (bench/): its whole code path on a tiny set, and the files it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import peers
from bench.harness import PROFILES, SCHEMA, main, run
from bench.report import CHARTS, goals
from bench.stats import ratio, summary
from tests.repo import REPO

OWN_BUILDS = {"bare_decode", "naive_npy", "cachebuild_npy", "cachebuild_zarr", "cachebuild_jpeg",
              "bare_decode_process", "cachebuild_npy_process", "bare_decode_process_base",
              "cachebuild_npy_process_base"}
RAW_LOADS = {"imagefolder_pil", "scriptable", "naive_npy", "cachebuild_npy_dataloader",
             "cachebuild_npy_dataloader_plain", "cachebuild_zarr_dataloader", "cachebuild_jpeg_dataloader",
             "limit_bare_gather", "limit_bare_decode"}
# the augmented group only: the crop and flip per sample in the DataLoader's workers
CROP_IN_LOADER = {f"cachebuild_{s}_{how}_in_workers" for s in ("npy", "jpeg") for how in ("crop", "fused")}
GLIBC = "glibc.cpu.x86_non_temporal_threshold=0x20000"
GLIBC_DEFAULT_LOADS = {"cachebuild_npy_dataloader_glibc_default", "limit_bare_gather_glibc_default"}
TRAINS = {"imagefolder_pil", "scriptable", "naive_npy", "cachebuild_dataloader", "cachebuild_crop_in_workers"}


def _check_summary(s: dict[str, Any], runs: int) -> None:
    assert len(s["runs"]) == runs and s["min"] <= s["median"] <= s["max"] and s["min"] > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("results")
    cfg = {**PROFILES["tiny"], "profile": "tiny", "peers": False, "gpu": True, "jobs": 1}
    with pytest.MonkeyPatch.context() as mp:  # as `make bench BENCH_GLIBC=...`: the copy-bound rows again without
        mp.setenv("GLIBC_TUNABLES", GLIBC)
        res = run(cfg, out, tmp_path_factory.mktemp("work"), ("build", "load", "transforms", "train", "gpu"),
                  "test", log=lambda _m: None)
    return out, res


@pytest.mark.slow  # the whole tiny run: ~35 s of children (builds, loaders, training)
def test_results_json_has_every_section_and_the_machine(tiny_run) -> None:
    out, res = tiny_run
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(res))  # what was returned is what was written
    assert on_disk["schema"] == SCHEMA and "error" not in on_disk
    m = on_disk["machine"]
    assert m["cpu"] and m["cores_logical"] >= 1 and m["ram_gb"] > 0 and m["os"] and m["python"]
    assert {"torch", "opencv", "zarr", "numpy"} <= {k for k, v in m["versions"].items() if v}
    notes = " ".join(on_disk["run"]["notes"])
    assert "Warm-ups are left out" in notes and "Page cache: warm" in notes and "estimate" in notes
    # peers: each skipped, with the reason, and the settings it would run with
    assert set(on_disk["peers"]) == set(peers.PEERS)
    assert all(p["status"].startswith("skipped: peers not requested") and p["settings"]
               for p in on_disk["peers"].values())


@pytest.mark.slow  # the whole tiny run
def test_url_loads_from_s3_and_http_shuffled_and_sequential(tiny_run) -> None:
    out, res = tiny_run
    remote = res["load"]["remote"]
    assert set(remote["rows"]) == {f"cachebuild_npy_{s}{m}" for s in ("s3", "http")
                                   for m in ("", "_windowed", "_sequential")} | {"cachebuild_npy_serve"}
    for row in remote["rows"].values():
        assert row["cold_img_s"] > 0 and row["warm_img_s"]["median"] > 0
    assert "## Load from URLs" in (out / "results.md").read_text()


@pytest.mark.slow  # the whole tiny run: ~35 s of children (builds, loaders, training)
def test_build_section(tiny_run) -> None:
    _, res = tiny_run
    b = res["build"]
    assert set(b["contenders"]) == OWN_BUILDS and not b["failed"]
    for key, row in b["contenders"].items():
        _check_summary(row["img_s"], 1)
        assert row["peak_pss_mb"]["median"] > 0 and row["peak_rss_mb"]["median"] >= row["peak_pss_mb"]["median"]
        if not key.startswith("bare_decode"):
            assert row["bytes_on_disk"] > 0 and row["mb_s"]["median"] > 0 and row["x_bare_decode"]["median"] > 0
    assert b["images"] == b["contenders"]["cachebuild_npy_process"]["images"] == 40
    assert b["contenders"]["cachebuild_npy_process_base"]["images"] == 20
    steady = b["steady_state"]  # the difference of the 40- and 20-photo runs of each, per round
    assert steady["images"] == 20 and len(steady["rounds"]) == 1
    assert steady["x_bare_decode"]["median"] == pytest.approx(steady["rounds"][0], abs=1e-3)  # (rounded)
    assert steady["rounds"][0] == pytest.approx(steady["cachebuild_img_s"]["median"] / steady["bare_img_s"]["median"],
                                                rel=0.01)
    # 40 images of 64 x 64 x 3 bytes each were written by each cache
    assert res["build"]["contenders"]["cachebuild_npy"]["bytes_on_disk"] >= 40 * 64 * 64 * 3


@pytest.mark.slow  # the whole tiny run: ~35 s of children (builds, loaders, training)
def test_load_section(tiny_run) -> None:
    _, res = tiny_run
    raw, aug = res["load"]["groups"]["raw"], res["load"]["groups"]["augmented"]
    assert set(raw) == RAW_LOADS | GLIBC_DEFAULT_LOADS
    # measured in a child without GLIBC_TUNABLES, each against the limit measured in that child
    assert raw["limit_bare_gather_glibc_default"]["x_bare_gather"] == 1.0
    assert "without GLIBC_TUNABLES" in raw["cachebuild_npy_dataloader_glibc_default"]["label"]
    assert any(GLIBC in note for note in res["run"]["notes"])
    assert res["machine"]["glibc_tunables"] == GLIBC
    assert set(aug) == (RAW_LOADS | CROP_IN_LOADER) - {"limit_bare_gather", "limit_bare_decode",
                                                       "cachebuild_npy_dataloader_plain", "cachebuild_zarr_dataloader"}
    for rows in (raw, aug):
        for row in rows.values():
            _check_summary(row["img_s"], 1)
        assert rows["imagefolder_pil"]["x_imagefolder"] == 1.0
    assert raw["limit_bare_gather"]["x_bare_gather"] == 1.0 and raw["cachebuild_npy_dataloader"]["gb_s"] > 0


@pytest.mark.slow  # the whole tiny run: ~35 s of children (builds, loaders, training)
def test_transforms_train_and_gpu_sections(tiny_run) -> None:
    _, res = tiny_run
    tf = res["transforms"]["contenders"]
    assert {"v1_scripted", "eager", "scripted"} <= set(tf) and "compiled" not in tf  # tiny: no torch.compile
    tr = res["train"]
    assert set(tr["contenders"]) == TRAINS and tr["images"] == 32
    for row in tr["contenders"].values():
        _check_summary(row["epoch_s"], 1)
        assert len(row["losses"]) == 32 // 8 and all(v > 0 for v in row["losses"])
        assert set(row["step_ms"]) == {"data_wait", "h2d", "transforms", "fwd_bwd"} and row["step_ms"]["fwd_bwd"] > 0
        # The four parts are disjoint spans of each step that tile the epoch (a part left untimed, or timed
        # twice, breaks the sum), and the data-wait share is its part of the epoch's time.
        epoch_s, steps = sum(row["epoch_s"]["runs"]), len(row["losses"])
        assert abs(sum(row["step_ms"].values()) * steps / 1e3 - epoch_s) <= 0.1 * epoch_s + 2e-3
        wait_s = row["step_ms"]["data_wait"] * steps / 1e3
        assert wait_s > 0 and abs(row["data_wait_share"]["median"] * epoch_s - wait_s) <= 0.05 * epoch_s + 1e-3
    if torch.cuda.is_available():
        assert {"transforms_bf16", "h2d", "resnet50"} <= set(res["gpu"])
    else:
        assert res["gpu"] == {"skipped": "no CUDA device on this machine"}


@pytest.mark.slow  # the whole tiny run: ~35 s of children (builds, loaders, training)
def test_markdown_charts_and_goals(tiny_run) -> None:
    out, res = tiny_run
    md = (out / "results.md").read_text()
    for title in ("## Goals", "## Build:", "## Load:", "### raw", "### augmented", "## Device transforms (CPU)",
                  "## Training (CPU)", "## Peers", "## GPU: not measured" if not torch.cuda.is_available() else "CUDA"):
        assert title in md, title
    for section in ("build", "transforms", "train"):
        for row in res[section]["contenders"].values():
            assert row["label"] in md
    for chart in CHARTS:
        data = (out / chart).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, chart
        assert f"({chart})" in md
    assert [g["goal"].split(":")[0] for g in res["goals"]] == ["build"] + ["load"] * 5
    ffcv = next(g for g in res["goals"] if "FFCV" in g["goal"])
    assert ffcv["measured"] is None and ffcv["met"] is None  # not measured: not counted as met or missed


def test_goals_and_stats() -> None:
    s = summary([3.0, 1.0, 2.0])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert ratio(summary([8.0]), summary([10.0])) == 0.8 and ratio(None, s) is None
    with pytest.raises(ValueError):
        summary([])
    res = {"build": {"contenders": {"cachebuild_npy": {"x_bare_decode": summary([0.85, 0.7, 0.82])}},
                     "steady_state": {"images": 18000, "x_bare_decode": summary([0.74, 0.76, 0.8])}},
           "load": {"groups": {"raw": {"cachebuild_npy_dataloader": {"img_s": summary([100.0])},
                                       "cachebuild_npy_dataloader_plain": {"img_s": summary([79.0])},
                                       "imagefolder_pil": {"img_s": summary([2.0])}}}}}
    got = [(g["measured"], g["met"]) for g in goals(res)]
    # build / bare decode in steady state; plain / collate_batch; DataLoader / ImageFolder; / FFCV; DataLoader / gather
    assert got == [(0.76, True), (0.79, False), (50.0, True), (None, None), (None, None)]
    res["load"]["groups"]["raw"]["limit_bare_gather"] = {"img_s": summary([170.0])}
    assert [(g["measured"], g["met"]) for g in goals(res)][-1] == (0.588, False)  # the goal is 0.6x of the gather
    res["load"]["groups"]["raw"]["limit_bare_gather"] = {"img_s": summary([160.0])}
    assert [(g["measured"], g["met"]) for g in goals(res)][-1] == (0.625, True)
    assert "steady state (18,000 photos" in goals(res)[0]["goal"]
    res["build"]["steady_state"]["x_bare_decode"] = summary([0.749])
    assert goals(res)[0]["met"] is False  # the goal is 0.75x of bare decode
    del res["build"]["steady_state"]  # results written before the steady state: the timed part's row
    assert (goals(res)[0]["measured"], goals(res)[0]["met"]) == (0.82, True)
    raw = res["load"]["groups"]["raw"]
    raw["cachebuild_npy_dataloader_glibc_default"] = {"img_s": summary([55.0])}
    raw["limit_bare_gather_glibc_default"] = {"img_s": summary([100.0])}
    assert [(g["measured"], g["met"]) for g in goals(res)][-1] == (0.55, False)


def test_a_cold_epoch_from_cachebuild_serve_beside_the_s3_row(tmp_path: Path) -> None:
    """The serve row on the tiny profile: the shuffled S3 row's loader (same cache, same loader) over `cachebuild
    serve`, its bearer token in the loader's environment only while it reads."""
    from bench.sections.peers_remote import serve_row
    from tests.loaders_fixtures import make_cache

    cfg = {**PROFILES["tiny"], "profile": "tiny"}
    cache, _, _ = make_cache(tmp_path / "site" / "cache", n=cfg["n"], shard_size=16, h=cfg["size"], w=cfg["size"])
    before = os.environ.get("CACHEBUILD_HTTP_TOKEN")
    row = serve_row(cache, cfg, 2, tmp_path)  # raises unless every epoch delivered every sample
    assert "`cachebuild serve`" in row["label"] and row["cold_img_s"] > 0 and row["warm_img_s"]["median"] > 0
    assert os.environ.get("CACHEBUILD_HTTP_TOKEN") == before
    assert not (tmp_path / "site" / ".store").exists()  # a folder that is no store gets no record


def test_peer_venvs_absent_are_skipped_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_VENVS", str(tmp_path))
    skipped: dict[str, str] = {}
    cfg = {**PROFILES["tiny"], "peers": True}
    assert peers.build_contenders(cfg, tmp_path / "files.json", skipped) == []
    assert set(skipped) == set(peers.PEERS) and all("make bench-peers" in why for why in skipped.values())
    (tmp_path / "webdataset" / "bin").mkdir(parents=True)
    (tmp_path / "webdataset" / "bin" / "python").symlink_to(sys.executable)
    skipped.clear()
    made = peers.build_contenders(cfg, tmp_path / "files.json", skipped)
    assert [c["key"] for c in made] == ["webdataset_raw"] and set(skipped) == set(peers.PEERS) - {"webdataset"}
    cmd = made[0]["command"](tmp_path / "out")
    assert cmd[0] == str(tmp_path / "webdataset" / "bin" / "python") and "--workers" in cmd


def test_peers_without_a_build_load_the_jpegs_or_our_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DALI, SPDL and datago have no writer: they load the JPEG list (DALI also our npy cache); a missing venv
    is skipped with the reason, a missing input too."""
    monkeypatch.setenv("BENCH_VENVS", str(tmp_path))
    cfg = {**PROFILES["tiny"], "peers": True}
    files, cache = tmp_path / "files.json", tmp_path / "npy"
    skipped: dict[str, str] = {}
    assert peers.load_contenders(cfg, {"cachebuild_npy": cache}, skipped, files) == []
    assert {"dali", "spdl", "datago", "streaming"} <= set(skipped)
    assert all("make bench-peers" in skipped[k] for k in ("dali", "spdl", "datago"))
    (tmp_path / "dali" / "bin").mkdir(parents=True)
    (tmp_path / "dali" / "bin" / "python").symlink_to(sys.executable)
    skipped.clear()
    made = {c["key"]: c for c in peers.load_contenders(cfg, {"cachebuild_npy": cache}, skipped, files)}
    assert set(made) == {"dali_jpeg", "dali_cache"} and "threads" in made["dali_jpeg"]["label"]
    jpeg, npy = made["dali_jpeg"]["command"](3), made["dali_cache"]["command"](3)
    assert jpeg[jpeg.index("--files") + 1] == str(files) and npy[npy.index("--data") + 1] == str(cache)
    assert npy[npy.index("--mode") + 1] == "cache" and npy[npy.index("--workers") + 1] == str(cfg["workers"])
    skipped.clear()  # no npy cache built: the row that reads it is skipped with the reason
    made = {c["key"]: c for c in peers.load_contenders(cfg, {}, skipped, files)}
    assert set(made) == {"dali_jpeg"} and "cachebuild_npy" in skipped["dali_cache"]


def test_a_missing_peer_venv_is_recorded_in_the_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_VENVS", str(tmp_path / "none"))
    cfg = {**PROFILES["tiny"], "profile": "tiny", "peers": True, "gpu": False, "jobs": 1}
    res = run(cfg, tmp_path / "out", tmp_path / "work", (), "test", log=lambda _m: None)
    for name in peers.PEERS:
        p = res["peers"][name]
        assert p["status"] == f"skipped: no venv at {tmp_path / 'none' / name} (make bench-peers makes it)"
        assert p["settings"] and p["version"] is None
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Peers side by side" in md and "No peer measured in this run" in md and "dali" in md


def test_the_comparison_takes_cachebuilds_fastest_loader_and_names_a_peer_ahead() -> None:
    """Fast: the ratios and the sentence on a results structure made here (the tiny run's version is slow)."""
    from bench.compare import comparisons, peer_lines

    raw = {"cachebuild_npy_dataloader": {"label": "cachebuild npy: DataLoader", "img_s": summary([1000.0])},
           "cachebuild_zarr_dataloader": {"label": "cachebuild zarr: DataLoader", "img_s": summary([3000.0])},
           "cachebuild_npy_glibc_default": {"label": "re-measure, glibc defaults", "img_s": summary([9000.0])},
           "dali_jpeg": {"label": "DALI CPU pipeline from the JPEGs, 2 threads", "img_s": summary([6000.0])},
           "spdl_jpeg": {"label": "SPDL from the JPEGs, 2 threads", "img_s": summary([750.0])}}
    res = {"load": {"groups": {"raw": raw}}}
    rows = {r["peer"].split(",")[0]: r for r in comparisons(res)}
    assert rows["DALI CPU pipeline from the JPEGs"]["x"] == 0.5 and rows["SPDL from the JPEGs"]["x"] == 4.0
    assert rows["SPDL from the JPEGs"]["ours"] == "cachebuild zarr: DataLoader"  # the fastest, glibc re-run aside
    text = "\n".join(peer_lines(res))
    assert "DALI CPU pipeline from the JPEGs, 2 threads by 2.00x" in text
    assert "SPDL from the JPEGs, 2 threads by" not in text


def test_every_cachebuild_row_is_listed_with_each_peer_ahead_of_it_and_url_rows_by_store() -> None:
    """Not only the fastest loader: a slower cachebuild row names every peer row ahead of it, with its margin; the
    URL rows compare cachebuild's faster row of a store (shuffled or sequential) with each peer of that store."""
    from bench.compare import comparisons, every_row_lines

    raw = {"cachebuild_npy_dataloader": {"label": "cachebuild npy: DataLoader", "img_s": summary([1000.0])},
           "cachebuild_jpeg_dataloader": {"label": "cachebuild jpeg: DataLoader", "img_s": summary([400.0])},
           "ffcv_raw": {"label": "FFCV raw", "img_s": summary([800.0])},
           "dali_jpeg": {"label": "DALI JPEGs", "img_s": summary([500.0])}}

    def url_row(label: str, cold: float, warm: float) -> dict:
        return {"label": label, "cold_img_s": cold, "warm_img_s": summary([warm])}

    remote = {"cachebuild_npy_s3": url_row("ours S3 shuffled", 900.0, 9000.0),
              "cachebuild_npy_s3_sequential": url_row("ours S3 sequential", 1500.0, 8000.0),
              "streaming_s3": url_row("Streaming S3", 1200.0, 3000.0),
              "webdataset_http": url_row("WebDataset HTTP", 100.0, 300.0)}
    res = {"load": {"groups": {"raw": raw}, "remote": {"rows": remote}}}
    text = "\n".join(every_row_lines(res))
    assert "| load, raw | cachebuild npy: DataLoader | 1,000 | none |" in text
    behind = "FFCV raw: 800 (**0.50x**); DALI JPEGs: 500 (**0.80x**)"
    assert f"| load, raw | cachebuild jpeg: DataLoader | 400 | {behind} |" in text
    assert "| load from S3, cold epoch | ours S3 shuffled | 900 | Streaming S3: 1,200 (**0.75x**) |" in text
    assert "WebDataset HTTP" not in text  # no cachebuild HTTP row in this run: nothing to compare it with
    rows = [r for r in comparisons(res) if r["table"].startswith("load from S3")]
    assert [(r["table"], r["ours"], r["x"]) for r in rows] == [
        ("load from S3, cold epoch", "ours S3 sequential", 1.25),
        ("load from S3, warm epochs", "ours S3 shuffled", 3.0)]


@pytest.mark.slow
def test_the_comparison_names_a_peer_ahead_and_by_how_much(tiny_run, tmp_path: Path) -> None:
    from bench.compare import comparisons, peer_lines
    from doctools.performance import update_readme

    _, res = tiny_run
    res = json.loads(json.dumps(res))
    ours = res["load"]["groups"]["raw"]
    # cachebuild's fastest loader, as the comparison takes it (the glibc-default re-measure is no contender)
    best = max(v["img_s"]["median"] for k, v in ours.items()
               if k.startswith("cachebuild_") and "glibc_default" not in k)
    ours["dali_jpeg"] = {"label": "DALI CPU pipeline from the JPEGs, 2 threads", "img_s": summary([best * 2])}
    ours["spdl_jpeg"] = {"label": "SPDL from the JPEGs, 2 threads", "img_s": summary([best / 4])}
    rows = {r["peer"].split(",")[0]: r for r in comparisons(res)}
    assert rows["DALI CPU pipeline from the JPEGs"]["x"] == 0.5 and rows["SPDL from the JPEGs"]["x"] == 4.0
    text = "\n".join(peer_lines(res))
    assert ("ahead of cachebuild in this run: load, raw: DALI CPU pipeline from the JPEGs, 2 threads by 2.00x "
            "(medians") in text
    assert "SPDL from the JPEGs, 2 threads by" not in text
    # the README's peers block alone is rewritten from the folder; the others are left as they are
    run_dir = tmp_path / "run"  # a copy: the module's run folder stays as it was written
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps(res))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:performance:begin -->\nKEEP\n<!-- bench:performance:end -->\n"
                      "<!-- bench:peers:begin -->\nOLD\n<!-- bench:peers:end -->\n")
    update_readme(run_dir, readme, blocks=("peers",))
    body = readme.read_text()
    assert "KEEP" in body and "OLD" not in body and "by 2.00x" in body and "| dali | - |" in body


def test_unknown_section_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--sections", "build,nope"])
    assert e.value.code == 2 and "unknown section(s) nope" in capsys.readouterr().err


@pytest.mark.slow
def test_a_peer_runs_in_the_harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The WebDataset peer through the child protocol, with this python standing in for its venv's."""
    venvs = tmp_path / "venvs"
    (venvs / "webdataset" / "bin").mkdir(parents=True)
    (venvs / "webdataset" / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("BENCH_VENVS", str(venvs))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    cfg = {**PROFILES["tiny"], "profile": "tiny", "peers": True, "gpu": False, "jobs": 1}
    res = run(cfg, tmp_path / "out", tmp_path / "work", ("build", "load"), "test", log=lambda _m: None)
    row = res["build"]["contenders"]["webdataset_raw"]
    assert row["images"] == 40 and row["bytes_on_disk"] >= 40 * 64 * 64 * 3
    assert {"webdataset_raw"} <= set(res["load"]["groups"]["raw"]) & set(res["load"]["groups"]["augmented"])
    assert res["peers"]["webdataset"]["status"] == "ran"
    assert res["peers"]["ffcv"]["status"].startswith("skipped: no venv")


@pytest.mark.slow  # the whole tiny run: ~35 s of children (builds, loaders, training)
def test_readme_sections_come_from_the_results_folder(tiny_run, tmp_path: Path) -> None:
    from doctools.performance import update_readme

    out, res = tiny_run
    readme = out.parent / "README.md"
    readme.write_text("# x\n<!-- bench:performance:begin -->\nOLD-CONTENT\n<!-- bench:performance:end -->\n\n"
                      "## ImageNet on paper\n<!-- bench:imagenet:begin -->\n<!-- bench:imagenet:end -->\ntail\n")
    update_readme(out, readme)
    once = readme.read_text()
    update_readme(out, readme)  # idempotent: a rerun replaces the sections whole
    text = readme.read_text()
    assert text == once and "OLD-CONTENT" not in text and text.endswith("tail\n")
    assert f"]({out.name}/results.md)" in text and f"({out.name}/load.png)" in text
    npy = res["build"]["contenders"]["cachebuild_npy"]["img_s"]["median"]
    assert f"{npy:,.0f} img/s" in text  # the measured rate, from results.json
    assert "| 224 | 150,528 | 192.9 GB |" in text  # exact arithmetic: 1,281,167 x 224 x 224 x 3 bytes
    assert "**estimate" in text and "**assumed**" in text and "tiny` run" in text
    (tmp_path / "README.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- bench:performance:begin -->"):
        update_readme(out, tmp_path / "README.md")


def _check_remote(f: dict[str, Any]) -> None:
    assert 1.0 <= f["http_cold_bytes_vs_needed"] <= 1.2 and f["http_block_cache_warm_img_s"] > 0


def _check_compact(f: dict[str, Any]) -> None:
    assert f["served_equals_plain_decode"]["simplejpeg"] is True and f["size"]["jpeg_over_raw"] < 0.5
    assert f["ffcv_jpeg"] == {"skipped": "peers not requested (--no-ffcv)"}


def _check_share(f: list[dict[str, Any]]) -> None:
    assert f and all(row["rerun"] == "up to date" for row in f)


def _check_quality(f: dict[str, Any]) -> None:
    quality = f["psnr_db_64"]  # against torchvision, on 20 real photos
    assert quality["files"] == 20 and 0 < quality["decoded_reduced"] <= 20
    assert quality["full_decode"]["median"] >= 45 and quality["default"]["median"] >= 40


def _check_plan(f: dict[str, Any]) -> None:
    n = f["shards"] * f["per_shard"]  # every sample of every WebDataset tar and Parquet file planned
    assert all(f[k]["samples"] == n and f[k]["samples_per_s"] > 0 for k in ("wds", "wds_1job", "parquet"))


SCRIPT_CHECKS = {"remote": _check_remote, "compact": _check_compact, "share": _check_share,
                 "quality": _check_quality, "plan": _check_plan}


@pytest.mark.parametrize("sections", [
    pytest.param(("share", "plan"), id="share-plan"),  # seconds: the default run's share of the child protocol
    pytest.param(("remote", "compact", "quality"), id="remote-compact-quality", marks=pytest.mark.slow),
])
def test_the_script_sections_run_in_the_harness(tmp_path: Path, sections: tuple[str, ...]) -> None:
    """remote, compact, share, quality, plan: each script runs as a section, its figures land in results.json and
    results.md, and they say what the scripts measure (not just that they ran)."""
    from bench.sections.extras import EXTRA_SECTIONS

    assert set(SCRIPT_CHECKS) == set(EXTRA_SECTIONS)  # a new script gets its checks here
    cfg = {**PROFILES["tiny"], "profile": "tiny", "peers": False, "gpu": False, "jobs": 1}
    res = run(cfg, tmp_path / "out", tmp_path / "work", sections, "test", log=lambda _m: None)
    assert all("figures" in res[s] for s in sections), {s: res[s].get("failed") for s in sections}
    for s in sections:
        SCRIPT_CHECKS[s](res[s]["figures"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert all(EXTRA_SECTIONS[s][1] in md for s in sections)
    assert ("http_cold_bytes_vs_needed" in md) == ("remote" in sections)
    # The harness's own part of results.json, in the default run too (the full tiny run is behind slow).
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(res)) and on_disk["schema"] == SCHEMA and "error" not in on_disk
    m = on_disk["machine"]
    assert m["cpu"] and m["cores_logical"] >= 1 and m["ram_gb"] > 0 and m["os"] and m["python"]
    assert set(on_disk["peers"]) == set(peers.PEERS)


def test_a_timed_epoch_runs_with_the_harness_heap_collected_and_frozen() -> None:
    """A full collection of the harness's heap inside a short epoch would be billed to whichever contender
    happened to trigger it; each timed epoch (and the limit's) starts collected with the heap frozen."""
    import gc

    from bench.sections.load import _count

    seen: list[int] = []

    def epoch():
        seen.append(gc.get_freeze_count())
        yield (list(range(3)),)

    junk = [[i] for i in range(1000)]
    n, _ = _count(epoch)
    assert n == 3 and seen and seen[0] >= len(junk)
    assert gc.get_freeze_count() == 0  # unfrozen after the epoch


def test_the_gpu_peer_check_is_wired_and_says_what_it_skipped(tmp_path: Path) -> None:
    """.ci/gpu-checks runs bench/scripts/gpu_peers.py (DALI nvJPEG vs device_loader(decode="cuda")); without CUDA
    it exits 0 and its JSON names why nothing was measured."""
    import subprocess

    root = REPO
    assert "bench/scripts/gpu_peers.py" in (root / ".ci" / "gpu-checks").read_text()
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine measures it in .ci/gpu-checks")
    out = tmp_path / "gpu-peers.json"
    script = root / "bench" / "scripts" / "gpu_peers.py"
    r = subprocess.run([sys.executable, str(script), "--n", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["skipped"] == "no CUDA device on this machine"


def test_a_whole_process_row_starts_its_clock_at_the_process_start() -> None:
    """Not up to a second early (psutil's create_time adds the kernel's ticks to a whole-second btime: every
    whole-process row, the bare limit's too, paid up to 1 s more): within the kernel's 10 ms tick of the spawn."""
    code = "from bench.sections.build_child import _process_start; print(repr(_process_start()))"
    before = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    after = time.time()
    started = float(done.stdout)
    assert before - 0.02 <= started <= after, (before, started, after)


def test_the_stage_profile_times_every_stage_the_build_runs(tmp_path: Path) -> None:
    """bench.scripts.build_stages wraps the build's own functions: every file passes the read and the decode
    clocks (a renamed or no longer called stage would read 0 here), the stages and the rest add up to the
    build, and the bare decoder ran on the same files."""
    from cachebuild.samples.imagenet_layout import write_imagenet

    write_imagenet(tmp_path / "src", n_classes=3, train_per_class=4, val_per_class=0, seed=1)
    out = tmp_path / "stages.json"
    r = subprocess.run([sys.executable, "-m", "bench.scripts.build_stages", "--src", str(tmp_path / "src"),
                        "--size", "64", "--rounds", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())["rounds"][0]
    assert row["images"] == 12
    for stage in ("read", "decode", "resize", "write_and_hash", "bare_decode"):
        assert row[f"{stage}_ms"] > 0, stage
    assert 0 < row["antialias_calls"] <= row["images"]  # the fixture's large photos downscale >= 2x at 64 px
    stages = sum(row[f"{k}_ms"] for k in ("read", "decode", "resize", "write_and_hash"))
    assert abs(stages + row["other_ms"] - row["build_ms"]) < 1e-9
    assert 0 <= row["other_ms"] < row["build_ms"]


def test_the_steady_state_rows_run_on_two_sets_of_the_same_photos(tmp_path: Path) -> None:
    """The build goal is read from whole-process runs on 20,000 photos and on 2,000 of them, in the quick profile
    too: their difference leaves each contender's start-up out. Every other row builds the profile's own set."""
    from bench.sections.build import own_contenders, steady_state

    for profile in ("quick", "full"):
        assert PROFILES[profile]["steady_n"] >= 20000 > PROFILES[profile]["steady_base"] * 2
    small, base, big = tmp_path / "small", tmp_path / "base", tmp_path / "big"
    sets = ((base, 2000, tmp_path / "base.json"), (big, 20000, tmp_path / "big.json"))
    rows = {c.key: c for c in own_contenders(small, 500, 224, 2, 3, tmp_path / "s.json", sets)}
    on = {"bare_decode_process": (big, 20000), "cachebuild_npy_process": (big, 20000),
          "bare_decode_process_base": (base, 2000), "cachebuild_npy_process_base": (base, 2000)}
    for key, c in rows.items():
        cmd = c.command(tmp_path / "out")
        assert (Path(cmd[cmd.index("--src") + 1]), c.images) == on.get(key, (small, 500)), key
        assert ("--whole-process" in cmd) == (key in on), key
    bare = rows["bare_decode_process_base"].command(tmp_path / "out")
    assert bare[bare.index("--scales") + 1] == str(tmp_path / "base.json")  # that set's DCT scales
    # 2,000 photos in 2 s and 20,000 in 11 s: 18,000 in 9 s, 2,000 img/s, whatever the start-up was
    runs = {"bare_decode_process": {"img_s": [20000 / 7.0]}, "bare_decode_process_base": {"img_s": [2000 / 1.0]},
            "cachebuild_npy_process": {"img_s": [20000 / 11.0]}, "cachebuild_npy_process_base": {"img_s": [1000.0]}}
    steady = steady_state(runs, {k: v for k, (_, v) in on.items()})
    assert steady["images"] == 18000
    assert steady["cachebuild_img_s"]["median"] == 2000.0 and steady["bare_img_s"]["median"] == 3000.0
    assert steady["x_bare_decode"]["median"] == pytest.approx(2 / 3, abs=1e-3)


def test_the_code_paths_trace_counts_what_a_build_and_a_read_run(tmp_path: Path) -> None:
    """bench.scripts.code_paths traces a real build and a real read: the build ran the block and the decode of
    a sample, the sample's way is a subset of the build's files, and the read opened the cache it built."""
    out = tmp_path / "paths.json"
    r = subprocess.run([sys.executable, "-m", "bench.scripts.code_paths", "--json", str(out)], capture_output=True,
                       text=True, timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    build, sample, read = got["build"], got["sample"], got["read"]
    assert set(sample["file_list"]) <= set(build["file_list"])
    assert 1 <= sample["files"] < build["files"] and sample["depth"] < build["depth"]
    assert any(f.startswith("loaders/") for f in read["file_list"])
    assert any("manifest" in f for f in read["file_list"]) and any("manifest" in f for f in build["file_list"])
    assert got["product"]["lines"] > 1000 and got["product"]["modules"] == len(
        [p for name in ("cachebuild", "loaders") for p in (REPO / name).rglob("*.py")])


def test_a_section_run_alone_builds_its_caches_without_a_steady_state_figure(tmp_path: Path) -> None:
    """``--sections train`` builds the caches it reads in one untimed round, whose whole-process rows run on one
    set: no steady state comes of it (the difference of two equal sets divided by zero)."""
    cfg = {**PROFILES["tiny"], "profile": "tiny", "peers": False, "gpu": False, "jobs": 1}
    res = run(cfg, tmp_path / "out", tmp_path / "work", ("train",), "test", log=lambda _m: None)
    assert "build" not in res and res["train"]["contenders"], res.get("train")
