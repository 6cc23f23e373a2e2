"""A real browser opens the report from disk: headless Chromium (Debian's package) takes a screenshot of
``index.html`` and of a class page, and the images the pages name must be on it, pixel for pixel.

The check bites: with the image folder moved away, the same search finds no sheet (the negative control).
Skipped, with the reason, where ``/usr/bin/chromium`` is absent (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from cachebuild.inspect import ReportOptions, write_report
from cachebuild.storage.cache import open_cache
from tests.inspect_fixtures import inspect_cache

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"needs headless Chromium at {CHROMIUM}: "
                                                      f"apt-get update && apt-get install -y chromium"),
]


def _screenshot(page: Path, out: Path, profile: Path, size: tuple[int, int] = (1400, 3200)) -> np.ndarray:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--force-device-scale-factor=1", "--hide-scrollbars", f"--user-data-dir={profile}",
           f"--screenshot={out}", f"--window-size={size[0]},{size[1]}", page.resolve().as_uri()]
    env = {**os.environ, "HOME": str(profile)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0 and out.is_file(), res.stderr[-2000:]
    return np.asarray(Image.open(out).convert("RGB"))


def _best_match(shot: np.ndarray, image: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean absolute difference of ``image`` against the screenshot region that matches it best, and that region."""
    scores = cv2.matchTemplate(shot, image, cv2.TM_SQDIFF)
    _, _, (x, y), _ = cv2.minMaxLoc(scores)
    h, w = image.shape[:2]
    region = shot[y : y + h, x : x + w]
    return float(np.abs(region.astype(np.int16) - image.astype(np.int16)).mean()), region


def test_the_report_opens_from_disk_with_its_images(tmp_path: Path) -> None:
    root, *_ = inspect_cache(tmp_path / "c", n=60, h=24, w=24)
    out = tmp_path / "report"
    write_report(open_cache(root), out, ReportOptions(per_class=6, classes_per_page=3, overview=16))
    for page, image in (("index.html", "samples.png"), ("index.html", "counts.png"),
                        ("classes-001.html", "class-00000.png")):
        png = np.asarray(Image.open(out / "img" / image).convert("RGB"))
        shot = _screenshot(out / page, tmp_path / f"{page}.png", tmp_path / "profile")
        diff, region = _best_match(shot, png)
        assert region.reshape(-1, 3).std(axis=0).max() > 10, image  # not a blank or uniform area
        assert diff < 1.0, f"{image} on {page}: mean difference {diff:.1f}"  # the very pixels of the PNG
    # the negative control: the same pages without their image files show no sheet
    shutil.move(out / "img", tmp_path / "img-away")
    shot = _screenshot(out / "index.html", tmp_path / "broken.png", tmp_path / "profile")
    diff, _ = _best_match(shot, np.asarray(Image.open(tmp_path / "img-away" / "samples.png").convert("RGB")))
    assert diff > 20, diff
