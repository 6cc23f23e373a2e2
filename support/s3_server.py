"""moto's S3 server on 127.0.0.1 with every request logged, a bucket on it, and the AWS environment that makes
a plain ``fsspec.open`` of an ``s3`` URL (also in a subprocess) reach that server, and only it, with dummy
credentials: instance metadata lookups disabled, the user's ~/.aws files hidden."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.loopback import HOST, LoggedRequest, RequestLog

__all__ = ["AWS_CLEARED", "DUMMY_KEY", "DUMMY_SECRET", "S3Bucket", "S3Server", "aws_test_env"]

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"  # moto accepts any credentials
# Variables that would lead a client past the loopback server (a profile, a role, a container's credentials)
AWS_CLEARED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ROLE_ARN",
               "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
               "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")


class S3Server:
    """moto's ThreadedMotoServer on 127.0.0.1 (a free port), with every request logged in ``.log``."""

    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer

        log = self.log = RequestLog()

        class LoggingMotoServer(ThreadedMotoServer):
            def _server_entry(self) -> None:
                from moto.moto_server.werkzeug_app import (
                    DomainDispatcherApplication,
                    MotoRequestHandler,
                    create_backend_app,
                )
                from werkzeug.serving import make_server

                app = _logged_wsgi(DomainDispatcherApplication(create_backend_app), log)
                self._server = make_server(self._ip_address, self._port, app, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = LoggingMotoServer(ip_address=HOST, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()


_WRITES = threading.Lock()


def _logged_wsgi(app: Callable[..., Any], log: RequestLog) -> Callable[..., Any]:
    """WSGI middleware: one :class:`LoggedRequest` per request, appended before the body's last chunk goes
    out (so a client that has its answer finds it in the log)."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        status = [0]

        def start(st: str, headers: Any, exc_info: Any = None) -> Any:
            status[0] = int(st.split()[0])
            return start_response(st, headers, exc_info)

        if environ["REQUEST_METHOD"] in ("PUT", "POST", "DELETE"):
            # moto checks a conditional write's precondition, then writes, in the request's own thread: two
            # writes at once could both pass. S3 decides them atomically; one write at a time here does too.
            with _WRITES:
                body = app(environ, start)
        else:
            body = app(environ, start)
        chunks = iter(body)
        sent = 0
        logged = False

        def record() -> None:
            nonlocal logged
            if not logged:
                logged = True
                log.append(LoggedRequest(environ["REQUEST_METHOD"],
                                         urllib.parse.unquote(environ.get("PATH_INFO", "")),
                                         environ.get("HTTP_RANGE"), status[0], sent))

        try:
            held = next(chunks, None)
            while held is not None:
                following = next(chunks, None)
                sent += len(held)
                if following is None:
                    record()
                yield held
                held = following
            record()
        finally:
            record()
            if hasattr(body, "close"):
                body.close()

    return wrapped


@dataclass
class S3Bucket:
    """A fresh bucket on a loopback S3 server."""

    name: str
    endpoint_url: str
    fs: Any  # s3fs.S3FileSystem bound to the server, no instance or listing cache
    log: RequestLog  # the server's log, emptied when the bucket was made
    env: dict[str, str]  # the AWS variables set for the test: pass them on to a subprocess

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key.lstrip('/')}"

    def storage_options(self) -> dict[str, Any]:
        """What to pass to fsspec for this server when the environment is not enough."""
        return {"endpoint_url": self.endpoint_url, "key": DUMMY_KEY, "secret": DUMMY_SECRET}


def aws_test_env(endpoint_url: str, home: Path) -> dict[str, str]:
    """The environment for a process that talks to the loopback S3 server only (``home``: an empty folder whose
    absent config files keep the user's profiles out)."""
    return {
        "AWS_ACCESS_KEY_ID": DUMMY_KEY,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ENDPOINT_URL_S3": endpoint_url,
        "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254 for credentials
        "AWS_CONFIG_FILE": str(home / "aws-config"),  # absent files: the user's profiles stay out
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
    }
