"""Mutated JPEG / PNG / GIF / WebP byte strings through the build's decode path (hypothesis).

Every input must either decode into a whole 32x32 sample or be skipped with a reason (DecodeError);
never another exception, a crash of the process, more than PER_IMAGE_S seconds, or a peak RSS over
RSS_LIMIT_MB. Decoding runs in a separate process (fuzz_worker) so a crash or a hang is seen, not
suffered. The default run tries FAST_EXAMPLES inputs per format; ``make reliability`` FULL_EXAMPLES.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from PIL import Image

from tests.reliability.fuzz_worker import serve

FAST_EXAMPLES = 120
FULL_EXAMPLES = int(os.environ.get("RELIABILITY_FUZZ_EXAMPLES", "3000"))
PER_IMAGE_S = 5.0  # a fuzzed 2000x2000 header decodes in ~0.1 s here; a hang shows as far more
RSS_LIMIT_MB = 1500  # the decode process: ~300 MB of libraries, 12 MB per image at the pixel limit
SEED = int(os.environ.get("RELIABILITY_SEED", "0"))


def _photo(h: int = 40, w: int = 48) -> np.ndarray:
    from cachebuild.samples.photos import photo_bank

    return np.ascontiguousarray(photo_bank()[1][1][100 : 100 + h, 120 : 120 + w])


def _encode(fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(_photo())
    if kw.pop("mode", None) == "P":
        img = img.convert("P")
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


SEEDS = {
    "JPEG": [_encode("JPEG", quality=90), _encode("JPEG", quality=75, progressive=True),
             _encode("JPEG", quality=85, subsampling=0)],
    "PNG": [_encode("PNG"), _encode("PNG", mode="P"), _encode("PNG", optimize=True)],
    "GIF": [_encode("GIF"), _encode("GIF", interlace=True)],
    "WEBP": [_encode("WEBP", quality=80), _encode("WEBP", lossless=True)],
}


@st.composite
def mutated(draw: st.DrawFn, fmt: str) -> bytes:
    """One of the format's seeds with 1-4 mutations: byte flips and sets (many in the header), inserted,
    deleted or repeated runs, a truncation, a header dimension set to a large value."""
    data = bytearray(draw(st.sampled_from(SEEDS[fmt])))
    for _ in range(draw(st.integers(1, 4))):
        n = len(data)
        if n == 0:
            break
        kind = draw(st.sampled_from(["flip", "set", "header", "insert", "delete", "repeat", "truncate", "dims"]))
        at = draw(st.integers(0, min(n - 1, 64) if kind in ("header", "dims") else n - 1))
        if kind in ("flip", "header"):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[at] = draw(st.sampled_from([0x00, 0xFF, 0xD8, 0xD9, 0xDA, 0xC0, 0x80, 0x7F]))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 256))]
        elif kind == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 512))]
        elif kind == "truncate":
            del data[at:]
        else:  # a width or height field (where the format keeps one near the start) made large
            data[at : at + 2] = draw(st.integers(0, 0xFFFF)).to_bytes(2, "big")
    if fmt == "PNG" and draw(st.booleans()):
        _fix_png_crcs(data)  # past libpng's CRC check, into inflate and the filters
    return bytes(data)


def _fix_png_crcs(data: bytearray) -> None:
    pos = 8
    while pos + 12 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        end = pos + 8 + length
        if end + 4 > len(data):
            return
        data[end : end + 4] = zlib.crc32(data[pos + 4 : end]).to_bytes(4, "big")
        pos = end + 4


class Decoder:
    """The decode process, restarted after a crash or a hang."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self._start()

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def __call__(self, data: bytes, fit: str, interpolation: str) -> tuple[str, str | None, float, float]:
        self.conn.send((data, fit, interpolation))
        if not self.conn.poll(PER_IMAGE_S + 60):  # first call: the process imports its libraries
            self.restart()
            return "hang", f"no answer within {PER_IMAGE_S + 60:.0f} s", float("inf"), 0.0
        try:
            return self.conn.recv()
        except EOFError:
            code = self.proc.exitcode
            self.restart()
            return "crash", f"decode process died (exit code {code})", 0.0, 0.0

    def restart(self) -> None:
        self.proc.kill()
        self.proc.join()
        self._start()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


@pytest.fixture(scope="module")
def decoder() -> Iterator[Decoder]:
    d = Decoder()
    d(SEEDS["JPEG"][0], "crop", "antialias")  # imports its libraries: not a decode's time
    yield d
    d.close()


STATS: dict[str, dict[str, float]] = {}  # per format, over the fast and the full test


def _fuzz(decoder: Decoder, ledger, fmt: str, examples: int, tmp_path: Path) -> None:
    stats = STATS.setdefault(fmt, {"ok": 0, "skip": 0, "slowest": 0.0, "rss": 0.0})
    before = stats["ok"] + stats["skip"]
    row = f"fuzzed {fmt} bytes through decode: a sample or a skip"

    @seed(SEED)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(data=mutated(fmt), fit=st.sampled_from(["crop", "pad", "squash"]),
           interpolation=st.sampled_from(["antialias", "area", "linear"]))
    def run(data: bytes, fit: str, interpolation: str) -> None:
        verdict, detail, seconds, rss = decoder(data, fit, interpolation)
        if verdict not in ("ok", "skip") or detail is not None or seconds > PER_IMAGE_S or rss > RSS_LIMIT_MB:
            kept = tmp_path / f"{fmt.lower()}-finding-{len(data)}.bin"
            kept.write_bytes(data)
            raise AssertionError(f"{verdict}: {detail}, {seconds:.2f} s, {rss:.0f} MB peak RSS (input: {kept})")
        stats[verdict] += 1
        stats["slowest"] = max(stats["slowest"], seconds)
        stats["rss"] = max(stats["rss"], rss)

    try:
        run()
    except BaseException as e:
        done = stats["ok"] + stats["skip"] - before
        ledger.add(row, done + 1, done, 1, str(e).splitlines()[0])
        raise
    done = stats["ok"] + stats["skip"] - before
    ledger.add(row, done, done, 0,
               detail=f"{stats['ok']:.0f} decoded, {stats['skip']:.0f} skipped with a reason; slowest "
                      f"{stats['slowest'] * 1000:.0f} ms, peak RSS of the decode process {stats['rss']:.0f} MB")


@pytest.mark.parametrize("fmt", list(SEEDS))
def test_fuzz_fast(decoder: Decoder, ledger, fmt: str, tmp_path: Path) -> None:
    _fuzz(decoder, ledger, fmt, FAST_EXAMPLES, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(SEEDS))
def test_fuzz_full(decoder: Decoder, ledger, fmt: str, tmp_path: Path) -> None:
    _fuzz(decoder, ledger, fmt, FULL_EXAMPLES, tmp_path)


def test_seeds_decode(decoder: Decoder) -> None:
    """The unmutated seeds are real images of every format: each decodes (the fuzzing starts from sense)."""
    for fmt, seeds in SEEDS.items():
        for data in seeds:
            assert decoder(data, "crop", "antialias")[:2] == ("ok", None), fmt


def test_png_chunk_declaring_2gb_is_refused_unallocated(decoder: Decoder, ledger) -> None:
    """Found by this fuzzer: a 4 KB PNG whose IDAT length field says 2 GB made OpenCV allocate 2 GB before
    failing (per worker: --jobs 16 would ask for 32 GB). The header check refuses it first."""
    png = SEEDS["PNG"][0]
    at = png.index(b"IDAT") - 4
    for declared in (0x7FFF0000, 0x10000000, len(png)):
        bomb = png[:at] + declared.to_bytes(4, "big") + png[at + 4 :]
        with ledger.trial("PNG chunk declaring up to 2 GB in a 4 KB file", f"{declared:#x}"):
            baseline = decoder(SEEDS["PNG"][0], "crop", "antialias")[3]
            verdict, detail, _, rss = decoder(bomb, "crop", "antialias")
            assert (verdict, detail) == ("skip", None)
            assert rss < baseline + 64, f"{rss:.0f} MB peak against {baseline:.0f} MB for a normal PNG"
