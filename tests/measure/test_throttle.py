"""The throttling proxy: s3fs reads moto through it; latency, bandwidth and failures act as asked."""

import time
import urllib.error
import urllib.request

import pytest

from fastdata.measure.throttle import ThrottlingProxy

DATA = bytes(range(256)) * 1024  # 256 KiB


def s3fs_through(proxy, s3_server, **options):
    s3fs = pytest.importorskip("s3fs")
    return s3fs.S3FileSystem(endpoint_url=proxy.url, key="testing", secret="testing", skip_instance_cache=True,
                             **options)


@pytest.fixture
def blob(s3_server):
    """The bucket path of DATA on the server, public so that urllib reads it too."""
    path = s3_server.bucket()[len("s3://"):] + "/blob.bin"
    s3_server.client().put_object(Bucket=path.split("/")[0], Key="blob.bin", Body=DATA, ACL="public-read")
    return path


def test_s3fs_reads_writes_and_lists_through_the_proxy(s3_server, blob):
    with ThrottlingProxy(s3_server.endpoint) as proxy:
        fs = s3fs_through(proxy, s3_server)
        assert fs.cat_file(blob) == DATA
        assert fs.cat_file(blob, start=1000, end=3000) == DATA[1000:3000]
        fs.pipe_file(blob + ".copy", DATA[:5000])
        assert fs.cat_file(blob + ".copy") == DATA[:5000]
        assert fs.info(blob)["size"] == len(DATA)
        assert proxy.requests >= 5 and proxy.failed == 0


def test_every_nth_request_fails_with_an_s3_error(s3_server, blob):
    with ThrottlingProxy(s3_server.endpoint, fail_every=2) as proxy:
        url = f"{proxy.url}/{blob}"
        statuses = []
        for _ in range(4):
            try:
                statuses.append(urllib.request.urlopen(url).status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
                assert b"<Code>SlowDown</Code>" in exc.read()
        assert statuses == [200, 503, 200, 503] and proxy.failed == 2


def test_s3fs_retries_through_a_failing_proxy(s3_server, blob):
    with ThrottlingProxy(s3_server.endpoint, fail_every=3) as proxy:
        fs = s3fs_through(proxy, s3_server)
        for _ in range(4):
            assert fs.cat_file(blob) == DATA
        assert proxy.failed >= 1


def test_latency_is_added_to_each_request(s3_server, blob):
    with ThrottlingProxy(s3_server.endpoint, latency=0.2) as proxy:
        url = f"{proxy.url}/{blob}"
        urllib.request.urlopen(url).read()  # warm: moto's first answer is slow
        start = time.perf_counter()
        for _ in range(3):
            urllib.request.urlopen(url).read()
        assert time.perf_counter() - start >= 0.6


def test_bandwidth_caps_response_bodies_across_connections(s3_server, blob):
    import concurrent.futures

    rate = 1 << 20  # 1 MiB/s: four reads of 256 KiB take about 1 s together
    with ThrottlingProxy(s3_server.endpoint, bandwidth=rate) as proxy:
        url = f"{proxy.url}/{blob}"
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(lambda _: urllib.request.urlopen(url).read(), range(4)))
        elapsed = time.perf_counter() - start
    assert all(body == DATA for body in bodies)
    assert 0.8 <= elapsed < 3.0, elapsed


def test_an_upstream_url_must_be_http():
    with pytest.raises(ValueError, match="http://"):
        ThrottlingProxy("s3://bucket")
