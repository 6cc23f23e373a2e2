"""botocore sessions for S3 locations that share what is the same in all of them: the parsed JSON models."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["new_s3_session"]


@functools.cache
def _botocore_loader() -> Any:
    """botocore's data loader (the parsed JSON of its endpoints and of S3's API), one per process: a new session
    would parse them again, ~0.15 s of CPU for each filesystem made (every location, every DataLoader worker).
    Taken from a first session, so ``AWS_DATA_PATH`` still applies."""
    import aiobotocore.session

    return aiobotocore.session.AioSession().get_component("data_loader")


def new_s3_session() -> Any:
    """A session of its own for one location (its event hooks are that location's pins), with the shared loader."""
    import aiobotocore.session

    session = aiobotocore.session.AioSession()
    session.register_component("data_loader", _botocore_loader())
    return session
