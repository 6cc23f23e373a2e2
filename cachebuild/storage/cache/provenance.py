"""Who is running cachebuild, where, and how: recorded in manifests (``built_by``) and lock files, shown in
messages. Nothing secret: a user name, a host name, and the command line with every URL redacted (a
presigned URL carries its credentials in the query string)."""

from __future__ import annotations

import getpass
import os
import shlex
import socket
import sys

from cachebuild.storage.locations.names import is_url, redact

__all__ = ["built_by", "command_line", "current_host", "current_user"]


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container uid without a passwd entry
        return f"uid {os.getuid()}"


def current_host() -> str:
    return socket.gethostname() or "unknown-host"


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line, URLs redacted; ``python -m cachebuild ...`` shown as ``cachebuild ...``."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    head = os.path.basename(args[0])
    if head == "__main__.py":
        head = os.path.basename(os.path.dirname(args[0])) or head
    return " ".join(shlex.quote(redact(a) if is_url(a) else a) for a in [head, *args[1:]])


def built_by() -> dict[str, str]:
    """What a manifest records about who built it."""
    return {"user": current_user(), "host": current_host()}
