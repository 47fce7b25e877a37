"""Retries: transient errors are retried with backoff, permanent ones raise at once."""

import asyncio

import pytest

from fastdata.errors import FormatError, MissingDependencyError, NotFoundError, RemoteError
from fastdata.storage import is_transient, retried


class StatusError(Exception):
    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


class BotoLike(Exception):
    def __init__(self, code):
        super().__init__("An error occurred")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": code}}


@pytest.mark.parametrize("exc", [
    OSError("boom"), OSError(16, "Please reduce your request rate"),
    ConnectionResetError(), TimeoutError(), asyncio.TimeoutError(), StatusError(503),
    StatusError(500), StatusError(429), BotoLike(503), Exception("SlowDown: Please reduce your request rate"),
    Exception("Connection reset by peer"), type("ServerDisconnectedError", (Exception,), {})(),
])
def test_transient_errors(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    FileNotFoundError("s3://b/k"), PermissionError(), NotFoundError("x"), FormatError("crc32"),
    MissingDependencyError("s3fs"), RemoteError("gave up"), StatusError(404), StatusError(403), BotoLike(400),
    ValueError("bad"), KeyError("k"), OSError(22, "The requested range is not satisfiable"),
    OSError(13, "Access Denied"),
])
def test_permanent_errors(exc):
    assert not is_transient(exc)


def flaky(failures, exc_type=ConnectionResetError):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= failures:
            raise exc_type("reset")
        return "ok"

    return call, calls


def test_transient_failures_are_retried_until_success():
    call, calls = flaky(3)
    assert retried(call, "s3://b/k", first_delay=0.001) == "ok"
    assert len(calls) == 4


def test_the_last_failure_raises_remote_error_naming_url_attempts_and_cause():
    call, calls = flaky(10)
    message = r"'s3://b/k': 3 attempts failed in .* s, the last with ConnectionResetError: reset\. Check the network"
    with pytest.raises(RemoteError, match=message + ".*FASTDATA_RETRIES="):
        retried(call, "s3://b/k", attempts=3, first_delay=0.001)
    assert len(calls) == 3


def test_permanent_errors_raise_at_once():
    call, calls = flaky(10, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        retried(call, "s3://b/k", first_delay=0.001)
    assert len(calls) == 1


def test_backoff_doubles_with_jitter(monkeypatch):
    import fastdata.storage.retry as retry

    waits = []
    monkeypatch.setattr(retry.time, "sleep", waits.append)
    call, _ = flaky(4)
    retried(call, "s3://b/k", first_delay=0.1)
    assert len(waits) == 4
    for n, wait in enumerate(waits):
        assert 0.05 * 2**n <= wait <= 0.1 * 2**n
