"""Flaky object storage: converts to s3:// and loads from it through a proxy that fails by a seeded rule.

moto's S3 server on loopback behind storage.faults.FaultProxy (503s, bodies
cut short, requests never answered, 403s): transient failures are retried
within the budget of NOTE [retry budget] (fastdata/storage/retry.py), and a
permanent one, or the budget spent, is reported with the URL.
"""

import os
import time

import numpy as np
import pytest
from support import run_cli

from fastdata import convert_imagefolder, open_dataset
from fastdata.errors import RemoteError
from fastdata.measure.synthetic import make_imagefolder
from storage.faults import FaultProxy

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # aiohttp sessions of s3fs closed at exit

SHARD_SIZE = 4 * 3 * 16 * 16 + 100  # 4 images of 16 px a shard: 23 shards of 92 images, as in issue 27
OPTIONS = {"size": 16, "storage": "raw", "format": "hdf5", "shard_size": SHARD_SIZE, "workers": 1, "progress": False}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A private cache root (the conversions' staging folders), also for subprocesses."""
    monkeypatch.setenv("FASTDATA_CACHE", os.fspath(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """92 photos in 4 classes and their local shard folder (23 shards); read-only."""
    root = tmp_path_factory.mktemp("faults")
    make_imagefolder(root / "photos", 4, 23, size=(40, 30), seed=0, vary=True)
    convert_imagefolder(root / "photos", root / "local", **OPTIONS)
    return root / "photos", root / "local"


@pytest.fixture
def flaky(s3_server):
    """A FaultProxy in front of the server failing 1 request in 5 (503 or a cut body); its storage_options."""
    with FaultProxy(s3_server.endpoint, rate=0.2, faults=("503", "cut"), seed=27) as proxy:
        yield proxy, {**s3_server.storage_options, "endpoint_url": proxy.url}


def read_all(path, cache_dir=None, **options):
    """Every sample of the dataset at ``path``, in order: (images uint8 [N, 3, 16, 16], labels int64 [N])."""
    dataset = open_dataset(path, cache_dir=cache_dir, **options)
    images, labels = dataset.read_batch(np.arange(len(dataset)))
    return images.numpy(), labels.numpy()


def assert_same(got, expected):
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])


def test_a_convert_through_one_failure_in_five_finishes_and_reads_back_equal(photos, s3_server, flaky, tmp_path):
    source, local = photos
    proxy, options = flaky
    url = s3_server.bucket() + "/train"
    report = convert_imagefolder(source, url, storage_options=options, **OPTIONS)
    assert report.num_samples == 92 and proxy.served["503"] and proxy.served["cut"]
    failed = sum(proxy.served.values())
    got = read_all(url, tmp_path / "reader", storage_options=options)  # the shards through the faults too
    assert_same(got, read_all(local))
    assert sum(proxy.served.values()) > failed  # reading met faults of its own


def test_resume_through_one_failure_in_five_finishes(photos, s3_server, flaky, tmp_path):
    source, local = photos
    proxy, options = flaky
    url = s3_server.bucket() + "/train"
    convert_imagefolder(source, url, storage_options=options, part=(0, 2), **OPTIONS)  # half the shards, no index
    args = [arg for key, value in options.items() for arg in ("--storage-option", f"{key}={value}")]
    done = run_cli("convert", "imagefolder", source, url, "--resume", "--workers", 1, "--quiet", "--size", 16,
                   "--storage", "raw", "--format", "hdf5", "--shard-size", SHARD_SIZE, *args)
    assert done.exit_code == 0, done.output
    assert proxy.served["503"] and proxy.served["cut"]
    assert_same(read_all(url, tmp_path / "reader", storage_options=s3_server.storage_options), read_all(local))


def test_a_never_answering_endpoint_fails_within_the_stated_bound(photos, s3_server, tmp_path, monkeypatch):
    _, local = photos
    url = s3_server.bucket() + "/train"
    convert_imagefolder(photos[0], url, storage_options=s3_server.storage_options, **OPTIONS)
    monkeypatch.setenv("FASTDATA_TIMEOUT", "1")
    monkeypatch.setenv("FASTDATA_RETRY_SECONDS", "2")
    bound = 2 + 1 + 5  # FASTDATA_RETRY_SECONDS + FASTDATA_TIMEOUT, and 5 s to start the client on a loaded machine
    with FaultProxy(s3_server.endpoint, rate=1.0, faults=("hang",), hang_seconds=60) as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        start = time.monotonic()
        with pytest.raises(RemoteError, match=rf"'{url}/index\.json': \d attempts? failed.*FASTDATA_TIMEOUT=1 s"):
            open_dataset(url, storage_options=options, cache_dir=tmp_path)
        assert time.monotonic() - start < bound and 1 <= proxy.requests <= 3
        proxy.rate = 0.0  # the index answered; then the shards hang
        dataset = open_dataset(url, storage_options=options, cache_dir=tmp_path, prefetch=0)
        proxy.rate = 1.0
        start = time.monotonic()
        with pytest.raises(RemoteError, match=rf"'{url}/shard-00000\.h5': .*FASTDATA_TIMEOUT=1 s"):
            dataset.read_batch([0])
        assert time.monotonic() - start < bound


def test_a_never_answering_http_endpoint_fails_within_the_stated_bound(http_server, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDATA_TIMEOUT", "1")  # given to aiohttp as its connect and read timeouts
    monkeypatch.setenv("FASTDATA_RETRY_SECONDS", "2")
    with FaultProxy(http_server.url, rate=1.0, faults=("hang",), hang_seconds=60) as proxy:
        start = time.monotonic()
        with pytest.raises(RemoteError, match=rf"'{proxy.url}/train/index\.json': .*FASTDATA_TIMEOUT=1 s"):
            open_dataset(proxy.url + "/train", cache_dir=tmp_path)
        assert time.monotonic() - start < 2 + 1 + 5 and 1 <= proxy.requests <= 3


def test_a_permanent_failure_is_not_retried_and_names_the_url(photos, s3_server, tmp_path):
    source, _ = photos
    url = s3_server.bucket() + "/train"
    convert_imagefolder(source, url, storage_options=s3_server.storage_options, **OPTIONS)
    with FaultProxy(s3_server.endpoint, deny=r"shard-00003\.h5") as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        dataset = open_dataset(url, storage_options=options, cache_dir=tmp_path, prefetch=0)
        with pytest.raises(RemoteError, match=rf"'{url}/shard-00003\.h5': PermissionError.*refused"):
            dataset.read_batch(np.arange(len(dataset)))
        assert proxy.served["403"] == 1  # asked once: a refusal is not retried
        other = s3_server.bucket() + "/train"
        with pytest.raises(RemoteError, match=rf"'{other}/shard-00003\.h5': PermissionError.*refused"):
            convert_imagefolder(source, other, storage_options=options, **OPTIONS)
