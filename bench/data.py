"""The files every contender reads: real-photo JPEGs in an ImageFolder tree, made once per size."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["dir_bytes", "file_list", "source_tree", "subset_tree"]

N_CLASSES = 10


def source_tree(work: Path, n: int) -> Path:
    """``train/`` of an ILSVRC2012-layout tree of ``n`` real-photo JPEGs (``cachebuild.samples``), kept in
    ``work`` for later runs. Sizes like ImageNet's (~400x350, 1 in 25 large), no broken files."""
    from cachebuild.samples.imagenet_layout import write_imagenet

    root = work / f"jpegs-{n}"
    done = root / "complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        per_class = -(-n // N_CLASSES)
        write_imagenet(root, n_classes=N_CLASSES, train_per_class=per_class, val_per_class=0, seed=0)
        done.write_text("ok\n")
    return root / "train"


def subset_tree(train_dir: Path, n: int, dest: Path) -> Path:
    """An ImageFolder tree of the first ``ceil(n / classes)`` files of every class of ``train_dir``
    (hard links, so the same files), for the contenders that run on fewer images."""
    done = dest / "complete"
    if not done.exists():
        shutil.rmtree(dest, ignore_errors=True)
        classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
        per_class = -(-n // len(classes))
        for c in classes:
            (dest / "train" / c).mkdir(parents=True)
            for f in sorted((train_dir / c).iterdir())[:per_class]:
                os.link(f, dest / "train" / c / f.name)
        done.write_text("ok\n")
    return dest / "train"


def file_list(train_dir: Path, out: Path | None = None) -> list[tuple[str, int]]:
    """Every file of the tree in torchvision ``ImageFolder`` order with its label; also written to ``out``
    as JSON, for peers that run in other environments."""
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    files = [(str(f), k) for k, c in enumerate(classes) for f in sorted((train_dir / c).iterdir())]
    if out is not None:
        out.write_text(json.dumps(files))
    return files


def dir_bytes(path: Path) -> int:
    """Bytes on disk (allocated blocks) under ``path``."""
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)
