"""Remote calls retried with exponential backoff and jitter, where the error looks transient."""

import asyncio
import errno
import itertools
import os
import random
import re
import time
from dataclasses import dataclass

from fastdata.errors import FastdataError, FormatError, MissingDependencyError, NotFoundError, OptionError, RemoteError

RETRY_ATTEMPTS = 6  # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of backoff (jittered): rides out a ~3 s outage
RETRY_SECONDS = 30.0  # no attempt starts later than this after the first; see NOTE [retry budget]
TIMEOUT = 10.0  # seconds a request waits to connect, and for each next bytes of the answer
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


# NOTE [retry budget]: every remote read and write fastdata makes itself (an index, a shard's ranged
# GETs, a listing, a record, an upload, a delete) goes through ``retried`` with one policy, read from the
# environment so that workers, subprocesses and the CLI share it (a bad value raises OptionError naming it):
#   FASTDATA_RETRIES        attempts at most (default 6: 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of jittered backoff)
#   FASTDATA_RETRY_SECONDS  no new attempt starts this long after the first (default 30)
#   FASTDATA_TIMEOUT        seconds a request waits to connect, and then for each next bytes (default 10);
#                           given to the backend (botocore's connect/read timeouts, aiohttp's sock timeouts)
# so a call that keeps failing raises within FASTDATA_RETRY_SECONDS + FASTDATA_TIMEOUT. An endpoint that
# accepts connections and never answers failed open_dataset in 97 s (six attempts of s3fs's 15 s read
# timeout); now in 32.5 s by default (3 attempts, 31.3 s of retrying) and 5.0 s with FASTDATA_TIMEOUT=1 and
# FASTDATA_RETRY_SECONDS=2 (3.1 s of retrying; the rest starts s3fs's client on 2 busy cores). The error
# names the URL, the attempts, the time and the options to change. A refusal (403, an invalid request: a
# permanent OSError other than a 404, which callers name themselves) is raised at once as a RemoteError
# naming the URL. Backends' own retry loops are set to one attempt (NOTE [one retry layer] in urls.py),
# so these are the only retries.


@dataclass(frozen=True)
class RetryPolicy:
    """How remote calls are retried and how long one request may wait (see NOTE [retry budget])."""

    attempts: int = RETRY_ATTEMPTS
    seconds: float = RETRY_SECONDS
    timeout: float = TIMEOUT
    first_delay: float = 0.1

    def options(self):
        """Return the settings as the environment variables that set them, for messages."""
        return (f"FASTDATA_RETRIES={self.attempts}, FASTDATA_RETRY_SECONDS={self.seconds:g}, "
                f"FASTDATA_TIMEOUT={self.timeout:g}")


def retry_policy():
    """Return the RetryPolicy the environment sets (FASTDATA_RETRIES, FASTDATA_RETRY_SECONDS, FASTDATA_TIMEOUT).

    Raises:
        OptionError: a variable is not a positive number (an integer for FASTDATA_RETRIES).
    """
    return RetryPolicy(attempts=_env_number("FASTDATA_RETRIES", RETRY_ATTEMPTS, int),
                       seconds=_env_number("FASTDATA_RETRY_SECONDS", RETRY_SECONDS, float),
                       timeout=_env_number("FASTDATA_TIMEOUT", TIMEOUT, float))


def _env_number(name, default, kind):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise OptionError(f"{name} should be a positive {'integer' if kind is int else 'number'}, got {name}={text!r}")
    return value


def retried(call, what, *, attempts=None, first_delay=None, policy=None):
    """Return ``call()``, calling it again after a transient error (see NOTE [transient errors], [retry budget]).

    Waits ``first_delay`` seconds after the first failure, twice as long after
    each next one (up to 5 s), each wait jittered to 50-100% so that readers
    failing together do not retry together; starts no attempt past the
    policy's ``seconds`` from the first.

    Args:
        call: a function of no arguments making one remote request (or a few).
        what: the URL it reads or writes, for the message.
        attempts, first_delay: override the policy's.
        policy: a RetryPolicy; default ``retry_policy()`` (the environment's).

    Raises:
        RemoteError: every attempt failed transiently, or the time ran out (names ``what``, the attempts,
            the time, the last error and the options that set the budget); or the storage refused the
            request (an OSError such as access denied: names ``what``).
        Exception: any other permanent error (FileNotFoundError included), as ``call`` raised it.
    """
    policy = policy or retry_policy()
    attempts = max(1, policy.attempts if attempts is None else attempts)
    delay = policy.first_delay if first_delay is None else first_delay
    started = time.monotonic()
    for attempt in itertools.count(1):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 -- classified below
            if not is_transient(exc):
                if isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, FastdataError)):
                    raise RemoteError(  # access denied, an invalid request: name the URL (callers name a 404)
                        f"{what!r}: {type(exc).__name__}: {exc}. The storage refused the request, so it was not "
                        "retried: check the credentials, the permissions and the URL") from exc
                raise
            wait = min(delay, _MAX_DELAY) * random.uniform(0.5, 1.0)
            elapsed = time.monotonic() - started
            if attempt >= attempts or elapsed + wait > policy.seconds:
                raise RemoteError(_gave_up(what, attempt, elapsed, exc, policy)) from exc
        time.sleep(wait)
        delay *= 2


def _gave_up(what, attempts, elapsed, exc, policy):
    """Return the message of a call that failed ``attempts`` times in ``elapsed`` seconds, the last with ``exc``."""
    timed_out = isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or "timeout" in type(exc).__name__.lower()
    hint = (f"No answer came within FASTDATA_TIMEOUT={policy.timeout:g} s: check the endpoint, or raise it if the "
            "storage is slow" if timed_out else "Check the network and the storage service")
    return (f"{what!r}: {attempts} attempt{'s' * (attempts > 1)} failed in {elapsed:.1f} s, the last with "
            f"{type(exc).__name__}: {exc}. {hint}, then run again (retried as {policy.options()}).")
