"""The sources seam: a new kind is one module and one registry line (built and re-planned through the CLI),
recipes keep the shape today's caches hold, options parse and serialise themselves, and the build flags
read their choices and defaults from the one place that declares them."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import cachebuild.sources.registry as registry
import cachebuild.storage.kinds.base as storage
from cachebuild.builder.pipeline import BuildOptions
from cachebuild.cli import main
from cachebuild.cli_build import build_params
from cachebuild.errors import OptionError, SourceError
from cachebuild.sources.folder import FolderOptions
from cachebuild.sources.imagenet import ImagenetOptions
from cachebuild.sources.kind import SourceKind, SourceOptions, option
from cachebuild.sources.plan import Plan, file_plan
from cachebuild.sources.registry import (
    get_source,
    plan_source,
    recipe_of_old_cache,
    register_source,
    replan,
    source_names,
)
from cachebuild.sources.shards.parquet import ParquetOptions
from cachebuild.sources.shards.wds import WdsOptions
from cachebuild.storage.cache import open_cache
from cachebuild.storage.kinds.jpeg import JpegBackend
from tests.cifar_files import write_cifar10
from tests.repo import REPO


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def scratch_registries(monkeypatch):
    """Kinds registered by a test are gone after it (the storage registry emptied and refilled in place: its
    live view of names, STORAGE_KINDS, is the choices of --format)."""
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    monkeypatch.setattr(registry, "_LOADED", dict(registry._LOADED))
    saved = dict(storage._BACKENDS), dict(storage._LOADED)
    yield
    for table, before in zip((storage._BACKENDS, storage._LOADED), saved, strict=True):
        table.clear()
        table.update(before)


# ---------------------------------------------------------------- a new kind: one module, one registry line


@dataclass(frozen=True)
class _ListingOptions(SourceOptions):
    split: str = option("train", "Name of the split the listing is.")
    delimiter: str = option(",", "Field separator of the listing.", choices=(",", ";"))
    dataset: str | None = option(None, "Dataset name (default: the listing's stem).", flag="--name")


class _ListingSource(SourceKind):
    """A text listing of ``path<delimiter>label`` rows, paths relative to the listing's folder."""

    name = "listing-test"
    options = _ListingOptions
    help = "A listing at SRC: one path,label row per image, paths relative to the listing's folder."
    url_src = False
    pins_classes = True
    classes_flag = True

    def plan(self, src: str, options: _ListingOptions, *, classes: list[str] | None = None,
             jobs: int = 1) -> list[Plan]:
        listing = Path(src)
        rows = [line.rsplit(options.delimiter, 1) for line in listing.read_text().splitlines() if line.strip()]
        labels = np.asarray([int(label) for _, label in rows], np.int64)
        classes = classes if classes is not None else [str(i) for i in range(int(labels.max()) + 1)]
        return [file_plan(options.dataset or listing.stem, options.split, listing.parent, [k for k, _ in rows],
                          labels, classes)]


def test_a_new_source_kind_is_one_module_and_one_registry_line(imagenet_clean, tmp_path, scratch_registries):
    register_source("listing-test", _ListingSource())

    tree = tmp_path / "tree"
    shutil.copytree(imagenet_clean["train_dir"], tree)
    classes = sorted(p.name for p in tree.iterdir())
    rows = [f"{p.relative_to(tree)};{classes.index(p.parent.name)}" for p in sorted(tree.rglob("*.JPEG"))]
    (tree / "images.txt").write_text("\n".join(rows) + "\n")
    (tmp_path / "classes.txt").write_text("\n".join(classes) + "\n")

    shown = _cli("listing-test", "--help")
    assert shown.exit_code == 0, shown.output
    for flag in ("--split TEXT", "--delimiter [,|;]", "--name TEXT", "--classes FILE", "--size", "--format",
                 "--wait"):
        assert flag in shown.output, flag
    assert "listing-test" in _cli("--help").output

    r = _cli("listing-test", tree / "images.txt", "--delimiter", ";", "--classes", tmp_path / "classes.txt",
             "--size", "24", "--out", tmp_path / "out", "-j", "1", "--no-progress")
    assert r.exit_code == 0, r.output
    cache = open_cache(tmp_path / "out" / "train")
    assert list(cache.manifest.classes) == classes and cache.manifest.dataset == "images"
    assert cache.manifest.source["recipe"] == {"kind": "listing-test", "src": str(tree / "images.txt"),
                                               "split": "train", "delimiter": ";", "dataset": "images",
                                               "classes_given": True}
    # the same images as the folder kind builds them
    r = _cli("folder", tree, "--size", "24", "--out", tmp_path / "ref", "-j", "1", "--no-progress")
    assert r.exit_code == 0, r.output
    ref = open_cache(tmp_path / "ref" / "train")
    assert len(cache) == len(ref) == len(rows)
    assert np.array_equal(cache.gather(np.arange(len(cache))), ref.gather(np.arange(len(ref))))
    assert cache.labels.tolist() == ref.labels.tolist()

    # status re-plans it through the registry: up to date, then stale naming the file
    r = _cli("status", tmp_path / "out" / "train")
    assert r.exit_code == 0 and "up to date" in r.output, r.output
    victim = sorted(tree.rglob("*.JPEG"))[2]
    victim.write_bytes(sorted(tree.rglob("*.JPEG"))[0].read_bytes())  # other bytes
    r = _cli("status", tmp_path / "out" / "train", "--json")
    assert r.exit_code == 1 and json.loads(r.output)["examples"]["modified"] == [str(victim.relative_to(tree))]


def test_a_bad_choice_of_a_new_kind_is_a_usage_error(tmp_path, scratch_registries):
    register_source("listing-test", _ListingSource())
    r = _cli("listing-test", tmp_path / "x.txt", "--delimiter", "|", "--out", tmp_path / "out")
    assert r.exit_code == 2 and "'|' is not one of ',', ';'" in r.output, r.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- recipes: the shape today's caches hold


def _source_digests(plans: list[Plan]) -> list[str]:
    return [p.source_digest for p in plans]


def test_recipes_keep_the_shape_of_this_release_and_replan_to_the_same_plan(imagenet_clean, wds_set, hf_set,
                                                                            tmp_path):
    root = str(imagenet_clean["root"])
    plans = plan_source("imagenet", root)
    assert [p.recipe for p in plans] == [{"kind": "imagenet", "src": root, "split": "train"},
                                         {"kind": "imagenet", "src": root, "split": "val"}]
    write_cifar10(tmp_path / "cifar", n_train=20, n_test=10)
    cifar = plan_source("cifar10", tmp_path / "cifar", get_source("cifar10").options(split="test"))
    assert [p.recipe for p in cifar] == [{"kind": "cifar10", "src": str(tmp_path / "cifar"), "split": "test"}]
    train = str(imagenet_clean["train_dir"])
    folder = plan_source("folder", train, FolderOptions(split="x"))
    assert folder[0].recipe == {"kind": "folder", "src": train, "split": "x", "dataset": "train",
                                "allow_empty": False, "classes_given": False}
    classes = [f"c{i}" for i in range(4)]
    wds = plan_source("wds", wds_set["pattern"], WdsOptions(label_key="label"), classes=classes)
    assert wds[0].recipe == {"kind": "wds", "src": wds_set["pattern"], "dataset": "imagenet1k", "split": "train",
                             "classes_given": True, "layout": {"image_keys": ["jpg", "jpeg", "png", "webp"],
                                                               "cls_key": "cls", "label_key": "label",
                                                               "json_key": "json"}}
    hf = str(Path(hf_set["files"][0]).parent)
    parquet = plan_source("parquet", hf, ParquetOptions(image_column="image"))
    assert parquet[0].recipe == {"kind": "parquet", "src": hf, "dataset": "imagenet-1k", "split": "train",
                                 "classes_given": False, "columns": {"image": "image", "label": None}}
    for plan in [*plans, *cifar, *folder, *wds, *parquet]:
        again = replan(plan.recipe, None, list(plan.classes))
        assert again.source_digest == plan.source_digest and list(again.keys) == list(plan.keys), plan.recipe


def test_caches_without_a_recipe_are_planned_by_their_dataset_name(imagenet_clean):
    root = imagenet_clean["root"]
    assert replan(recipe_of_old_cache("imagenet", "val"), root, []).source_digest == \
        _source_digests(plan_source("imagenet", root, ImagenetOptions(split="val")))[0]
    train = imagenet_clean["train_dir"]
    assert recipe_of_old_cache("my-photos", "train")["kind"] == "folder"
    assert replan(recipe_of_old_cache("my-photos", "train"), train, []).dataset == "my-photos"


def test_unknown_kinds_are_named_errors():
    with pytest.raises(SourceError, match="source kind 'tfrecord' is not known"):
        get_source("tfrecord")
    with pytest.raises(SourceError, match="cannot re-plan a source of kind 'tfrecord'"):
        replan({"kind": "tfrecord", "src": "/x"}, None, [])
    with pytest.raises(TypeError, match="takes ImagenetOptions, not FolderOptions"):
        plan_source("imagenet", "/x", FolderOptions())


@pytest.mark.parametrize("name", ["imagenet", "cifar10", "cifar100", "folder", "wds", "parquet", "ffcv", "mds",
                                  "litdata"])
def test_options_round_trip_through_their_dict(name):
    kind = get_source(name)
    assert kind.name == name and name in source_names()
    options = kind.options()
    assert kind.options.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    assert kind.options.from_dict({**options.to_dict(), "from_a_newer_release": 1}) == options
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.split = "val"  # type: ignore[misc]


def test_options_refuse_values_outside_their_choices():
    with pytest.raises(OptionError, match="split must be one of 'train', 'val', 'all'; got 'test'"):
        ImagenetOptions(split="test")
    with pytest.raises(OptionError, match="split must be one of"):
        ImagenetOptions.from_dict({"split": "validation"})
    round_tripped = WdsOptions.from_dict(WdsOptions(image_keys=("png",), cls_key="label").to_dict())
    assert round_tripped.layout.image_keys == ("png",) and round_tripped.layout.cls_key == "label"


# ---------------------------------------------------------------- build flags: one declaration


def test_build_flags_take_their_defaults_and_choices_from_build_options(scratch_registries):
    from cachebuild.builder.options import COMPRESSIONS, DECODE_DEVICES, ON_ERROR, SUBSAMPLINGS
    from cachebuild.builder.sample import FITS

    defaults = {f.name: f.default for f in dataclasses.fields(BuildOptions)}
    params = {p.name: p for p in build_params()}
    shared = sorted(set(params) & set(defaults))
    assert shared == sorted(["storage", "fit", "interpolation", "jobs", "block_size", "chunk_size", "compression",
                             "quality", "subsampling", "decode_device", "on_error", "exif_orientation", "max_pixels",
                             "reduced_decode", "force", "update", "summary", "lock_wait", "progress"])
    assert {n: params[n].default for n in shared} == {n: defaults[n] for n in shared}
    choices = {n: list(getattr(params[n].type, "choices", [])) for n in shared}
    assert (choices["fit"], choices["compression"], choices["subsampling"], choices["decode_device"],
            choices["on_error"]) == (list(FITS), list(COMPRESSIONS), list(SUBSAMPLINGS), list(DECODE_DEVICES),
                                     list(ON_ERROR))
    assert choices["storage"] == list(storage.backend_names())

    class _Jpeg2(JpegBackend):
        name = "jpeg2-test"

    # --format lists the storage kinds as the storage registry holds them when a command is made
    storage.register_backend("jpeg2-test", _Jpeg2())
    kinds = next(p for p in build_params() if p.name == "storage")
    assert list(kinds.type.choices) == [*choices["storage"], "jpeg2-test"]  # type: ignore[attr-defined]
    assert BuildOptions(size=32, storage="jpeg2-test").storage == "jpeg2-test"


# The flags of every build command (`cachebuild X --help`), in the order they are listed.
_BUILD = ["--format", "--fit", "--interpolation", "-j, --jobs", "--shard-size", "--chunk-size", "--compression",
          "--quality", "--subsampling", "--decode-device", "--on-error", "--exif-orientation", "--max-pixels",
          "--force", "--update", "--json", "--wait", "--progress / --no-progress", "--out", "--dask-scheduler",
          "--store", "--no-wait",
          "-q, --quiet", "-v, --verbose", "-h, --help"]
_FLAGS = {
    "imagenet": ["--split", "--size", *_BUILD],
    "cifar10": ["--split", "--size", *_BUILD],
    "cifar100": ["--split", "--size", *_BUILD],
    "folder": ["--size", "--split", "--name", "--allow-empty", *_BUILD],
    "wds": ["--split", "--size", "--classes", "--label-key", "--cls-key", "--image-keys", "--name", *_BUILD],
    "parquet": ["--split", "--size", "--classes", "--image-column", "--label-column", "--name", *_BUILD],
    **{peer: ["--split", "--size", "--classes", "--image-field", "--label-field", "--name", *_BUILD]
       for peer in ("ffcv", "mds", "litdata")},
}


def _flag_names(help_text: str) -> list[str]:
    """``-j, --jobs`` of a help line ``  -j, --jobs INTEGER  Worker processes...``, metavars and choices dropped."""
    out = []
    for line in help_text.splitlines():
        if line.startswith("  -"):
            decl = re.split(r"\s{2,}", line.strip())[0]
            out.append(" ".join(w for w in decl.split(" ") if w.startswith("-") or w == "/"))
    return out


@pytest.mark.parametrize("name", sorted(_FLAGS))
def test_generated_commands_list_the_flags_users_have(name):
    r = _cli(name, "--help")
    assert r.exit_code == 0, r.output
    assert _flag_names(r.output) == _FLAGS[name]


# ---------------------------------------------------------------- no cycles through the seam


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, in functions and under TYPE_CHECKING too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_sources_import_neither_their_registry_nor_the_cli():
    offenders = []
    for path in sorted((REPO / "cachebuild" / "sources").glob("*.py")):
        if path.name == "registry.py":
            continue
        offenders += [f"{path.name}: {m}" for m in _imports(path)
                      if m == "cachebuild.sources.registry" or m.startswith("cachebuild.cli")]
    share_cli = REPO / "cachebuild" / "share" / "cli.py"
    offenders += [f"share/cli.py: {m}" for m in _imports(share_cli) if m == "cachebuild.cli"]
    assert offenders == []


def test_options_refuse_values_of_the_wrong_type():
    with pytest.raises(OptionError, match="image_keys must be a list of strings; got 'jpg'"):
        WdsOptions(image_keys="jpg")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="dataset must be a string; got 3"):
        FolderOptions.from_dict({"split": "train", "dataset": 3})
    with pytest.raises(OptionError, match="cls_key must be a string; got None"):
        WdsOptions.from_dict({"layout": {"cls_key": None}})
