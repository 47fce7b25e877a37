"""Prefetcher, and the cache's bounds as a property, on fsspec's in-memory file system (fast, in-process)."""

import gc
import os
import tempfile
import time
import uuid
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdata.errors import NotFoundError
from fastdata.formats.shards import read_index
from fastdata.storage import filesystem, read_remote_index
from fastdata.storage.cache import ShardCache
from fastdata.storage.prefetch import Prefetcher


class Recording:
    """An fsspec file system's ``cat_file``, recording which files were asked for (and optionally slowed)."""

    def __init__(self, fs, delay=0.0):
        self.fs, self.delay, self.asked = fs, delay, []

    def cat_file(self, path, start=None, end=None):
        self.asked.append(os.path.basename(path))
        time.sleep(self.delay)
        return self.fs.cat_file(path, start=start, end=end)


def in_memory(local):
    """Copy the shard folder ``local`` to a fresh ``memory://`` folder; return its URL."""
    url = f"memory://shards-{uuid.uuid4().hex[:8]}/train"
    fs, path = filesystem(url)
    for name in [*read_index(local).names, "index.json"]:
        fs.pipe_file(f"{path}/{name}", (local / name).read_bytes())
    return url


def memory_cache(local, cache_dir, delay=0.0, **options):
    url = in_memory(local)
    fs = Recording(filesystem(url)[0], delay)
    return ShardCache(read_remote_index(url), fs, cache_dir=cache_dir, **options)


def wait_for(condition, timeout=10):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_prefetcher_keeps_ahead_shards_fetched_and_no_more(sharded_reference, tmp_path):
    cache = memory_cache(sharded_reference(), tmp_path, delay=0.02)
    names = cache.index.names
    with Prefetcher(cache, ahead=2, threads=3) as prefetcher:
        prefetcher.want([3, 1, 3, 0, 4, 2])  # read order; the repeat of 3 is dropped
        wait_for(lambda: prefetcher.fetched() == {3, 1})
        time.sleep(0.1)
        assert sorted(cache.fs.asked) == sorted([names[3], names[1]])
        prefetcher.advance(2)  # reading shard 0: 0 and 4 next
        wait_for(lambda: prefetcher.fetched() == {3, 1, 0, 4})
        time.sleep(0.1)
        assert len(cache.fs.asked) == 4 and all(cache.is_present(shard) for shard in (3, 1, 0, 4))
        prefetcher.advance(10)  # past the end: nothing more
        prefetcher.want([2, 4])  # a new sequence; 4 is present, 2 is fetched
        wait_for(lambda: prefetcher.fetched() == {2, 4})
        assert sorted(cache.fs.asked) == sorted(names[shard] for shard in (3, 1, 0, 4, 2))


def test_a_prefetch_error_is_raised_by_the_readers_fetch(sharded_reference, tmp_path):
    cache = memory_cache(sharded_reference(), tmp_path)
    fs, path = filesystem(cache.index.root)
    fs.rm_file(f"{path}/{cache.index.names[1]}")
    with Prefetcher(cache, ahead=3, threads=2) as prefetcher:
        prefetcher.want([0, 1, 2])
        wait_for(lambda: prefetcher.fetched() == {0, 1, 2})
    asked = len(cache.fs.asked)
    with pytest.raises(NotFoundError, match=r"shard-00001.h5' \(shard 1 of 'memory://"):
        cache.fetch(1)
    assert len(cache.fs.asked) == asked  # the kept error, not a new request
    with pytest.raises(NotFoundError):
        cache.fetch(1)  # and, asked again, the storage's own answer
    assert cache.fetch(0) and cache.fetch(2)


def test_ahead_zero_fetches_nothing(sharded_reference, tmp_path):
    cache = memory_cache(sharded_reference(), tmp_path)
    with Prefetcher(cache, ahead=0, threads=1) as prefetcher:
        prefetcher.want(range(cache.index.num_shards))
        time.sleep(0.1)
    assert cache.fs.asked == []


def test_close_and_collection_stop_the_threads(sharded_reference, tmp_path):
    cache = memory_cache(sharded_reference(), tmp_path)
    prefetcher = Prefetcher(cache, ahead=2, threads=2)
    threads = list(prefetcher._threads)
    prefetcher.close()
    assert not any(thread.is_alive() for thread in threads)
    prefetcher.close()  # again: nothing
    prefetcher = Prefetcher(cache, ahead=2, threads=2)
    prefetcher.want([0, 1])
    threads = list(prefetcher._threads)
    del prefetcher
    gc.collect()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads)


# ---------------------------------------------------------------- the cache's bounds, as a property


OPS = st.lists(st.tuples(st.sampled_from(["fetch", "hold", "release"]), st.integers(0, 1), st.integers(0, 4)),
               min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, slots=st.integers(1, 3))
def test_any_fetch_hold_release_sequence_keeps_the_bounds(sharded_reference, ops, slots):
    """Two caches of one folder (as two processes): a held shard is never deleted; a download leaves the folder
    within the limit, or holding only held shards and the one fetched (the one-shard overshoot); anything else
    never adds bytes."""
    local = sharded_reference()
    sizes = read_index(local).sizes
    with tempfile.TemporaryDirectory() as cache_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # over the limit when everything is held
        first = memory_cache(local, cache_dir, cache_limit=slots * int(sizes.max()), wait_seconds=0)
        caches = [first, ShardCache(first.index, first.fs, cache_dir=cache_dir, cache_limit=first.cache_limit,
                                    wait_seconds=0)]
        holds = [[], []]
        for op, who, shard in ops:
            cache = caches[who]
            if op == "release":
                if shard in holds[who]:
                    holds[who].remove(shard)
                cache.release(shard)
                continue
            held = {s for hold in holds for s in hold} - {shard}
            downloads, before = not first.is_present(shard), first.used_bytes()
            (cache.fetch if op == "fetch" else cache.hold)(shard)
            if op == "hold":
                holds[who].append(shard)
            assert all(first.is_present(s) for hold in holds for s in hold)
            if downloads:
                assert first.used_bytes() <= max(first.cache_limit, sum(int(sizes[s]) for s in held) + sizes[shard])
            else:
                assert first.used_bytes() <= before
            present = [first.index.names[s] for s in range(len(sizes)) if first.is_present(s)]
            assert sorted(os.listdir(first.folder)) == sorted(  # a record (.ok) beside each shard: no more
                [name for name in os.listdir(first.folder) if name.endswith(".lock")]
                + present + [f".{name}.ok" for name in present])
        for who, hold in enumerate(holds):
            for shard in hold:
                caches[who].release(shard)
