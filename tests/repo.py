"""The checkout's root, for tests that read its files or run code from it (the test modules sit at several
depths under tests/, mirroring the packages)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The test modules a session collected (tests/conftest.py fills it; tests/test_code_shape.py reads it). Here, not in
# conftest.py: pytest imports that file as ``conftest``, and ``tests.conftest`` would be a second module object.
COLLECTED_MODULES = pytest.StashKey[set[Path]]()
