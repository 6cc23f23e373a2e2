"""The team store in one process: a recipe's cache built once and published under its build key (a shared folder,
moto's S3), found and pulled (nothing decoded) by the next request, resolved to its URL from the recipe alone; a
build running elsewhere named (``--no-wait``) or waited for, a dead builder's claim taken over; what is not the
recipe's cache never used. The races between real processes: tests/cachebuild/share/test_store_race.py."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import cachebuild
from cachebuild.builder import block as block_module
from cachebuild.builder import pipeline
from cachebuild.cli import main
from cachebuild.errors import CacheCorruptError, CacheNotFoundError, OptionError
from cachebuild.share import store_build
from cachebuild.share.store import Store, plan_wanted
from cachebuild.share.store_build import StoreBusyError
from cachebuild.storage.cache import current_host, open_cache, read_manifest
from loaders.dataset import CachedImageDataset
from tests.trees import tree_bytes

RECIPE: dict[str, Any] = {"split": "train", "size": 32, "block_size": 8, "jobs": 1, "progress": False}
FLAGS = ["--split", "train", "--size", "32", "--shard-size", "8", "-j", "1", "--no-progress"]
MARKER = "push-in-progress.json"


def _cli(*args: object, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def _src(info: dict[str, Any]) -> Path:
    return Path(info["root"])


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build without --out for an object store writes where builds without --out do: here, a temporary folder."""
    monkeypatch.setenv("CACHEBUILD_HOME", str(tmp_path / "home"))


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The source files decoded in this process from now on."""
    seen: list[str] = []
    real = block_module.decode_into

    def counting(data: Any, spec: Any, out: Any, *, path: str = "") -> Any:
        seen.append(path)
        return real(data, spec, out, path=path)

    monkeypatch.setattr(block_module, "decode_into", counting)
    return seen


def same_cache(a: Path, b: Path) -> bool:
    """Two builds of one recipe: every file byte for byte, the manifest but for when it was made and when the
    source was listed (and its own checksum, of those bytes)."""
    def without_time(root: Path) -> dict[str, Any]:
        doc = json.loads((root / "manifest.json").read_bytes())
        doc["source"].get("inputs", {}).pop("listed_ns", None)
        return {k: v for k, v in doc.items() if k not in ("created", "checksum")}

    files = {k: v for k, v in tree_bytes(a).items() if k != "manifest.json"}
    return files == {k: v for k, v in tree_bytes(b).items() if k != "manifest.json"} and \
        without_time(a) == without_time(b) and read_manifest(a).content_id == read_manifest(b).content_id


def _pixels(where: str | Path) -> np.ndarray:
    reader = open_cache(where)
    return reader.gather(np.arange(len(reader)))


# ---------------------------------------------------------------- a shared folder

def test_a_folder_store_builds_once_and_the_next_request_pulls_it_decoding_nothing(imagenet_clean, tmp_path,
                                                                                   decodes):
    store = tmp_path / "store"
    first = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "a", store=store, **RECIPE)
    (r,) = first
    assert r.status == "built" and decodes  # this one decoded
    name = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)[0].name
    assert r.url == str(store / name) and (store / name / "manifest.json").is_file()
    assert not (store / f"{name}.partial").exists() and (store / ".store" / "store.json").is_file()
    assert read_manifest(store / name).build_key == r.key  # published under its key
    decodes.clear()
    (again,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "b", store=store, **RECIPE)
    assert again.status == "found" and decodes == []  # nothing decoded: pulled, every file checked
    assert again.pulled is not None and again.pulled.status == "pulled" and again.path == tmp_path / "b" / "train"
    assert tree_bytes(tmp_path / "a" / "train") == tree_bytes(tmp_path / "b" / "train") == tree_bytes(store / name)
    (bare,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **RECIPE)
    assert bare.status == "found" and bare.path is None and bare.url == r.url and decodes == []


def test_the_cli_prints_the_url_and_pulls_with_out(imagenet_clean, tmp_path):
    store = tmp_path / "store"
    built = _cli("imagenet", _src(imagenet_clean), "--store", store, *FLAGS)
    assert built.exit_code == 0, built.output
    name = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)[0].name
    assert "imagenet/train: built (50 samples" in built.output and f"published: {store / name}" in built.output
    got = _cli("imagenet", _src(imagenet_clean), "--out", tmp_path / "mine", *FLAGS,
               env={"CACHEBUILD_STORE": str(store)})  # the store from the environment
    assert got.exit_code == 0, got.output
    assert "in the store (50 samples" in got.output and "nothing decoded" in got.output
    assert f"pulled to {tmp_path / 'mine' / 'train'}" in got.output
    assert np.array_equal(_pixels(tmp_path / "mine" / "train"), _pixels(store / name))


def test_another_recipe_is_another_cache(imagenet_clean, tmp_path, decodes):
    store = tmp_path / "store"
    (a,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **RECIPE)
    (b,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **{**RECIPE, "fit": "squash"})
    assert a.status == b.status == "built" and a.url != b.url and a.key != b.key


def test_force_and_update_are_refused_with_a_store(imagenet_clean, tmp_path):
    for flag in ("force", "update"):
        with pytest.raises(OptionError, match=f"--{flag} and --store exclude each other"):
            cachebuild.build("imagenet", _src(imagenet_clean), store=tmp_path / "s", **RECIPE, **{flag: True})
    assert not (tmp_path / "s").exists()


def test_a_damaged_or_foreign_cache_in_the_store_is_never_used(imagenet_clean, tmp_path, decodes):
    store = tmp_path / "store"
    (r,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **RECIPE)
    shard = sorted(Path(r.url).glob("images-*.npy"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    with pytest.raises(CacheCorruptError, match="fails its check"):
        cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "out", store=store, **RECIPE)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CacheCorruptError, match="fails its check"):
        cachebuild.resolve(store, "imagenet", _src(imagenet_clean), **RECIPE)


# ---------------------------------------------------------------- resolve

def test_resolve_names_the_cache_of_a_recipe_without_decoding(imagenet_clean, tmp_path, decodes):
    store = tmp_path / "store"
    with pytest.raises(CacheNotFoundError, match="holds no cache of this recipe"):
        cachebuild.resolve(store, "imagenet", _src(imagenet_clean), **RECIPE)
    absent = _cli("resolve", store, "--kind", "imagenet", "--source", _src(imagenet_clean), "--split", "train",
                  "--size", "32", "--shard-size", "8")
    assert absent.exit_code == 1 and absent.stdout == "" and "not in" in absent.stderr
    (r,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **RECIPE)
    decodes.clear()
    url = cachebuild.resolve(store, "imagenet", _src(imagenet_clean), **RECIPE)
    assert url == r.url and decodes == []
    ds = CachedImageDataset(url)
    assert np.array_equal(ds.gather(np.arange(len(ds))), _pixels(r.url))
    got = _cli("resolve", store, "--kind", "imagenet", "--source", _src(imagenet_clean), "--split", "train",
               "--size", "32", "--shard-size", "8")
    assert got.exit_code == 0 and got.stdout.strip() == url, got.output
    other = _cli("resolve", store, "--kind", "imagenet", "--source", _src(imagenet_clean), "--split", "train",
                 "--size", "32", "--shard-size", "8", "--fit", "pad")
    assert other.exit_code == 1  # another recipe: not there
    both = _cli("resolve", store, "--kind", "imagenet", "--source", _src(imagenet_clean), "--size", "32",
                "--shard-size", "8", "--json")
    rows = json.loads(both.stdout)
    assert both.exit_code == 1 and [(r["split"], r["found"]) for r in rows] == [("train", True), ("val", False)]
    with pytest.raises(OptionError, match="resolve one: pass split="):
        cachebuild.resolve(store, "imagenet", _src(imagenet_clean), size=32)
    wrong = _cli("resolve", store, "--kind", "imagenet", "--source", _src(imagenet_clean), "--image-field", "x")
    assert wrong.exit_code == 2 and "--image-field is not an option of `cachebuild imagenet`" in wrong.output
    assert decodes == []


def test_resolve_plans_the_source_and_finds_a_changed_source_absent(imagenet_clean, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(_src(imagenet_clean), src)
    store = tmp_path / "store"
    cachebuild.build("imagenet", src, store=store, **RECIPE)
    assert cachebuild.resolve(store, "imagenet", src, **RECIPE)
    victim = sorted((src / "train").rglob("*.JPEG"))[0]
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))  # a touched file
    with pytest.raises(CacheNotFoundError):
        cachebuild.resolve(store, "imagenet", src, **RECIPE)


# ---------------------------------------------------------------- a build running elsewhere

def _hold_folder_build(store: Path, name: str, blocks: int) -> Any:
    """What a build of ``name`` running in another process leaves: its lock held (by this process, from another
    open file: a build here cannot take it) naming its holder, and ``blocks`` block records done."""
    import fcntl

    lock = store / f"{name}.lock"
    store.mkdir(parents=True, exist_ok=True)
    f = open(lock, "w")  # noqa: SIM115 (held until the test closes it)
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(json.dumps({"host": "builder-7", "pid": 4242, "user": "ada", "started": "2026-12-06T01:00:00+00:00",
                        "command": "cachebuild imagenet /data/in --store /store"}))
    f.flush()
    records = store / f"{name}.partial" / "blocks"
    records.mkdir(parents=True)
    (store / f"{name}.partial" / "build.json").write_text(json.dumps({"key": "x"}))
    for b in range(blocks):
        (records / f"block-{b:05d}.json").write_text("{}")
    return f


def test_no_wait_names_the_build_running_in_a_folder_store_and_how_far_it_is(imagenet_clean, tmp_path, decodes):
    store = tmp_path / "store"
    (w,) = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)
    held = _hold_folder_build(store, w.name, 3)
    try:
        with pytest.raises(StoreBusyError) as err:
            cachebuild.build("imagenet", _src(imagenet_clean), store=store, wait=False, **RECIPE)
        msg = str(err.value)
        assert "pid 4242 on builder-7 (user ada)" in msg and "3 of 7 blocks built" in msg, msg
        r = _cli("imagenet", _src(imagenet_clean), "--store", store, "--no-wait", *FLAGS)
        assert r.exit_code == 1 and "is being built elsewhere: by pid 4242 on builder-7" in r.output, r.output
        assert decodes == []
    finally:
        held.close()
    # the holder is gone (its lock released): the next request takes the build over
    (r2,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **RECIPE)
    assert r2.status == "built" and read_manifest(r2.url).build_key == w.key


def _foreign_marker(s3: Any, prefix: str, renewed_s_ago: float = 0.0, pid: int = 4242) -> None:
    doc = {"building": {"what": "imagenet/train", "blocks_done": 2, "blocks": 7, "samples": 50},
           "holder": {"host": "builder-7", "pid": pid, "user": "ada", "started": "2026-12-06T01:00:00+00:00",
                      "command": "cachebuild imagenet /data/in --store s3://team/caches"},
           "token": "feedfeedfeedfeed",
           "renewed": (datetime.datetime.now(datetime.timezone.utc)
                       - datetime.timedelta(seconds=renewed_s_ago)).isoformat()}
    s3.fs.pipe(s3.url(f"{prefix}/{MARKER}"), json.dumps(doc).encode())


def test_an_object_store_publishes_manifest_last_and_the_next_request_pulls(imagenet_clean, tmp_path, s3, decodes):
    store = s3.url("store")
    (r,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "a", store=store, **RECIPE)
    assert r.status == "built" and r.url.startswith(store) and r.path == tmp_path / "a" / "train"
    prefix = r.url.split("://", 1)[1]
    listed = {p.rsplit("/", 1)[1] for p in s3.fs.find(prefix)}
    assert MARKER not in listed and "manifest.json" in listed  # the claim is gone, the manifest there
    assert s3.fs.exists(s3.url("store/.store/store.json"))
    puts = [q.path for q in s3.log if q.method == "PUT" and prefix.split("/", 1)[1] in q.path]
    assert puts[-2].endswith("/manifest.json") or puts[-1].endswith("/manifest.json")  # last but the marker's rm
    decodes.clear()
    (again,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "b", store=store, **RECIPE)
    assert again.status == "found" and decodes == []
    assert tree_bytes(tmp_path / "a" / "train") == tree_bytes(tmp_path / "b" / "train")
    url = cachebuild.resolve(store, "imagenet", _src(imagenet_clean), **RECIPE)
    assert url == r.url and np.array_equal(CachedImageDataset(url).gather(np.arange(50)), _pixels(r.path))
    ls = _cli("ls", store)
    assert ls.exit_code == 0 and "LAST USED" in ls.output and r.url.rsplit("/", 1)[1] in ls.output, ls.output


def test_no_wait_names_the_build_running_for_an_object_store(imagenet_clean, tmp_path, s3, decodes):
    store = s3.url("store")
    (w,) = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)
    _foreign_marker(s3, f"store/{w.name}")
    with pytest.raises(StoreBusyError) as err:
        cachebuild.build("imagenet", _src(imagenet_clean), store=store, wait=False, **RECIPE)
    assert "by pid 4242 on builder-7 (user ada)" in str(err.value) and "2 of 7 blocks built" in str(err.value)
    assert decodes == []


def test_a_dead_builders_claim_is_taken_over(imagenet_clean, tmp_path, s3, monkeypatch):
    """A holder on this host that no longer runs: at once; one on another host: once its marker is older than
    CACHEBUILD_PUSH_STALE_S (its heartbeats stopped)."""
    (w,) = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)
    monkeypatch.setattr(store_build, "POLL_S", 0.1)
    monkeypatch.setenv("CACHEBUILD_PUSH_STALE_S", "3")
    store = s3.url("elsewhere")
    _foreign_marker(s3, f"elsewhere/{w.name}")  # renewed just now, on another host
    with pytest.raises(StoreBusyError):
        cachebuild.build("imagenet", _src(imagenet_clean), store=store, wait=False, **RECIPE)
    (r,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "a", store=store, **RECIPE)
    assert r.status == "built" and r.waited_s >= 1 and "pid 4242 on builder-7" in r.waited_for
    dead = 2**22 + 12345  # no such process here
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    store = s3.url("here")
    doc = {"holder": {"host": current_host(), "pid": dead, "user": "ada", "started": "x", "command": "y"},
           "token": "feedfeedfeedfeed"}
    s3.fs.pipe(s3.url(f"here/{w.name}/{MARKER}"), json.dumps(doc).encode())
    (r2,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "b", store=store, **RECIPE)
    assert r2.status == "built" and r2.waited_s < 1
    assert same_cache(tmp_path / "a" / "train", tmp_path / "b" / "train")


def test_a_failed_build_gives_its_claim_up_at_once(imagenet_clean, tmp_path, s3, monkeypatch):
    (w,) = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)
    store = s3.url("store")

    def dies(*a: Any, **k: Any) -> Any:
        raise OSError("disk on fire")

    with monkeypatch.context() as m:
        m.setattr(store_build, "build", dies)
        with pytest.raises(OSError, match="disk on fire"):
            cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "a", store=store, **RECIPE)
    marker = json.loads(s3.fs.cat(s3.url(f"store/{w.name}/{MARKER}")))
    assert "holder" not in marker  # given up: the next request takes it at once, wherever it runs
    (r,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "a", store=store, wait=False, **RECIPE)
    assert r.status == "built"


# ---------------------------------------------------------------- a read-only store (cachebuild serve)

def test_a_read_only_store_is_read_and_what_it_lacks_is_built_here_unpublished(imagenet_clean, tmp_path,
                                                                              http_server, decodes):
    store = tmp_path / "store"
    (r,) = cachebuild.build("imagenet", _src(imagenet_clean), store=store, **RECIPE)
    server = http_server(store)
    decodes.clear()
    (found,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "a", store=server.url, **RECIPE)
    assert found.status == "found" and decodes == [] and found.url == f"{server.url}/{Path(r.url).name}"
    assert tree_bytes(tmp_path / "a" / "train") == tree_bytes(Path(r.url))
    (here,) = cachebuild.build("imagenet", _src(imagenet_clean), tmp_path / "b", store=server.url,
                               **{**RECIPE, "fit": "squash"})
    assert here.status == "built here" and here.url == "" and here.path == tmp_path / "b" / "train"
    assert "not published" in here.describe() and not any(q.method == "PUT" for q in server.log)
    assert decodes


def test_store_setting_and_its_row(monkeypatch):
    from cachebuild.settings import settings

    monkeypatch.setenv("CACHEBUILD_STORE", " s3://team/caches ")
    assert settings().store == "s3://team/caches"
    monkeypatch.setenv("CACHEBUILD_STORE", "")
    assert settings().store is None


def test_the_store_names_its_caches_by_key_and_keeps_the_whole_key(imagenet_clean, tmp_path):
    (w,) = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)
    assert w.name == f"imagenet-train-32-{w.key[:16]}"
    st = Store(tmp_path / "store")
    assert st.find(w) is None
    other = tmp_path / "store" / w.name
    from tests.loaders_fixtures import make_cache

    make_cache(other, n=5)  # something else at its name (put there by hand)
    with pytest.raises(Exception, match="holds another cache"):
        st.find(w)
    assert pipeline.build  # the build the store runs is the pipeline's own


def test_resolve_takes_every_flag_of_the_build_commands_that_names_a_recipe():
    """Its flags are the build commands' own declarations (BuildOptions, each kind's options), not new ones: a
    flag that shapes a cache means the same to both."""
    import click

    from cachebuild.cli import main
    from cachebuild.cli_build import build_command
    from cachebuild.sources.registry import get_source, source_names

    ctx = click.Context(main)
    resolve = main.get_command(ctx, "resolve")
    assert resolve is not None
    mine = {o for p in resolve.params for o in p.opts}
    not_recipe = {"--out", "--dask-scheduler", "--store", "--no-wait", "--quiet", "--verbose", "--codec",
                  "--workers", "--force", "--update", "--json", "--wait", "--progress", "--on-error"}
    for name in source_names():
        flags = {o for p in build_command(get_source(name)).params for o in p.opts if o.startswith("--")}
        assert flags - not_recipe <= mine, (name, flags - not_recipe - mine)


def test_a_store_build_runs_on_a_dask_cluster(imagenet_clean, tmp_path):
    """`--dask-scheduler` with `--store`: the blocks run on the cluster's workers, the cache is published as a
    local build would be, byte for byte."""
    from dask.distributed import Client, LocalCluster

    store = tmp_path / "store"
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        r = _cli("imagenet", _src(imagenet_clean), "--store", store, "--dask-scheduler", cluster.scheduler_address,
                 "--out", tmp_path / "mine", *FLAGS, "-v")
        assert r.exit_code == 0, r.output
        assert "building on the Dask cluster" in r.output and "published" in r.output
        ran = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.task_prefixes))
        assert any("run_block" in k for k in ran), ran
    (w,) = plan_wanted("imagenet", _src(imagenet_clean), **RECIPE)
    ref = pipeline.build(w.plan, tmp_path / "ref", w.opts).path
    assert same_cache(ref, store / w.name) and tree_bytes(store / w.name) == tree_bytes(tmp_path / "mine" / "train")
