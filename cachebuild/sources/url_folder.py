"""A class-folder tree at a URL (``s3://bucket/images``, ``https://host/images/``): listed once and each file read
whole in the workers, both through the storage layer's locations (their socket timeout, retries and S3 session),
with the same classes, extensions and order as ImageFolder's rules for a local tree
(``cachebuild.sources.folder``)."""

from __future__ import annotations

import hashlib
import json
import posixpath
import urllib.parse
from dataclasses import dataclass, field

import numpy as np

from cachebuild.errors import SourceError
from cachebuild.format.manifest import CACHE_SUBFOLDER
from cachebuild.sources.image_files import IMG_EXTENSIONS
from cachebuild.sources.plan import Plan
from cachebuild.storage import FsspecLocation, redact
from cachebuild.storage.locations import is_web_url
from cachebuild.storage.locations.url_files import FileInfo, UrlFiles

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


def _listing(url: str) -> dict[str, FileInfo]:
    """Relative file name -> its listing. HTTP index pages link percent-encoded URLs (``caf%C3%A9/``): names
    are decoded, so that classes, their order and keys are the local copy's."""
    files = UrlFiles(url)
    name_of = urllib.parse.unquote if is_web_url(url) else str
    try:
        prefix = name_of(files.path_of(url).rstrip("/"))
        found = files.find(files.path_of(url).rstrip("/"))  # retried as the storage layer retries
        listed = {}
        for f in found:
            rel = name_of(f.path)[len(prefix):].lstrip("/")
            if rel and not f.is_dir:
                listed[rel] = f
        unsized = [r for r, f in listed.items() if f.size is None]  # HTTP index pages give no sizes
        listed.update(zip(unsized, files.infos([listed[r].url for r in unsized]), strict=True))
    except OSError as e:
        raise SourceError(f"{redact(url)} cannot be listed: {type(e).__name__}: {e}") from None
    except Exception as e:  # aiohttp's ClientResponseError (403...) is not an OSError
        raise SourceError(f"{redact(url)} cannot be listed: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return listed


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
        f = files[key]
        h.update(f"{key}\0{label}\0{f.size}:{f.version}\n".encode("utf-8", "surrogateescape"))
    return Plan(dataset=dataset, split=split, root=root, keys=keys, labels=labels, classes=classes,
                source_digest=h.hexdigest(), reader=UrlFileReader(root))



