"""A shard folder of records at a URL (a real S3 protocol server on loopback): read as the local folder is."""

import numpy as np
import pytest
from support import assert_same_batches

from fastdata import Field, OptionError, make_loader, open_dataset, write
from fastdata.formats.shards import read_index

SCHEMA = {"id": "int", "caption": "str", "image": Field("image", size=(12, 16), storage="jpeg"),
          "boxes": Field("ragged", shape=(4,), boxes="image")}


@pytest.fixture
def remote_records(s3_server, tmp_path):
    """``(local folder, its URL)``: 300 records in about 10 shards, uploaded to a fresh bucket."""
    from storage.servers import upload

    rng = np.random.default_rng(2)
    records = [{"id": index, "caption": f"caption {index} ü", "image": rng.integers(0, 256, (12, 16, 3), np.uint8),
                "boxes": rng.random((index % 3, 4)).astype(np.float32) * 10} for index in range(300)]
    local = tmp_path / "local"
    write(records, local, SCHEMA, shard_size=6_000)
    return local, upload(local, s3_server.bucket() + "/records", s3_server.storage_options)


def test_a_folder_at_a_url_reads_as_the_local_one_in_a_cache_of_two_shards(remote_records, s3_server, tmp_path):
    local, url = remote_records
    index = read_index(local)
    assert index.num_shards > 8  # more shards than a process keeps mapped
    limit = int(2 * index.sizes.max())
    remote = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "cache",
                          cache_limit=limit)
    here = open_dataset(local)
    assert len(remote) == 300 and remote.fingerprint == here.fingerprint
    order = np.random.default_rng(0).permutation(300)
    assert_same_batches(remote.read_batch(order), here.read_batch(order))
    loader = make_loader(remote, 32, shuffle=True, seed=1, num_workers=2)
    try:
        remote_batches = list(loader)
    finally:
        loader.close()
    for a, b in zip(remote_batches, make_loader(here, 32, shuffle=True, seed=1), strict=True):
        assert_same_batches(a, b)
    cached = sum(path.stat().st_size for path in (tmp_path / "cache").rglob("shard-*"))
    assert cached <= limit + index.sizes.max()  # the cache stayed within its limit (one shard over at most)


def test_a_url_folder_refuses_prefetch_it_does_not_do(remote_records, s3_server):
    _, url = remote_records
    with pytest.raises(OptionError, match="fetches each shard on first touch, none ahead yet"):
        open_dataset(url, storage_options=s3_server.storage_options, prefetch=2)
