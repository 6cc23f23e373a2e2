"""The fixtures of the loopback servers (the servers themselves are in ``support/``: ``support.http_server``,
``support.s3_server``), registered for every module through ``tests/conftest.py``:

- ``http_server(root, writable=False, etags=True) -> HttpServer``: serves the folder ``root`` at ``.url``
  until the test ends: ranges, listings, ETags, a request log and injected faults (``.fail(path, kind, times)``:
  ``"drop"``, ``"stall"`` or a status code); ``support/http_server.py`` says what each does.
- ``s3_server`` (session): moto's ``ThreadedMotoServer`` on 127.0.0.1, every request logged in ``.log``.
- ``s3``: a fresh bucket on it, an ``s3fs.S3FileSystem`` for it, and the AWS environment that makes a plain
  ``fsspec.open`` of an ``s3`` URL (also in a subprocess) reach that server with dummy credentials. The variables
  are set with ``monkeypatch``, so they vanish when the test ends; instance metadata lookups are disabled
  and the user's ~/.aws files are hidden, so no test reaches any address but 127.0.0.1.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.http_server import HttpServer
from support.loopback import EventLoopThread
from support.s3_server import AWS_CLEARED, DUMMY_KEY, DUMMY_SECRET, S3Bucket, S3Server, aws_test_env

__all__ = ["aws_session_env", "http_server", "s3", "s3_server"]


@pytest.fixture(scope="session")
def _http_loop() -> Iterator[EventLoopThread]:
    with EventLoopThread("test-http-loop") as loop:
        yield loop


@pytest.fixture
def http_server(_http_loop: EventLoopThread) -> Iterator[Callable[..., HttpServer]]:
    """Factory: ``http_server(root, writable=False, etags=True)`` starts a server of ``root``; it stops when the
    test ends."""
    started: list[HttpServer] = []

    def start(root: str | os.PathLike[str], writable: bool = False, etags: bool = True) -> HttpServer:
        server = HttpServer(Path(root), writable, etags)
        _http_loop.run(server.start())
        started.append(server)
        return server

    yield start
    for server in started:
        _http_loop.run(server.stop())


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _aws_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aws")  # left empty: the user's profiles stay out


@pytest.fixture(scope="session", autouse=True)
def aws_session_env(s3_server: S3Server, _aws_home: Path) -> Iterator[dict[str, str]]:
    """The loopback AWS environment for the whole session, in every test (autouse, via ``tests/conftest.py``).
    loky reuses its worker processes, which keep the environment they started in, and a pool may start (or
    start again) in any test: with the environment set from the start, any pool serves ``s3`` tests too.
    Restarting the pool whenever tests went from ``s3`` to none and back started it 7 times a run, each two
    interpreters importing the build and torch. For tests without ``s3`` it names only the loopback server
    and empty config files."""
    env = aws_test_env(s3_server.endpoint_url, _aws_home)
    mp = pytest.MonkeyPatch()
    for name in AWS_CLEARED:
        mp.delenv(name, raising=False)
    for name, value in env.items():
        mp.setenv(name, value)
    yield env
    mp.undo()


@pytest.fixture
def s3(s3_server: S3Server, aws_session_env: dict[str, str]) -> Iterator[S3Bucket]:
    """A fresh bucket and an s3fs filesystem for it; the AWS environment (the session's, pointing at the
    loopback server) comes with it for subprocesses."""
    import s3fs

    from cachebuild.storage.locations.url import new_s3_session

    fs = s3fs.S3FileSystem(endpoint_url=s3_server.endpoint_url, key=DUMMY_KEY, secret=DUMMY_SECRET,
                           skip_instance_cache=True, use_listings_cache=False, session=new_s3_session())
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    s3_server.log.clear()
    yield S3Bucket(bucket, s3_server.endpoint_url, fs, s3_server.log, aws_session_env)
