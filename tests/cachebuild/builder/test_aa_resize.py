"""aa_resize gives the bytes of torch's uint8 antialias kernel, the one caches were built with before (issue 36)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from cachebuild.builder.sample import aa_resize
from cachebuild.builder.sample.aa_resize import antialias_into


def _torch(src: np.ndarray, h: int, w: int, scales: tuple[float | None, float | None]) -> np.ndarray:
    """torch's kernel as the build called it until issue 36: NHWC (channels-last) views, explicit scales."""
    x = torch.from_numpy(src[None]).permute(0, 3, 1, 2)
    return torch._C._nn._upsample_bilinear2d_aa(x, [h, w], False, *scales)[0].permute(1, 2, 0).numpy()


def _case(rng: np.random.Generator, i: int) -> tuple[np.ndarray, tuple[int, int], tuple[float | None, float | None]]:
    """One random case: a crop view of a random image (odd sizes, 1.0x to 16x down, some upscales and
    one-axis-only changes), sometimes with the explicit scales of a DCT-reduced decode's extent."""
    out_h = int(rng.choice([1, 2, 7, 17, 32, 63, 64, 96, 101, 224]))
    out_w = out_h if i % 3 else max(1, out_h + int(rng.integers(-5, 6)))  # letterbox windows are not square
    f = float(rng.uniform(2.0, 16.0)) if i % 4 else float(rng.uniform(0.5, 3.0))
    h, w = max(1, round(out_h * f * rng.uniform(0.9, 1.2))), max(1, round(out_w * f * rng.uniform(0.9, 1.2)))
    if i % 11 == 0:
        w = out_w  # only the height changes: the horizontal pass is skipped
    if i % 13 == 0:
        h = out_h
    full = rng.integers(0, 256, (h + 3, w + 5, 3), dtype=np.uint8)
    if i % 5 == 0:
        full = np.where(rng.random(full.shape) < 0.5, 0, 255).astype(np.uint8)  # extremes: any overflow shows
    src = full[1 : 1 + h, 2 : 2 + w]  # a crop view, as the build passes its crop window
    scales: tuple[float | None, float | None] = (None, None)
    if i % 2:
        # a reduced decode: the output spans (eh, ew) <= the array's size (see decode._fit_reduced)
        eh, ew = h * float(rng.uniform(0.8, 1.0)), w * float(rng.uniform(0.8, 1.0))
        scales = (out_h / eh, out_w / ew)
    return src, (out_h, out_w), scales


@pytest.mark.parametrize("seed", range(4))
def test_the_bytes_of_torch_over_random_sizes_and_scales(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(150):  # 600 cases in all
        src, (h, w), scales = _case(rng, i)
        expected = _torch(np.ascontiguousarray(src), h, w, scales)
        got = np.empty((h, w, 3), np.uint8)
        antialias_into(src, got, scales)
        assert np.array_equal(got, expected), (src.shape, (h, w), scales)


def test_a_letterbox_window_is_written_in_place_and_nothing_around_it() -> None:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, (301, 455, 3), dtype=np.uint8)
    slot = np.full((64, 64, 3), 9, np.uint8)
    window = slot[11:53, :]  # not C-contiguous... rows of the slot
    antialias_into(src, window[:, 1:63], (42 / 301, 62 / 455))
    assert np.array_equal(window[:, 1:63], _torch(src, 42, 62, (42 / 301, 62 / 455)))
    untouched = np.ones((64, 64), bool)
    untouched[11:53, 1:63] = False
    assert (slot[untouched] == 9).all()


@pytest.mark.parametrize(
    ("shape", "size", "exact"),
    [
        ((500, 537), (224, 224), (True, True)),  # the bench's usual ~2.3x: float32, precision 16
        ((150, 90), (224, 201), (True, True)),  # upscales: precision 14
        ((2000, 1900), (224, 224), (False, False)),  # ~9x: precision 17, sums past 2^24: int32
        ((1800, 400), (224, 224), (False, True)),  # int32 for the height, float32 for the width
    ],
)
def test_the_float32_and_int32_paths_give_the_bytes_of_torch(
    shape: tuple[int, int], size: tuple[int, int], exact: tuple[bool, bool]
) -> None:
    """Each pass runs in float32 where its sums are exact and in int32 otherwise: both give torch's bytes,
    on random pixels and on all-0/255 ones (the largest sums, where a lost bit or a missed clamp shows)."""
    (h, w), (oh, ow) = shape, size
    assert (aa_resize._pass(h, oh, None).exact, aa_resize._pass(w, ow, None).exact) == exact
    rng = np.random.default_rng(h + w)
    for src in (rng.integers(0, 256, (h, w, 3), dtype=np.uint8), np.where(rng.random((h, w, 3)) < 0.5, 0, 255)):
        src = src.astype(np.uint8)
        got = np.empty((oh, ow, 3), np.uint8)
        antialias_into(src, got)
        assert np.array_equal(got, _torch(src, oh, ow, (None, None)))
        flat = np.full((h, w, 3), 255, np.uint8)  # every sum at its largest
        antialias_into(flat, got)
        assert np.array_equal(got, _torch(flat, oh, ow, (None, None)))


@pytest.mark.parametrize("size", [(42, 62), (42, 455), (301, 62)])  # both axes, the width only, the height only
def test_strided_sources_and_windows_of_any_layout(size: tuple[int, int]) -> None:
    """A source whose pixels are not contiguous (every other column, channels reversed) and windows that
    are rows of a slot or not even that (every other column): the same bytes, nothing else written."""
    rng = np.random.default_rng(11)
    full = rng.integers(0, 256, (303, 912, 3), dtype=np.uint8)
    h, w = size
    for src in (full[1:302, 1:911:2], full[2:, 3:458, ::-1], full[1:302, 2:457]):
        expected = _torch(np.ascontiguousarray(src), h, w, (None, None))
        for window in ("rows", "strided"):
            slot = np.full((320, 2 * w + 8, 3), 9, np.uint8)
            out = slot[5 : 5 + h, 3 : 3 + w] if window == "rows" else slot[5 : 5 + h, 3 : 3 + 2 * w : 2]
            antialias_into(src, out)
            assert np.array_equal(out, expected), (src.strides, window)
            written = np.zeros(slot.shape[:2], bool)
            if window == "rows":
                written[5 : 5 + h, 3 : 3 + w] = True
            else:
                written[5 : 5 + h, 3 : 3 + 2 * w : 2] = True
            assert (slot[~written] == 9).all()


@pytest.mark.parametrize("rows", [1, aa_resize.TILE_ROWS - 1, aa_resize.TILE_ROWS, aa_resize.TILE_ROWS + 1,
                                  3 * aa_resize.TILE_ROWS + 7])
def test_the_width_pass_by_tiles_of_rows_gives_the_bytes_of_the_whole(rows: int) -> None:
    """Tiles of rows in the width pass (the last one short, or the only one), in float32 and in int32, and the
    work arrays of the previous, larger call reused: each the bytes of torch."""
    rng = np.random.default_rng(rows)
    big = rng.integers(0, 256, (4 * aa_resize.TILE_ROWS, 700, 3), dtype=np.uint8)
    antialias_into(big, np.empty((50, 90, 3), np.uint8))  # leaves larger work arrays behind
    for width, out_w in ((455, 97), (2300, 224)):  # ~4.7x: float32; ~10x: sums past 2^24, int32
        src = rng.integers(0, 256, (rows + 2, width, 3), dtype=np.uint8)[1 : 1 + rows]
        out_h = max(1, rows // 3)
        got = np.empty((out_h, out_w, 3), np.uint8)
        antialias_into(src, got)
        assert np.array_equal(got, _torch(np.ascontiguousarray(src), out_h, out_w, (None, None))), (rows, width)


def test_threads_resizing_at_once_each_get_their_own_bytes() -> None:
    """The work arrays are per thread: two threads (as in a threaded build) resizing different images at once."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    sources = [rng.integers(0, 256, (int(rng.integers(300, 700)), int(rng.integers(300, 700)), 3), dtype=np.uint8)
               for _ in range(24)]

    def resize(src: np.ndarray) -> np.ndarray:
        out = np.empty((112, 112, 3), np.uint8)
        for _ in range(3):
            antialias_into(src, out)
        return out

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(resize, sources))
    for src, got in zip(sources, results, strict=True):
        assert np.array_equal(got, _torch(src, 112, 112, (None, None)))


def test_the_same_size_is_a_copy() -> None:
    src = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    out = np.empty_like(src)
    antialias_into(src[:, :], out, (0.5, 0.5))  # torch copies when no size changes, whatever the scales
    assert np.array_equal(out, src) and np.array_equal(out, _torch(src, 20, 30, (0.5, 0.5)))


def test_a_build_process_loads_the_kernel_without_scipy_sparse_and_gets_the_same_bytes() -> None:
    """The parent of a pool build never loads the kernel, and a worker loads scipy's extension alone,
    not the ``scipy.sparse`` package (0.13-0.27 s a fresh process, issue 36): the same bytes as through it."""
    code = """
import sys
import numpy as np
import cachebuild.builder.pipeline, cachebuild.cli
assert "scipy.sparse" not in sys.modules and "scipy" not in sys.modules, "imported with the build"
from cachebuild.builder.sample import aa_resize
src = np.random.default_rng(3).integers(0, 256, (301, 455, 3), dtype=np.uint8)
a = np.empty((64, 71, 3), np.uint8)
aa_resize.antialias_into(src, a)
assert "scipy.sparse" not in sys.modules, "the package was imported"
import scipy.sparse
aa_resize._csr_matvecs.cache_clear()
b = np.empty_like(a)
aa_resize.antialias_into(src, b)
assert np.array_equal(a, b)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
