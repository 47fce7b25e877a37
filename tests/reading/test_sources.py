"""The shard-source contract (fastdata/reading/sources.py), run on local files and on the cached copies of a URL's."""

import os
import pickle
import shutil
import zlib

import numpy as np
import pytest

from fastdata.errors import FormatError
from fastdata.formats.shards import read_index
from fastdata.reading.sources import CachedShards, LocalShards
from fastdata.reading.store import ShardStore
from fastdata.storage.cache import ShardCache
from fastdata.storage.urls import filesystem, read_remote_index

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # aiohttp sessions of s3fs closed at exit


class SourceContract:
    """What ShardStore asks of a source. Subclasses give ``source(tmp_path) -> (source, index, local folder)``: a
    source over the converter's shard folder of raw images, and that folder on local disk (the reference)."""

    def source(self, tmp_path):
        raise NotImplementedError

    def test_acquire_gives_each_shards_bytes_until_it_is_released(self, tmp_path):
        source, index, folder = self.source(tmp_path)
        for shard, name in enumerate(index.names):
            path = source.acquire(shard)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                assert len(data) == index.sizes[shard]
                assert f"{zlib.crc32(data):08x}" == index.checksums[shard]
                assert data == (folder / name).read_bytes()
            finally:
                source.release(shard)

    def test_fits_counts_bytes_against_its_limit(self, tmp_path):
        source, index, _ = self.source(tmp_path)
        total = int(index.sizes.sum())
        assert source.fits(0)
        assert source.fits(total) == (source.limit is None or total <= source.limit)
        if source.limit is not None:
            assert source.fits(source.limit) and not source.fits(source.limit + 1)

    def test_the_fingerprint_changes_when_a_file_is_replaced(self, tmp_path):
        source, _, _ = self.source(tmp_path)
        path = source.acquire(0)
        try:
            before = source.fingerprint(path)
            assert before[0] == os.path.getsize(path)
            copy = tmp_path / "copy"
            shutil.copyfile(path, copy)
            assert source.fingerprint(copy) != before  # another inode: a rewrite is seen
        finally:
            source.release(0)

    def test_read_file_gives_a_column_file_beside_the_shards(self, tmp_path):
        source, index, folder = self.source(tmp_path)
        assert index.columns, "the converter writes a labels column file beside the shards"
        for entry in index.columns.values():
            assert source.read_file(entry["name"]) == (folder / entry["name"]).read_bytes()

    def test_a_store_on_the_source_reads_the_local_folders_batches(self, tmp_path, packed_read):
        source, index, folder = self.source(tmp_path)
        store = ShardStore(index, packed_read, source=source)
        reference = ShardStore.of_folder(folder, packed_read)
        indices = np.random.default_rng(0).permutation(index.num_samples)[:64]
        shards = np.arange(index.num_shards)
        for got, want in zip(store.columns(shards), reference.columns(shards)):
            assert np.array_equal(got.samples, want.samples) and np.array_equal(got.labels, want.labels)
        assert store.fits_cache(indices) == source.fits(len(np.unique(index.shard_of(indices)))
                                                        * int(index.sizes.max()))
        store.release_idle()

    def test_it_pickles_with_a_store_and_gives_the_same_bytes(self, tmp_path, packed_read):
        source, index, _ = self.source(tmp_path)
        copied = pickle.loads(pickle.dumps(ShardStore(index, packed_read, source=source))).source
        path = copied.acquire(0)
        try:
            assert f"{zlib.crc32(open(path, 'rb').read()):08x}" == index.checksums[0]
        finally:
            copied.release(0)


@pytest.fixture
def packed_read():
    from fastdata.formats.hdf5 import read_hdf5

    return read_hdf5


class TestLocalShards(SourceContract):
    @pytest.fixture(autouse=True)
    def _folder(self, sharded_reference):
        self.folder = sharded_reference("hdf5", "raw")

    def source(self, tmp_path):
        index = read_index(self.folder)
        return LocalShards(index), index, self.folder

    def test_a_missing_column_file_is_named_with_what_to_do(self, tmp_path):
        root = tmp_path / "copy"
        shutil.copytree(self.folder, root)
        index = read_index(root)
        name = next(iter(index.columns.values()))["name"]
        os.remove(root / name)
        with pytest.raises(FormatError, match=f"{name}' is missing.*Restore it, or convert again"):
            LocalShards(index).read_file(name)


class TestCachedShards(SourceContract):
    @pytest.fixture(autouse=True)
    def _folder(self, remote_shards, s3_server):
        self.folder, self.url = remote_shards("hdf5", "raw")
        self.storage_options = s3_server.storage_options

    def source(self, tmp_path, cache_limit=None):
        index = read_remote_index(self.url, self.storage_options)
        fs, _ = filesystem(index.root, self.storage_options)
        limit = cache_limit or int(index.sizes.sum())
        return CachedShards(ShardCache(index, fs, cache_dir=tmp_path / "cache", cache_limit=limit)), index, self.folder

    def test_release_lets_the_copy_be_evicted_again(self, tmp_path):
        source, _, _ = self.source(tmp_path)
        source.acquire(1)
        source.acquire(1)
        assert source.cache.held() == [1]
        source.release(1)
        assert source.cache.held() == [1]  # held twice: released twice
        source.release(1)
        assert source.cache.held() == []

    def test_is_short_once_the_held_copies_leave_no_room_for_the_largest(self, tmp_path):
        index = read_remote_index(self.url, self.storage_options)
        largest = int(index.sizes.max())
        source, _, _ = self.source(tmp_path, cache_limit=2 * largest)
        assert not source.is_short(0)  # an empty cache: shard 0 and the largest fit
        source.acquire(0)
        try:
            assert source.is_short(1)  # shard 1 fetched beside 0: no room left for a third
        finally:
            source.release(0)
