"""Labels read while planning (integers in a peer's encodings), and a look at the first image payload, so that a
dataset whose image field cannot be read is refused before anything is written rather than skipped sample by
sample."""

from __future__ import annotations

import numpy as np

from cachebuild.errors import DecodeError, SourceError
from cachebuild.sources.peers.common import Samples, read_at
from cachebuild.sources.peers.pixels import to_image

__all__ = ["decode_labels", "first_payload_check"]


def decode_labels(raw: list[bytes], kind: str, where: str) -> tuple[np.ndarray, dict[int, str]]:
    """int64 labels (-1 where there is none) from each record's label bytes: ``kind`` a little-endian numpy
    integer type (``<i8``) or ``str`` (decimal text); a record with no bytes was found damaged already."""
    out = np.full(len(raw), -1, np.int64)
    problems: dict[int, str] = {}
    if kind == "str":
        for i, b in enumerate(raw):
            try:
                out[i] = int(b.decode("ascii")) if b else -1
            except (ValueError, UnicodeDecodeError):
                problems[i] = f"label {b[:20]!r} of {where} is not a decimal integer"
        return out, problems
    width = np.dtype(kind).itemsize
    ok = np.fromiter((len(b) == width for b in raw), bool, len(raw))
    if ok.any():
        values = np.frombuffer(b"".join(b for b, good in zip(raw, ok, strict=True) if good), kind)
        out[ok] = values.astype(np.int64)
    for i in np.flatnonzero(~ok).tolist():
        if raw[i]:
            problems[i] = f"label of {len(raw[i])} bytes in {where}, where its encoding has {width}: damaged"
    return out, problems


def first_payload_check(samples: Samples, codec: str, where: str, flag: str) -> None:
    """Read the first sample's image payload as the build will: a field whose payloads are not images (a float
    array, a 1-D vector) is refused here, naming it, instead of failing every sample of the build."""
    if codec == "encoded":
        return  # image files: the build's decoder judges each one
    c = samples.columns
    for i, key in enumerate(samples.keys):
        if i in samples.problems:
            continue
        data = read_at(samples.files[int(c["file"][i])], int(c["offset"][i]), int(c["size"][i]), key)
        extra = {k: int(c[k][i]) for k in ("mode", "width", "height") if k in c}
        try:
            to_image(codec, data, key, **extra)
        except DecodeError as e:
            raise SourceError(f"{where}: its first image, {key}, cannot be read: {e.reason}; pass {flag} with "
                              f"the field that holds the images") from None
        return
