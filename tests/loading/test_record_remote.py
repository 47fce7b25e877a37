"""A shard folder of records at a URL (a real S3 protocol server on loopback): read as the local folder is."""

import numpy as np
import pytest
from support import assert_same_batches, wait_for

from fastdata import Field, make_loader, open_dataset, write
from fastdata.formats.shards import read_index
from fastdata.reading.remote import ShardReadAhead

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
    assert len(remote) == 300 and remote.fingerprint == here.fingerprint and remote.is_remote
    order = np.random.default_rng(0).permutation(300)
    assert_same_batches(remote.read_batch(order), here.read_batch(order))
    loader = make_loader(remote, 32, shuffle=True, seed=1, num_workers=2)
    described = loader.sampler.describe()
    assert described["shuffle"] == "block" and described["window"] == 1  # two windows of a shard fit the cache
    try:
        remote_batches = list(loader)
    finally:
        loader.close()
    twin = make_loader(here, 32, shuffle="block", block_size=described["block_size"], window=1, seed=1)
    for a, b in zip(remote_batches, twin, strict=True):
        assert_same_batches(a, b)
    cached = sum(path.stat().st_size for path in (tmp_path / "cache").rglob("shard-*"))
    assert cached <= limit + index.sizes.max()  # the cache stayed within its limit (one shard over at most)


def test_a_loader_fetches_the_shards_its_order_reads_next_before_they_are_read(remote_records, s3_server, tmp_path):
    local, url = remote_records
    index = read_index(local)
    remote = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "cache",
                          cache_limit=int(6 * index.sizes.max()))
    loader = make_loader(remote, 8, shuffle=True, seed=3)
    described = loader.sampler.describe()
    assert described["shuffle"] == "block" and described["window"] == 3
    assert isinstance(loader.steps.readahead, ShardReadAhead) and loader.steps.readahead.ahead == 3
    cache = remote.shard_source.cache
    batches = iter(loader)
    first = next(batches)
    blocks = loader.sampler.order.block_ranges(0)
    window = set(index.shard_of(blocks[:3, 0]).tolist())  # the first window's shards (a block is a shard)
    assert set(index.shard_of(first["id"].numpy()).tolist()) <= window
    wait_for(lambda: {shard for shard in range(index.num_shards) if cache.is_present(shard)} - window,
             "shards of the second window fetched while the first is read")
    ids = [first["id"].tolist()] + [batch["id"].tolist() for batch in batches]
    twin = make_loader(open_dataset(local), 8, shuffle="block", block_size=described["block_size"], window=3, seed=3)
    assert ids == [batch["id"].tolist() for batch in twin]
    assert sorted(sum(ids, [])) == list(range(300))


def test_sequences_of_a_tokens_field_at_a_url_fetch_ahead_and_equal_the_local_folders(s3_server, tmp_path):
    # NOTE [remote sequences]: a record file's tokens field is cut and fetched as a text file's documents are
    from storage.servers import upload

    rng = np.random.default_rng(4)
    documents = [rng.integers(3, 500, int(rng.choice([1, 9, 60, 300]))).tolist() for _ in range(200)]
    local = tmp_path / "docs"
    write([{"tokens": document} for document in documents], local, {"tokens": Field("tokens", dtype="uint16")},
          shard_size=8_000)
    url = upload(local, s3_server.bucket() + "/docs", s3_server.storage_options)
    remote = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "cache",
                          cache_limit=int(6 * read_index(local).sizes.max()), fields=["tokens"])
    loader = make_loader(remote, 4, shuffle=True, seed=6, seq_len=32, eod=2, tokens_only=True)
    described = loader.sampler.describe()
    assert loader.dataset.is_remote and described["shuffle"] == "block"
    assert isinstance(loader.steps.readahead, ShardReadAhead)
    twin = make_loader(open_dataset(local, fields=["tokens"]), 4, shuffle="block", seed=6, seq_len=32, eod=2,
                       tokens_only=True, block_size=described["block_size"], window=described["window"])
    stream = np.concatenate([np.append(document, 2) for document in documents])
    rows = 0
    for a, b in zip(loader, twin, strict=True):
        assert np.array_equal(a["tokens"].numpy(), b["tokens"].numpy())
        rows += len(a["tokens"])
    assert rows == (len(stream) - 1) // 32
