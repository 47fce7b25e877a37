"""Remote calls retried with exponential backoff and jitter, where the error looks transient."""

import asyncio
import errno
import itertools
import random
import re
import time

from fastdata.errors import FastdataError, FormatError, MissingDependencyError, NotFoundError, RemoteError

RETRY_ATTEMPTS = 6  # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of backoff (jittered): rides out a ~3 s outage
_MAX_DELAY = 5.0  # seconds: one wait is never longer than this
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, NotFoundError, FormatError,
              MissingDependencyError, FastdataError)
_PERMANENT_ERRNOS = (errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR, errno.ENOTDIR)  # s3fs: 4xx
_TRANSIENT_TEXT = re.compile(
    r"\b5\d\d\b|SlowDown|ServiceUnavailable|InternalError|RequestTimeout|Throttl|reset|timed? ?out|"
    r"temporarily|connection (?:aborted|closed|refused)|server disconnected|broken pipe|IncompleteRead",
    re.IGNORECASE,
)


# NOTE [transient errors]: a remote read fails transiently when the server or the path to it is busy or
# restarting (HTTP 5xx, S3's SlowDown and InternalError, a reset or timed-out connection); the same request a
# moment later succeeds. Everything that says the request itself is wrong (a missing key, access denied, a
# checksum that does not match, a missing package) fails the same way every time, so it raises at once:
# retrying it would only delay the message. Backends wrap errors differently (s3fs raises OSError or
# FileNotFoundError translated from botocore; aiohttp raises ClientError subclasses; fsspec's HTTP file system
# raises its own), so besides the types the error's text and its HTTP status (``.status``, ``.code`` or
# botocore's ``.response``) are read. Permanent types are checked first: FileNotFoundError is an OSError,
# and s3fs turns S3's 4xx answers into OSErrors with an errno (InvalidRange: EINVAL, AccessDenied: EACCES)
# while its 5xx and SlowDown become EBUSY or EIO.
def is_transient(exc):
    """Return whether ``exc`` may go away if the same request is made again (see NOTE [transient errors])."""
    if isinstance(exc, _PERMANENT) or getattr(exc, "errno", None) in _PERMANENT_ERRNOS:
        return False
    status = _status_of(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (OSError, ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return bool(_TRANSIENT_TEXT.search(text)) or _is_network_error(exc)


def _status_of(exc):
    """Return the HTTP status an exception carries, or None."""
    for attribute in ("status", "status_code", "code"):
        value = getattr(exc, attribute, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    return None


def _is_network_error(exc):
    """Return whether ``exc`` is an aiohttp or botocore connection error (without importing either)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ClientConnectionError", "ServerDisconnectedError", "ClientPayloadError",
                         "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError"})


def retried(call, what, *, attempts=RETRY_ATTEMPTS, first_delay=0.1):
    """Return ``call()``, calling it again after a transient error (see NOTE [transient errors]).

    Waits ``first_delay`` seconds after the first failure, twice as long after
    each next one (up to 5 s), each wait jittered to 50-100% so that readers
    failing together do not retry together.

    Args:
        call: a function of no arguments making one remote request (or a few).
        what: the URL it reads or writes, for the message.
        attempts: how many calls at most.
        first_delay: seconds to wait after the first failure.

    Raises:
        RemoteError: every attempt failed transiently; names ``what``, the attempts and the last error.
        Exception: a permanent error, as ``call`` raised it.
    """
    delay, attempts = first_delay, max(1, attempts)
    for attempt in itertools.count(1):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 -- classified below
            if not is_transient(exc):
                raise
            if attempt == attempts:
                raise RemoteError(
                    f"{what!r}: {attempts} attempts failed, the last with {type(exc).__name__}: {exc}. "
                    "Check the network and the storage service, then run again."
                ) from exc
        time.sleep(min(delay, _MAX_DELAY) * random.uniform(0.5, 1.0))
        delay *= 2
