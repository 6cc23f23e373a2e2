"""Editing a cache's manifest in a test, as a person editing it by hand must: without its checksum."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cachebuild.format.manifest import CHECKSUM_FIELD


def load_unsealed(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields of the manifest at ``path`` for a test to change and write back, less the checksum that
    any change would break: the manifest of a cache from before checksums, or a hand-made one."""
    d = json.loads(Path(path).read_text())
    d.pop(CHECKSUM_FIELD, None)
    return d
