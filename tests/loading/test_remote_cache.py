"""The shard cache under real use: shards changed in it between runs, and small limits shared by readers.

NOTE [verified shards] in fastdata/storage/cachefolder.py and NOTE [no waiting on readers] in
fastdata/storage/cache.py.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.errors import FormatError
from fastdata.measure.synthetic import make_imagefolder

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # aiohttp sessions of s3fs closed at exit

SAMPLES_PER_SHARD = 16


class NoWaiting:
    """The cache module's ``time``, whose ``sleep`` fails: any fetch that polls for room raises (workers fork it)."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def sleep(seconds):
        raise AssertionError(f"a fetch waited for room in the cache (a poll of {seconds} s)")


_EPOCH = """
import hashlib, json, sys
import numpy as np
import fastdata.storage.cache
from fastdata import make_loader, open_dataset
sys.path.insert(0, sys.argv.pop())  # this test module, for NoWaiting
from test_remote_cache import NoWaiting
fastdata.storage.cache.time = NoWaiting
url, options, cache_dir, limit, workers = sys.argv[1:]
dataset = open_dataset(url, storage_options=json.loads(options), cache_dir=cache_dir, cache_limit=int(limit))
digests = []
for images, labels in make_loader(dataset, 32, shuffle=True, num_workers=int(workers)):
    digests += [hashlib.sha256(image.numpy().tobytes()).hexdigest()[:16] for image in images]
print(json.dumps({"digests": sorted(digests), "over_limit": dataset._store.source.cache.over_limit()}))
"""


@pytest.fixture(scope="module")
def photos(s3_server, tmp_path_factory):
    """``(local folder, URL)``: 300 photos of 32 px in 19 shards of 16 (equal sizes but the last); read-only."""
    from storage.servers import upload

    root = tmp_path_factory.mktemp("cache-photos")
    make_imagefolder(root / "photos", 4, 75, size=(40, 30), seed=0)
    convert_imagefolder(root / "photos", root / "local", size=32, storage="raw", format="hdf5",
                        shard_size=SAMPLES_PER_SHARD * 3 * 32 * 32, workers=1, progress=False)
    return root / "local", upload(root / "local", s3_server.bucket() + "/train", s3_server.storage_options)


def read_all(dataset):
    images, labels = dataset.read_batch(np.arange(len(dataset)))
    return images.numpy(), labels.numpy()


def digests_of(dataset):
    """Sorted digests of every sample's pixels: an epoch in any order reads each sample once iff they are equal."""
    return sorted(hashlib.sha256(image.tobytes()).hexdigest()[:16] for image in read_all(dataset)[0])


def cache_of(dataset):
    return dataset._store.source.cache


def largest_shard(local):
    return max(os.path.getsize(path) for path in open_dataset(local).shard_paths)


# ---------------------------------------------------------------- changed between runs


def corrupt_in_place(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # the last samples of the shard's pixels, as a bad disk or a stray write would
        f.seek(size - 3000)
        f.write(b"\xff" * 2000)


def replace_by(path, other):
    data = open(other, "rb").read()
    assert len(data) == os.path.getsize(path)
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


@pytest.mark.parametrize("change", ["corrupted in place", "replaced by another shard"])
def test_a_cached_shard_changed_between_runs_is_fetched_again(photos, s3_server, tmp_path, change):
    local_root, url = photos
    expected = read_all(open_dataset(local_root))
    first = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(read_all(first), expected))
    cache = cache_of(first)
    if change == "corrupted in place":
        corrupt_in_place(cache.path(1))
    else:
        replace_by(cache.path(1), cache.path(2))
    second = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path)  # a new run
    assert all(np.array_equal(a, b) for a, b in zip(read_all(second), expected))
    assert cache_of(second).rechecked() == 1  # shard 1 alone was read back, and fetched again
    assert open(cache.path(1), "rb").read() == open(os.path.join(local_root, first._store.index.names[1]), "rb").read()
    third = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path)
    read_all(third)
    assert cache_of(third).rechecked() == 0  # verified again: no more reading back


def test_a_changed_shard_that_cannot_be_fetched_again_is_refused_by_name(photos, s3_server, tmp_path):
    from storage.servers import upload

    local_root, _ = photos
    url = upload(local_root, s3_server.bucket() + "/train", s3_server.storage_options)
    first = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path)
    read_all(first)
    cache = cache_of(first)
    corrupt_in_place(cache.path(1))
    cache.fs.pipe_file(cache.url(1).removeprefix("s3://"), open(cache.path(2), "rb").read())  # the server's copy too
    second = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path)
    with pytest.raises(FormatError, match=rf"'{cache.url(1)}' \(shard 1\) has .* the remote copy is damaged"):
        read_all(second)
    assert not os.path.exists(cache.path(1))  # the damaged copy is not kept


# ---------------------------------------------------------------- small limits shared by readers


def test_a_three_shard_cache_read_by_two_workers_reads_each_sample_once_without_waiting(photos, s3_server, tmp_path,
                                                                                      capfd, monkeypatch):
    monkeypatch.setattr("fastdata.storage.cache.time", NoWaiting)
    local_root, url = photos
    expected = digests_of(open_dataset(local_root))
    limit = 3 * largest_shard(local_root)
    dataset = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path, cache_limit=limit)
    loader = make_loader(dataset, 32, shuffle=True, num_workers=2)
    for epoch in range(2):
        digests = sorted(hashlib.sha256(image.numpy().tobytes()).hexdigest()[:16]
                         for images, _ in loader for image in images)
        assert digests == expected, f"epoch {epoch}"
    assert "held by readers" not in capfd.readouterr().err  # no fetch waited for room (warnings raise here)
    assert cache_of(dataset).used_bytes() <= limit + 2 * 3 * largest_shard(local_root)


def test_two_processes_sharing_a_small_cache_read_each_sample_once_without_waiting(photos, s3_server, tmp_path):
    local_root, url = photos
    expected = digests_of(open_dataset(local_root))
    limit = 3 * largest_shard(local_root)
    args = [url, json.dumps(s3_server.storage_options), os.fspath(tmp_path), str(limit)]
    here = os.path.dirname(__file__)
    children = [subprocess.Popen([sys.executable, "-W", "error::RuntimeWarning", "-c", _EPOCH, *args, workers, here],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for workers in ("0", "2")]
    try:
        for child in children:
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, err
            assert json.loads(out)["digests"] == expected
            assert "held by readers" not in err and "waited for room" not in err
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()


def test_loader_batches_equal_the_local_folder_through_a_small_cache(photos, s3_server, tmp_path):
    local_root, url = photos
    limit = 2 * largest_shard(local_root)
    remote = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path, cache_limit=limit)
    local = open_dataset(local_root)
    order = make_loader(remote, 32, shuffle=True).sampler.describe()
    twin = make_loader(local, 32, shuffle="block", block_size=order["block_size"], window=order["window"])
    for a, b in zip(make_loader(remote, 32, shuffle=True), twin, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_cached_shard_written_over_under_its_reader_is_reported(photos, s3_server, tmp_path):
    _, url = photos
    dataset = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path, prefetch=0)
    dataset.read_batch([SAMPLES_PER_SHARD + 4])  # shard 1 open, its copy held
    dataset._store.recheck_seconds = 0.0  # compared at every batch, not once a second
    corrupt_in_place(cache_of(dataset).path(1))
    with pytest.raises(FormatError, match=r"shard-00001\.h5' was modified after this dataset was opened"):
        dataset.read_batch([SAMPLES_PER_SHARD + 4])
