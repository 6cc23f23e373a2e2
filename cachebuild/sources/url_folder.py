"""A class-folder tree at a URL (``s3://bucket/images``, ``https://host/images/``): listed once with fsspec,
each file read whole in the workers, with the same classes, extensions and order as ImageFolder's rules
for a local tree (``cachebuild.sources.folder``)."""

from __future__ import annotations

import hashlib
import json
import posixpath
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.format.pathnames import CACHE_SUBFOLDER
from cachebuild.sources.image_files import IMG_EXTENSIONS
from cachebuild.sources.plan import Plan
from cachebuild.sources.shards.remote import _infos, _version, filesystem
from cachebuild.storage import FsspecLocation, redact
from cachebuild.storage.locations.names import is_web_url
from cachebuild.storage.remote import retry

__all__ = ["UrlFileReader", "url_folder_plan"]


@dataclass(frozen=True)
class UrlFileReader:
    """Reads ``<root>/<key>`` whole (retries and one-line errors from the storage location)."""

    root: str
    _location: list[FsspecLocation] = field(default_factory=list, compare=False, repr=False)

    def __call__(self, index: int, key: str) -> bytes:
        if not self._location:
            self._location.append(FsspecLocation(self.root))
        # Keys are file names (decoded, as on disk); an http(s) path needs them percent-encoded again ('#', '%').
        return self._location[0].read_bytes(urllib.parse.quote(key) if is_web_url(self.root) else key)


def _listing(url: str) -> dict[str, dict[str, Any]]:
    """Relative file name -> fsspec info. HTTP index pages link percent-encoded URLs (``caf%C3%A9/``): names
    are decoded, so that classes, their order and keys are the local copy's."""
    fs, path = filesystem(url)
    base = path.rstrip("/")
    name_of = urllib.parse.unquote if is_web_url(url) else str
    prefix = name_of(fs._strip_protocol(base))
    try:
        found = retry.call(lambda: fs.find(base, detail=True))  # retried as the storage layer retries
    except (FileNotFoundError, OSError) as e:
        raise SourceError(f"{redact(url)} cannot be listed: {type(e).__name__}: {e}") from None
    except Exception as e:  # aiohttp's ClientResponseError (403...) is not an OSError
        raise SourceError(f"{redact(url)} cannot be listed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    files, urls = {}, {}
    for full, info in found.items():
        rel = name_of(fs._strip_protocol(full))[len(prefix):].lstrip("/")
        if rel and info.get("type", "file") != "directory":
            files[rel], urls[rel] = info, full
    unsized = [r for r, i in files.items() if i.get("size") is None]  # HTTP index pages give no sizes
    for rel, info in zip(unsized, _infos(fs, [urls[r] for r in unsized]), strict=True):
        files[rel] = info
    return files


def url_folder_plan(url: str, *, dataset: str = "folder", split: str = "train",
                    classes: list[str] | None = None) -> Plan:
    """Plan the class-folder tree at ``url``: one sub-folder per class, image files below it."""
    root = url.rstrip("/")
    files = _listing(root)
    # As the local tree: .cachebuild/ (caches built inside the tree, then uploaded with it) is not a class.
    found = sorted({rel.split("/", 1)[0] for rel in files if "/" in rel} - {CACHE_SUBFOLDER})
    if not found:
        raise SourceError(f"{redact(url)} has no class folders: expected one sub-folder of images per class")
    if classes is None:
        classes = found
    elif set(found) - set(classes):
        raise SourceError(f"{redact(url)} has class folders {sorted(set(found) - set(classes))[:5]} that are not "
                          f"among the {len(classes)} classes of the other split")
    index = {c: i for i, c in enumerate(classes)}
    # ImageFolder's order: class by class, then a sorted walk (folder by folder, files sorted in each).
    tops = set(found)
    keys = sorted((rel for rel in files if "/" in rel and rel.split("/", 1)[0] in tops
                   and rel.lower().endswith(IMG_EXTENSIONS)),
                  key=lambda r: (index[r.split("/", 1)[0]], posixpath.dirname(r), posixpath.basename(r)))
    if not keys:
        raise SourceError(f"{redact(url)} has class folders but no image files with extensions "
                          f"{', '.join(IMG_EXTENSIONS)}")
    labels = np.asarray([index[k.split("/", 1)[0]] for k in keys], dtype=np.int64)
    h = hashlib.sha256(json.dumps({"classes": classes}, sort_keys=True).encode())
    for key, label in zip(keys, labels.tolist(), strict=True):
        info = files[key]
        h.update(f"{key}\0{label}\0{info.get('size')}:{_version(info)}\n".encode("utf-8", "surrogateescape"))
    return Plan(dataset=dataset, split=split, root=root, keys=keys, labels=labels, classes=classes,
                source_digest=h.hexdigest(), reader=UrlFileReader(root))



