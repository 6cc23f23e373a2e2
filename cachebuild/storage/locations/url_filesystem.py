"""The fsspec filesystem behind a URL location, one per process: our default options (timeouts, no retries but
the remote layer's), its construction with a clear error for a missing extra, and the fork safety both need."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from typing import Any

from cachebuild.errors import RemoteError
from cachebuild.storage.remote import retry
from cachebuild.storage.remote.pinning import Pins, install_s3_hook
from cachebuild.storage.remote.s3_session import new_s3_session

__all__ = ["fs_options", "make_fs", "making", "note_dropped"]

_MAKING = threading.Lock()


def _unlock_in_child() -> None:
    global _MAKING
    _MAKING = threading.Lock()  # a fork while another thread held it (DataLoader workers) must not inherit it


os.register_at_fork(after_in_child=_unlock_in_child)


def making() -> contextlib.AbstractContextManager[Any]:
    """The lock under which a location makes its filesystem (this process's, re-made after a fork)."""
    return _MAKING


# fsspec's filesystems are reference cycles (their mirrored sync methods hold them), each with a finalizer
# that closes its session through the loop it was made on. One dropped in this process but not collected yet
# is inherited by a forked child (a DataLoader worker), whose collector then runs that finalizer against the
# parent's loop, which no thread runs there: a 1 s wait (fsspec's sync, then its fallback) per filesystem, on
# whatever thread collects, the child's own I/O loop included: measured as a 5 s stall of a cold epoch's
# second batch once a few datasets were dropped. So a fork after a location with a filesystem was dropped
# first collects here, where their loop runs and each session closes at once.
_dropped = [0]  # locations with a filesystem dropped since the last collection before a fork


def note_dropped() -> None:
    """Called when a location that made a filesystem is dropped."""
    _dropped[0] += 1


def _collect_before_fork() -> None:
    if _dropped[0]:
        _dropped[0] = 0
        gc.collect()


os.register_at_fork(before=_collect_before_fork)


def fs_options(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` plus our defaults for fsspec filesystems of this protocol: a socket read timeout (a
    stalled server must not hang a worker), and for S3 no retries of botocore's or s3fs's own (the remote
    layer's one policy retries each request)."""
    opts = dict(storage_options)
    timeout = retry.settings().http_timeout_s
    if protocol in ("http", "https"):
        import aiohttp

        # aiohttp's default is a 5-minute total timeout: a stalled server would hang a worker.
        opts["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(
            total=None, sock_connect=10, sock_read=timeout), **opts.get("client_kwargs", {})}
    elif protocol in ("s3", "s3a"):
        opts["config_kwargs"] = {"read_timeout": timeout, "connect_timeout": 10,
                                 "retries": {"total_max_attempts": 1}, **opts.get("config_kwargs", {})}
    return opts


def make_fs(protocol: str, opts: dict[str, Any], pins: Pins | None, described: str) -> Any:
    """A new filesystem (never fsspec's shared instance: each process and location owns its own); S3 reads
    carry ``If-Match`` for ``pins``. ``described`` names the URL in errors, without credentials."""
    import fsspec

    opts = dict(opts)
    if protocol in ("s3", "s3a"):
        opts.setdefault("session", new_s3_session())
        if pins is not None:
            install_s3_hook(opts["session"], pins)
    try:
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **opts)
    except ImportError as e:
        raise RemoteError(f"reading {protocol}:// URLs needs an extra package ({e}); "
                          f"pip install 'cachebuild[remote]'") from None
    except ValueError as e:  # "Protocol not known"
        raise RemoteError(f"{described}: cannot open this URL ({e})") from None
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute): one try, ours retry it
    return fs
