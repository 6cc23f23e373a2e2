"""The checkout's root, for tests that read its files or run code from it (the test modules sit at several
depths under tests/, mirroring the packages)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
