"""The one-line errors of a location at a URL: each names the file (without credentials), what could not be
done, and why, told apart by the failure's type and HTTP status (:func:`cachebuild.storage.remote.retry.classify`),
never by its message text."""

from __future__ import annotations

from cachebuild.errors import (
    CacheChangedError,
    CacheCorruptError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from cachebuild.storage.locations.names import is_url, redact
from cachebuild.storage.remote import retry
from cachebuild.storage.remote.retry import Exhausted, RangeIgnored, ShortRead

__all__ = ["changed_error", "named_error"]


def changed_error(file: str, cache: str) -> CacheChangedError:
    """``file`` (as shown) no longer holds the version a pinned reader of the cache at ``cache`` opened."""
    return CacheChangedError(
        f"{file} changed since this job opened the cache at {cache} (replaced by `cachebuild push --force`, or "
        f"rewritten): this reader stops rather than serve bytes of another cache; restart the job to read what "
        f"is there now")


def _detail(exc: BaseException, url: str) -> str:
    detail = str(exc).replace(url, redact(url))
    return detail[:200] + "..." if len(detail) > 200 else detail


def _unavailable(where: str, what: str, exc: Exhausted, url: str) -> RemoteUnavailableError:
    last = f"HTTP {exc.status}" if exc.status is not None else type(exc.last).__name__
    why = (f"the time budget of {exc.budget_s:g} s (CACHEBUILD_RETRY_BUDGET) ran out" if exc.out_of_time
           else "CACHEBUILD_RETRIES tries")
    return RemoteUnavailableError(
        f"{where}: cannot {what} after {exc.attempts} attempts in {exc.elapsed:.1f} s ({why}); last answer: "
        f"{last}: {_detail(exc.last, url)}; the store is failing or overloaded: run the command again later",
        where, exc.status, exc.attempts)


def named_error(where: str, what: str, exc: BaseException, url: str) -> Exception:
    """The error to raise for ``exc``, a request for the file shown as ``where`` (to ``what`` it) that failed
    for good; ``url`` (the location's) is shown without its credentials wherever the failure's text holds it."""
    if isinstance(exc, Exhausted):
        return _unavailable(where, what, exc, url)
    status = retry.classify(exc).status
    missing = getattr(exc, "filename", None) or (exc.args[0] if exc.args else None)
    if isinstance(exc, FileNotFoundError) and isinstance(missing, str) and is_url(missing):
        where = redact(missing)  # the file of a multi-file call that was not there
    if status == 404 or (isinstance(exc, FileNotFoundError) and status is None):
        return RemoteNotFoundError(f"{where}: not found (cannot {what})")
    if status in (401, 403) or (isinstance(exc, PermissionError) and status is None):
        return RemoteError(f"{where}: access denied{f' (HTTP {status})' if status else ''}; check the "
                           f"credentials for this store (its standard environment variables or config files)")
    if isinstance(exc, RangeIgnored):
        return RemoteError(f"{where}: the server ignores HTTP Range requests ({exc}); serve the cache from one "
                           f"that answers them with 206 (nginx, Apache, object stores), or `cachebuild pull` it")
    if isinstance(exc, ShortRead):
        return CacheCorruptError(f"{where} is shorter than its manifest says (truncated upload?): {exc}")
    return RemoteError(f"{where}: cannot {what}: {type(exc).__name__}: {_detail(exc, url)}")
