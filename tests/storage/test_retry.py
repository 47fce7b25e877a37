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


# ---------------------------------------------------------------- the budget (NOTE [retry budget])


def test_the_policy_comes_from_the_environment(monkeypatch):
    from fastdata.errors import OptionError
    from fastdata.storage import RetryPolicy, retry_policy

    for name in ("FASTDATA_RETRIES", "FASTDATA_RETRY_SECONDS", "FASTDATA_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert retry_policy() == RetryPolicy()
    monkeypatch.setenv("FASTDATA_RETRIES", "3")
    monkeypatch.setenv("FASTDATA_RETRY_SECONDS", "2.5")
    monkeypatch.setenv("FASTDATA_TIMEOUT", "0.5")
    assert (retry_policy().attempts, retry_policy().seconds, retry_policy().timeout) == (3, 2.5, 0.5)
    for name, value in [("FASTDATA_TIMEOUT", "0"), ("FASTDATA_TIMEOUT", "soon"), ("FASTDATA_RETRY_SECONDS", "inf"),
                        ("FASTDATA_RETRIES", "2.5"), ("FASTDATA_RETRIES", "-1")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(OptionError, match=rf"{name} should be a positive .*, got {name}='{value}'"):
            retry_policy()
        monkeypatch.delenv(name)


def test_no_attempt_starts_after_the_budget(monkeypatch):
    import time

    monkeypatch.setenv("FASTDATA_RETRY_SECONDS", "0.3")
    call, calls = flaky(1000)
    start = time.monotonic()
    with pytest.raises(RemoteError, match=r"attempts failed in 0\.\d s.*FASTDATA_RETRY_SECONDS=0\.3"):
        retried(call, "s3://b/k", attempts=1000, first_delay=0.05)
    assert time.monotonic() - start < 0.3 + 0.2 and 2 <= len(calls) < 10


def test_a_refusal_is_not_retried_and_names_the_url():
    call, calls = flaky(10, PermissionError)
    with pytest.raises(RemoteError, match=r"'s3://b/k': PermissionError: reset\. The storage refused the request"):
        retried(call, "s3://b/k", first_delay=0.001)
    assert len(calls) == 1


def test_a_timeout_names_the_option_to_raise(monkeypatch):
    monkeypatch.setenv("FASTDATA_TIMEOUT", "2")
    call, _ = flaky(10, TimeoutError)
    with pytest.raises(RemoteError, match=r"No answer came within FASTDATA_TIMEOUT=2 s"):
        retried(call, "s3://b/k", attempts=2, first_delay=0.001)


def test_s3_file_systems_get_the_policy_timeouts_unless_given_their_own(monkeypatch):
    pytest.importorskip("s3fs")
    from fastdata.storage import filesystem

    monkeypatch.setenv("FASTDATA_TIMEOUT", "3")
    options = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}
    config = filesystem("s3://b/k", options)[0].config_kwargs
    assert config["connect_timeout"] == config["read_timeout"] == 3.0
    assert config["retries"] == {"total_max_attempts": 1}  # see NOTE [one retry layer]
    own = filesystem("s3://b/k", {**options, "config_kwargs": {"read_timeout": 60}})[0].config_kwargs
    assert own["read_timeout"] == 60 and own["connect_timeout"] == 3.0
