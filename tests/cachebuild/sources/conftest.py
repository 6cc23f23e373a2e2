"""Fixtures of the source tests: the reference build of the photos the peer-format golden files hold."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cachebuild.sources.peer_files.peer_checks import reference_pixels


@pytest.fixture(scope="session")
def peer_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/cachebuild/sources/peer_files/originals built at peer_checks.SIZE: ``pixels`` (the cache's samples)
    and ``originals`` (the arrays), by sample index."""
    return reference_pixels(tmp_path_factory.mktemp("peer-reference") / "ref")
