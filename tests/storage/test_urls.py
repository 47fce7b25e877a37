"""URLs and the remote index: fastdata.storage.urls against moto's S3 and a plain HTTP server."""

import os
import pathlib
import shutil

import pytest

from fastdata.errors import FormatError, MissingDependencyError, NotFoundError
from fastdata.formats.shards import read_index
from fastdata.storage import filesystem, is_url, join, read_remote_index


@pytest.mark.parametrize("path", ["s3://bucket/train/", "gs://b/x", "az://c/d", "https://host/a", "file:///tmp/x",
                                  "memory://x", "s3a://b/k"])
def test_urls_are_urls(path):
    assert is_url(path)


@pytest.mark.parametrize("path", ["train", "./train/", "/data/train", "C:\\data", "s3:/bucket", "s3//x", "",
                                  pathlib.Path("/tmp/x"), b"s3://bytes", 3, None])
def test_local_paths_are_not(path):
    assert not is_url(path)


def test_join_adds_one_slash():
    assert join("s3://b/train/", "index.json") == join("s3://b/train", "index.json") == "s3://b/train/index.json"


def test_a_missing_backend_names_the_extra(monkeypatch):
    import fsspec.core

    def missing(url, **options):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastdata\[s3\]'"):
        filesystem("s3://bucket/train")


def assert_same_index(remote, local, url):
    assert remote.root == url.rstrip("/")
    for field in ("container", "metadata", "settings", "names", "checksums"):
        assert getattr(remote, field) == getattr(local, field)
    assert (remote.starts == local.starts).all() and (remote.sizes == local.sizes).all()


@pytest.mark.parametrize("slash", ["", "/"])
def test_the_remote_index_is_the_local_one(remote_shards, s3_server, slash):
    local, url = remote_shards()
    remote = read_remote_index(url + slash, s3_server.storage_options)
    assert_same_index(remote, read_index(local), url)


def test_the_environment_reaches_the_server(remote_shards, s3_env):
    local, url = remote_shards()
    assert read_remote_index(url).names == read_index(local).names


def test_an_index_over_plain_http(http_server, sharded_reference):
    folder = shutil.copytree(sharded_reference(), os.path.join(http_server.root, "train"))
    url = http_server.url_of("train")
    assert_same_index(read_remote_index(url), read_index(folder), url)


def test_a_missing_index_names_the_url(s3_server):
    url = s3_server.bucket() + "/nothing"
    with pytest.raises(NotFoundError, match=r"nothing/index.json' does not exist.*--resume"):
        read_remote_index(url, s3_server.storage_options)


def test_a_damaged_index_names_the_url(s3_server):
    url = s3_server.bucket() + "/bad"
    fs, path = filesystem(url, s3_server.storage_options)
    fs.pipe_file(path + "/index.json", b"{not json")
    with pytest.raises(FormatError, match=r"bad/index.json' is not valid JSON"):
        read_remote_index(url, s3_server.storage_options)


def test_a_failing_server_gets_our_attempts_only(remote_shards, s3_server, monkeypatch):
    """botocore and s3fs retry on their own; stacked under ours a 503 cost 6 x 25 requests before the error."""
    from fastdata.errors import RemoteError
    from fastdata.measure.throttle import ThrottlingProxy
    from fastdata.storage.retry import RETRY_ATTEMPTS

    monkeypatch.setattr("fastdata.storage.retry.time.sleep", lambda seconds: None)  # our backoff: not the subject
    _, url = remote_shards("hdf5", "raw")
    with ThrottlingProxy(s3_server.endpoint, fail_every=1) as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        with pytest.raises(RemoteError, match="index.json"):
            read_remote_index(url, options)
        assert proxy.requests == RETRY_ATTEMPTS


def test_a_server_nobody_listens_on_is_named_after_our_attempts(s3_server, monkeypatch):
    import socket

    from fastdata.errors import RemoteError

    monkeypatch.setattr("fastdata.storage.retry.time.sleep", lambda seconds: None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: connections are refused
    options = {**s3_server.storage_options, "endpoint_url": f"http://127.0.0.1:{port}"}
    with pytest.raises(RemoteError, match=rf"127\.0\.0\.1:{port}.*Check the network"):
        read_remote_index("s3://bucket/train", options)
