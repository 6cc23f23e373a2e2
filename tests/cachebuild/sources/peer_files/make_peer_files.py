"""Writes the golden peer-format files beside this script, each with that peer's own writer.

Ours, not peer code: it makes the inputs of tests/cachebuild/sources/test_peer_*.py, which read the files
without importing any peer. Run from the repository root, each step in the venv that has its writer
(bench/peers/setup.sh makes such venvs; any venv with the pinned version will do)::

    .venv/bin/python tests/cachebuild/sources/peer_files/make_peer_files.py originals
    PYTHONPATH=. VENV_FFCV/bin/python tests/cachebuild/sources/peer_files/make_peer_files.py ffcv
    PYTHONPATH=. VENV_STREAMING/bin/python tests/cachebuild/sources/peer_files/make_peer_files.py mds
    PYTHONPATH=. VENV_LITDATA/bin/python tests/cachebuild/sources/peer_files/make_peer_files.py litdata

``originals``: ten small crops of the sample photos (``cachebuild.samples.photos.photo_bank``: a centre crop halved),
16-40 px a side, as lossless PNGs in class folders (``originals/c{label}/{index}.png``): the pixels every peer
file holds and the folder the tests build as the reference. The peers' files then store them (see each function
for how), and ``payloads.json`` beside each records the SHA-256 of every stored image payload that is not raw
pixels (JPEG), as the peer's own reader finds it (FFCV) or as it was handed to the writer (MDS, LitData):

- ``ffcv/photos.beton`` (gzipped: FFCV pads every page to 2 MiB with zeros): ffcv 1.0.2.
- ``mds/``: mosaicml-streaming 0.13.0, several shards.
- ``litdata/``: litdata 0.2.76 ``optimize``, several chunks.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ORIGINALS = HERE / "originals"
LABELS = [3, 0, 2, 1, 0, 3, 1, 2, 2, 0]  # sample i's class
JPEG_QUALITY = 97


def _sizes(i: int) -> tuple[int, int]:
    """(width, height) of sample i: 16-40 px, neither square nor ordered."""
    return 16 + (i * 7) % 25, 40 - (i * 5) % 23


def write_originals() -> None:
    import cv2

    from cachebuild.samples.photos import photo_bank

    bank = photo_bank()
    shutil.rmtree(ORIGINALS, ignore_errors=True)
    for i, label in enumerate(LABELS):
        photo = bank[i % len(bank)][1]
        w, h = _sizes(i)
        y, x = (photo.shape[0] - 2 * h) // 2, (photo.shape[1] - 2 * w) // 2
        small = cv2.resize(photo[y:y + 2 * h, x:x + 2 * w], (w, h), interpolation=cv2.INTER_AREA)
        (ORIGINALS / f"c{label}").mkdir(parents=True, exist_ok=True)
        ok, png = cv2.imencode(".png", cv2.cvtColor(small, cv2.COLOR_RGB2BGR))
        assert ok
        (ORIGINALS / f"c{label}" / f"{i:02d}.png").write_bytes(png.tobytes())


def originals() -> list[np.ndarray]:
    """The ten RGB uint8 arrays, in sample order."""
    from PIL import Image

    out = []
    for i, label in enumerate(LABELS):
        with Image.open(ORIGINALS / f"c{label}" / f"{i:02d}.png") as im:
            out.append(np.asarray(im.convert("RGB")))
    return out


def original_path(i: int) -> Path:
    return ORIGINALS / f"c{LABELS[i]}" / f"{i:02d}.png"


def _jpeg_files(folder: Path) -> list[Path]:
    """Each original as a JPEG file (PIL, quality 97, no chroma subsampling), for the writers that store JPEG
    files' bytes."""
    from PIL import Image

    paths = []
    for i, img in enumerate(originals()):
        path = folder / f"{i:02d}.jpg"
        Image.fromarray(img).save(path, quality=JPEG_QUALITY, subsampling=0)
        paths.append(path)
    return paths


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_payloads(folder: Path, payloads: dict[str, list[str]], version: str) -> None:
    text = json.dumps({"written_by": version, "sha256": payloads}, indent=1, sort_keys=True)
    (folder / "payloads.json").write_text(text + "\n")


def write_ffcv() -> None:
    """Fields: ``image`` RGBImageField in 'smart' mode (samples over 2,000 raw bytes stored as JPEG at quality 97,
    the others raw), ``label`` IntField, ``weight`` FloatField (i / 10), ``png`` BytesField (the original PNG
    file's bytes). One worker, 2 MiB pages."""
    from ffcv.fields import BytesField, FloatField, IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    rows = [(img, LABELS[i], i / 10, np.frombuffer(original_path(i).read_bytes(), np.uint8))
            for i, img in enumerate(originals())]
    out = HERE / "ffcv"
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        beton = Path(tmp) / "photos.beton"
        fields = {"image": RGBImageField(write_mode="smart", smart_threshold=2000, jpeg_quality=JPEG_QUALITY),
                  "label": IntField(), "weight": FloatField(), "png": BytesField()}
        DatasetWriter(str(beton), fields, page_size=1 << 21, num_workers=1).from_indexed_dataset(rows)
        with open(beton, "rb") as src, gzip.GzipFile(out / "photos.beton.gz", "wb", 9, mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        _write_payloads(out, {"image": _ffcv_payloads(beton)}, f"ffcv {version('ffcv')}")


def _ffcv_payloads(beton: Path) -> list[str]:
    """The SHA-256 of every sample's ``image`` payload (JPEG or raw RGB) where FFCV's own Reader locates it:
    the metadata's data pointer, its size from the allocation table."""
    from ffcv.reader import Reader

    reader = Reader(str(beton))
    sizes = {int(a["ptr"]): int(a["size"]) for a in reader.alloc_table}
    data = beton.read_bytes()
    ptrs = [int(p) for p in reader.metadata["f0"]["data_ptr"]]
    return [_sha(data[p:p + sizes[p]]) for p in ptrs]


def write_mds() -> None:
    """Columns: ``image`` jpeg (the JPEG file's bytes), ``pil`` pil (raw RGB), ``array`` ndarray:uint8 (dtype
    fixed, shape per sample), ``label`` int. Shards of at most 16 KB."""
    from PIL import Image
    from streaming import MDSWriter

    out = HERE / "mds"
    shutil.rmtree(out, ignore_errors=True)
    columns = {"image": "jpeg", "pil": "pil", "array": "ndarray:uint8", "label": "int"}
    with tempfile.TemporaryDirectory() as tmp:
        jpegs = _jpeg_files(Path(tmp))
        with MDSWriter(out=str(out), columns=columns, size_limit=16 << 10) as writer:
            for i, img in enumerate(originals()):
                with Image.open(jpegs[i]) as jpeg:
                    writer.write({"image": jpeg, "pil": Image.fromarray(img), "array": img, "label": LABELS[i]})
        _write_payloads(out, {"image": [_sha(p.read_bytes()) for p in jpegs]},
                        f"mosaicml-streaming {version('mosaicml-streaming')}")


def _litdata_sample(item: tuple[int, str]) -> dict:
    from PIL import Image

    i, jpeg_path = item
    img = originals()[i]
    return {"image": Image.fromarray(img), "jpeg": Image.open(jpeg_path), "array": img, "label": LABELS[i]}


def write_litdata() -> None:
    """``optimize`` of dict samples: ``image`` a PIL image (its 'pil' serializer: raw RGB), ``jpeg`` a JPEG file
    opened by PIL ('jpeg': the file's bytes), ``array`` the uint8 HWC array ('numpy'), ``label`` an int. One
    worker, chunks of at most 12 KB."""
    from litdata import optimize

    out = HERE / "litdata"
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        jpegs = _jpeg_files(Path(tmp))
        optimize(fn=_litdata_sample, inputs=[(i, str(p)) for i, p in enumerate(jpegs)], output_dir=str(out),
                 chunk_bytes="12KB", num_workers=1, mode=None, start_method="fork")
        _write_payloads(out, {"jpeg": [_sha(p.read_bytes()) for p in jpegs]}, f"litdata {version('litdata')}")


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    steps = {"originals": write_originals, "ffcv": write_ffcv, "mds": write_mds, "litdata": write_litdata}
    if step not in steps:
        sys.exit(f"usage: make_peer_files.py {{{'|'.join(steps)}}}")
    steps[step]()
