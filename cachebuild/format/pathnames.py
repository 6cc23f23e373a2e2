r"""Source file names in JSON, losslessly, including names that are not valid UTF-8.

A POSIX file name is bytes. Python hands an undecodable byte over as a lone surrogate (``os.fsdecode``:
byte 0xFF -> U+DCFF, "surrogateescape"), which strict UTF-8 JSON cannot hold. So ``paths.json`` (and
the manifest's ``failures[].path``) hold each name as either

- a JSON string, the name itself, when it is valid UTF-8 (every name on most systems: unchanged), or
- an object ``{"bytes": E}`` when it is not. ``E`` is the name's bytes with ``\xHH`` (two lowercase
  hex digits) for each byte that is not part of valid UTF-8, ``\\`` for a backslash, and every other
  character as itself. The name ``b"bad_\xff\xfe_name.JPEG"`` is the JSON text
  ``{"bytes": "bad_\\xff\\xfe_name.JPEG"}`` (JSON doubles each backslash once more).

Decoding gives back the ``os.fsdecode`` form: ``os.fsencode(decode_path(encode_path(p))) ==
os.fsencode(p)`` for every name the filesystem can hold, and ``open()`` of a decoded name opens the
file. A reader without this package that meets an object knows the name was not UTF-8, and can undo
the two escapes; it never mistakes it for another file.
"""

from __future__ import annotations

import os
import re
from typing import Any

from cachebuild.errors import CacheCorruptError

__all__ = ["CACHE_SUBFOLDER", "URL_SCHEME", "check_name", "decode_path", "decode_paths", "encode_path", "encode_paths"]

# The one folder inside a source tree that may hold caches of it: sources never list it, and a build may
# write there (cachebuild.builder.destination).
CACHE_SUBFOLDER = ".cachebuild"
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, gs://, http(s)://, file://, memory://...

_ESCAPE = re.compile(r"\\(\\|x[0-9a-f]{2})")


def encode_path(path: str) -> str | dict[str, str]:
    """The JSON value of one file name (``str`` as ``os.fsdecode`` returns it)."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        pass
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:  # a surrogate no file name can carry (not from surrogateescape)
        raise ValueError(f"{path!r} is not a file name this system can hold (lone surrogate)") from None
    return {"bytes": raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")}


def decode_path(entry: Any, where: str = "paths.json") -> str:
    """A file name back from its JSON value; a malformed entry is a CacheCorruptError naming ``where``."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and set(entry) == {"bytes"} and isinstance(entry["bytes"], str):
        text = entry["bytes"]
        out = bytearray()
        pos = 0
        for m in _ESCAPE.finditer(text):
            literal = text[pos : m.start()]
            if "\\" in literal:
                break
            out += literal.encode("utf-8", "strict")
            esc = m.group(1)
            out += b"\\" if esc == "\\" else bytes([int(esc[1:], 16)])
            pos = m.end()
        else:
            literal = text[pos:]
            if "\\" not in literal:
                try:
                    out += literal.encode("utf-8", "strict")
                    return os.fsdecode(bytes(out))
                except UnicodeEncodeError:
                    pass
        raise CacheCorruptError(f"{where}: malformed escaped file name {text!r} (only \\\\ and \\xHH escapes)")
    raise CacheCorruptError(f"{where}: a file name must be a string or {{\"bytes\": ...}}, got {entry!r}")


def encode_paths(paths: list[str]) -> list[str | dict[str, str]]:
    return [encode_path(p) for p in paths]


def decode_paths(entries: list[Any], where: str = "paths.json") -> list[str]:
    if set(map(type, entries)) <= {str}:  # no escaped names (the usual case): nothing to decode, one C pass
        return list(entries)
    return [decode_path(e, where) for e in entries]


def check_name(name: object, what: str = "file name") -> str:
    """A name a manifest gives for a file of the cache: plain, relative, inside the cache.

    Refused: absolute paths, ``..`` or ``.`` segments, empty segments, backslashes, URLs, control
    characters. A backend only ever opens ``<cache>/<name>`` for names that pass, so a crafted manifest
    cannot make a reader open ``/etc/passwd``, a sibling folder or another host.
    """
    if not isinstance(name, str) or not name:
        raise CacheCorruptError(f"manifest {what} must be a non-empty string, got {name!r}")
    bad = (
        name.startswith("/")
        or "\\" in name
        or URL_SCHEME.match(name) is not None
        or ":" in name.split("/", 1)[0]  # drive letters, "c:foo", scheme-like prefixes
        or any(ord(ch) < 32 for ch in name)
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise CacheCorruptError(
            f"manifest {what} {name!r} is not a plain relative name inside the cache (no '..', no absolute "
            f"path, no URL); the manifest is damaged or was crafted: rebuild or re-fetch the cache"
        )
    return name
