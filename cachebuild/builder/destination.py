"""Where a build may write, what it may replace, its staging folder, and what to tell the user when the output
cannot be written.

The rule: cachebuild deletes or replaces only folders it can prove it wrote.

- A destination that is equal to, inside of, or contains the source is refused before anything is
  created (``--force`` could otherwise replace the source, and a cache inside a class-folder tree
  would become a class of the next build). The one exception is :data:`CACHE_SUBFOLDER` directly
  under the source root: sources never list it.
- ``--force`` replaces an existing destination only when it is a cache: its ``manifest.json`` is JSON
  saying ``"format": "cachebuild"``, and every entry of the folder is a file that manifest names.
  A folder with a damaged (non-JSON) manifest, or with anything the manifest does not name, is left
  alone even with ``--force``: we cannot prove we wrote it, so the user decides.
- The staging folder ``<out>.partial`` is discarded (an unfinished build of other inputs) only when it
  carries our marks: ``build.json``, a cachebuild ``manifest.json``, or nothing but names a build writes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from cachebuild.atomic import write_json_atomic
from cachebuild.builder.block import record_path
from cachebuild.builder.options import PIXEL_RECIPE, pixel_recipe, recipe_differences
from cachebuild.errors import CacheBuildError, CacheExistsError, OutputError
from cachebuild.format.manifest import CACHE_SUBFOLDER, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest
from cachebuild.storage import cache_names, get_backend, staging_names
from cachebuild.storage.cache import read_manifest
from cachebuild.storage.columns import COLUMNS_DIR, is_own_columns_folder
from cachebuild.storage.kinds.base import BlockRecord

__all__ = [
    "CACHE_SUBFOLDER",
    "check_destination",
    "check_outside_source",
    "check_replaceable",
    "is_own_staging",
    "output_error",
    "prepare_staging",
    "read_raw_manifest",
    "replaced_cache",
    "some_names",
]

log = logging.getLogger("cachebuild")

# What a build writes into its staging folder beyond the storage kind's own names (each backend lists those:
# ``Backend.staging_names``): the build's bookkeeping, storage.writer's side arrays, file table and manifest,
# atomic writes' temporaries, and the marker of a pull's (cachebuild.share.pull: a pull and a build of one
# output share the staging folder).
_BUILD_NAMES = (r"blocks|build\.json|pull\.json|manifest\.json|paths\.json|(labels|sizes|boxes|[a-z_]*labels)\.npy"
                r"|\..+\.tmp(-\d+)?|files\.json|source_files\.json")


def _staging_names() -> re.Pattern[str]:
    return re.compile(f"{_BUILD_NAMES}|{staging_names()}")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_outside_source(out: Path, source: str | os.PathLike[str]) -> None:
    """Refuse an output (or its staging folder or lock file) that is, is inside of, or contains the
    source; allowed: anything under ``<source>/.cachebuild/``."""
    src = Path(source).resolve()
    dest = out.resolve()
    for p in (dest, dest.with_name(dest.name + ".partial"), dest.with_name(dest.name + ".lock")):
        if p == src:
            raise OutputError(f"the output {out} is the source itself: a build there would replace the source's "
                              f"files; choose an --out outside it (or {Path(source) / CACHE_SUBFOLDER})")
        if _inside(src, p):
            raise OutputError(
                f"the output {out} contains the source {source}: a build there could replace the source's "
                f"files; choose an --out outside it (or {Path(source) / CACHE_SUBFOLDER})"
            )
        if _inside(p, src):
            rel = p.relative_to(src).parts
            if rel and rel[0] == CACHE_SUBFOLDER:
                continue
            raise OutputError(
                f"the output {out} is inside the source {source}: its files would mix with the source's "
                f"(and become a class of the next build); choose an --out outside it, or "
                f"{Path(source) / CACHE_SUBFOLDER}, which sources never read"
            )


def read_raw_manifest(folder: Path) -> dict[str, Any]:
    """``folder/manifest.json`` as a dict, or a CacheBuildError saying why it is not one."""
    path = folder / MANIFEST_NAME
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CacheBuildError(f"its {MANIFEST_NAME} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CacheBuildError(f"its {MANIFEST_NAME} holds a JSON {type(data).__name__}, not an object")
    return data


def _listed_names(raw: dict[str, Any]) -> set[str]:
    """The file names a (possibly damaged) manifest lists; anything malformed is simply not listed."""
    names = {MANIFEST_NAME}
    for s in raw.get("shards") or []:
        if isinstance(s, dict) and isinstance(s.get("file"), str):
            names.add(s["file"])
    arrays = raw.get("arrays")
    for a in arrays.values() if isinstance(arrays, dict) else []:
        if isinstance(a, dict) and isinstance(a.get("file"), str):
            names.add(a["file"])
    files, source = raw.get("files"), raw.get("source")  # the file table; the source's per-file inputs
    if isinstance(files, dict) and isinstance(files.get("table"), str):
        names.add(files["table"])
    inputs = source.get("inputs") if isinstance(source, dict) else None
    if isinstance(inputs, dict) and isinstance(inputs.get("file"), str):
        names.add(inputs["file"])
    return names


def some_names(names: list[str], k: int = 5) -> str:
    """The first ``k`` of ``names`` for a one-line message, and how many more there are."""
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def check_replaceable(out: Path, problem: str | None, other: str = "another --out") -> None:
    """Raise unless ``out`` is provably a cache cachebuild wrote (see the module docstring).
    ``problem``: why its manifest did not parse as a current cache, if it did not (for the message);
    ``other``: what the user should choose instead (a pull says "another destination")."""
    never = "cachebuild replaces only folders it can prove it wrote, even with --force"
    what_to_do = f"check it and remove it yourself if it is not needed (rm -r {out}), or choose {other}"
    if not (out / MANIFEST_NAME).is_file():
        raise CacheExistsError(f"{out} exists and is not a cachebuild cache (no {MANIFEST_NAME}); {never}: "
                               f"choose {other}")
    try:
        raw = read_raw_manifest(out)
    except CacheBuildError as e:
        raise CacheExistsError(f"{out} looks like a damaged cache: {e}; {never}: {what_to_do}") from None
    if raw.get("format") != FORMAT_NAME:
        raise CacheExistsError(f"{out}/{MANIFEST_NAME} is not a cachebuild manifest (format "
                               f"{raw.get('format')!r}); {never}: choose {other}")
    foreign = sorted(set(os.listdir(out)) - _listed_names(raw) - cache_names())
    if COLUMNS_DIR in foreign and is_own_columns_folder(out / COLUMNS_DIR):  # `columns add` wrote it all
        foreign.remove(COLUMNS_DIR)
    if foreign:
        shown = some_names(foreign)
        damage = f" (its manifest: {problem})" if problem else ""
        raise CacheExistsError(f"{out} holds files its manifest does not name: {shown}{damage}; {never}: "
                               f"{what_to_do}")


def is_own_staging(staging: Path) -> bool:
    """True when ``staging`` carries a build's marks (build.json with a key, a cachebuild manifest) or
    holds nothing but names a build writes (a kill can land between those marks)."""
    try:
        if json.loads((staging / "build.json").read_text()).get("key"):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        if read_raw_manifest(staging).get("format") == FORMAT_NAME:
            return True
    except (OSError, CacheBuildError):
        pass
    names = _staging_names()
    return all(names.fullmatch(name) for name in os.listdir(staging))


_ADVICE = {
    errno.ENOSPC: "no space left on the device: free some space (or choose an --out on a bigger disk)",
    errno.EDQUOT: "disk quota exceeded: free some space (or choose an --out elsewhere)",
    errno.EROFS: "read-only filesystem: choose an --out on a writable one",
    errno.EACCES: "permission denied: choose an --out you can write to (or fix its permissions)",
    errno.EPERM: "operation not permitted: choose an --out you can write to (or fix its permissions)",
}


def _file_in_the_way(out: Path) -> Path | None:
    for p in (out, *out.parents):
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


def output_error(e: OSError, out: Path, staging: Path) -> OutputError | None:
    """One line for an environment error met while writing ``out`` (None: not one of those).
    The path named is the one the OS named, else the staging folder the build was writing into."""
    where = Path(os.fsdecode(e.filename)) if e.filename else staging if staging.exists() else out
    resume = (" then rerun the same command: the finished blocks in "
              f"{staging} are kept and the build resumes from them") if staging.exists() else \
        " then rerun the same command"
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(out)
        if blocker is None:
            return None
        return _with_errno(OutputError(f"{blocker} is a file, not a folder, so {out} cannot be made there: "
                                       f"choose another --out"), e.errno)
    if e.errno in _ADVICE:
        return _with_errno(OutputError(f"{where}: {_ADVICE[e.errno]};{resume}"), e.errno)
    return None


def _with_errno(err: OutputError, code: int) -> OutputError:
    err.errno = code  # str(err) stays the message (no strerror set)
    return err


def check_destination(out: Path, source_digest: str, key: str, params: dict[str, Any], force: bool,
                      update: bool = False) -> Manifest | None:
    """The manifest of ``out`` when it already holds this exact build, else None: ``out`` does not exist, or
    ``force`` (or ``update``, whose recipe check is ``builder.update``'s) and it is provably a cache cachebuild
    wrote (:func:`check_replaceable`), so it may be replaced. Raises otherwise, saying what is there."""
    if not out.exists() and not out.is_symlink():
        return None
    if not out.is_dir():
        raise CacheExistsError(f"{out} exists and is a file, not a cache folder; choose another --out")
    if not out.is_symlink() and not any(out.iterdir()):
        out.rmdir()
        return None
    existing, problem = None, None
    if (out / MANIFEST_NAME).is_file():
        try:
            existing = read_manifest(out)
        except CacheBuildError as e:  # say what is wrong with it, not that it is "different"
            problem = str(e)
    if existing is not None and existing.build_key == key and not force:
        return existing
    if force or update:
        check_replaceable(out, problem)
        return None
    choices = "--force to replace it, or choose another --out"
    if problem is not None:
        raise CacheExistsError(f"{out} holds a cache whose manifest cannot be used ({problem}); pass --force to "
                               f"rebuild it (replaced only if the folder holds nothing but files its manifest "
                               f"names), or choose another --out")
    if existing is None:
        raise CacheExistsError(f"{out} exists and is not a cachebuild cache (no {MANIFEST_NAME}); "
                               f"choose another --out")
    diffs = recipe_differences(existing.build, params)
    if diffs:
        raise CacheExistsError(f"{out} holds a cache of another recipe ({'; '.join(diffs)}); pass {choices}")
    if existing.source.get("fingerprint") != source_digest:
        raise CacheExistsError(f"{out} holds this recipe's cache of another state of the source; pass --update to "
                               f"update it (decoding only the files added or changed), {choices}")
    if pixel_recipe(existing.build) < PIXEL_RECIPE:
        raise CacheExistsError(
            f"{out} holds this recipe's cache of this source, made by an earlier release's pixel recipe "
            f"({pixel_recipe(existing.build)}; this release makes {PIXEL_RECIPE}); it reads and verifies as it is: "
            f"pass --update to remake its pixels with this release (every file decoded again), {choices}")
    raise CacheExistsError(
        f"{out} holds this recipe's cache of this source, written by another cachebuild release (format version "
        f"{existing.format_version}; this one writes {FORMAT_VERSION}); it reads as it is: pass --update to bring "
        f"it to this release's format (reusing its samples), {choices}")


def replaced_cache(out: Path, source_digest: str, params: dict[str, Any]) -> str | None:
    """What a build with ``--force`` replaces at ``out``, in the words its refusal without ``--force`` uses (a
    cache of another recipe, naming each difference; of another state of the source...); None where ``out``
    holds no cache whose manifest reads."""
    try:
        existing = read_manifest(out)
    except (CacheBuildError, OSError):
        return None
    diffs = recipe_differences(existing.build, params)
    if diffs:
        return f"a cache of another recipe ({'; '.join(diffs)})"
    if existing.source.get("fingerprint") != source_digest:
        return "this recipe's cache of another state of the source"
    if pixel_recipe(existing.build) < PIXEL_RECIPE:
        return f"this recipe's cache of this source, made by pixel recipe {pixel_recipe(existing.build)}"
    if existing.format_version != FORMAT_VERSION:
        return f"this recipe's cache of this source, written in format version {existing.format_version}"
    return "this recipe's cache of this source"


def prepare_staging(staging: Path, key: str, storage: str) -> dict[int, BlockRecord]:
    """Create or reopen the staging folder; return the records of blocks finished by an earlier run."""
    build_file = staging / "build.json"
    if staging.exists() and not (staging.is_dir() and is_own_staging(staging)):
        raise CacheExistsError(f"{staging} exists and was not made by cachebuild (a build keeps its unfinished "
                               f"work there); move it away or choose another --out")
    if staging.exists():
        try:
            same = json.loads(build_file.read_text())["key"] == key
        except (OSError, ValueError, KeyError):
            same = False
        if not same:
            log.warning("discarding the unfinished build in %s: it was started with other inputs", staging)
            shutil.rmtree(staging)
    (staging / "blocks").mkdir(parents=True, exist_ok=True)
    if not build_file.exists():
        write_json_atomic(build_file, {"key": key})
    get_backend(storage).resume(staging, lambda block: record_path(staging, block).unlink(missing_ok=True))
    done = {}
    for rec_path in sorted((staging / "blocks").glob("block-*.json")):
        try:
            rec = BlockRecord.from_json(json.loads(rec_path.read_text()))
        except (ValueError, KeyError, TypeError):
            continue  # a record is written atomically, but be lenient with foreign debris
        if (staging / rec.file).exists():
            done[rec.block] = rec
    return done
