"""ShardCache against moto's S3 (through a ThrottlingProxy where requests are counted or slowed).

Processes sharing one cache are ``fetcher.py`` subprocesses given the cache pickled.
"""

import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import time

import pytest

from fastdata.errors import FormatError, NotFoundError, OptionError
from fastdata.formats.shards import read_index
from fastdata.measure.throttle import ThrottlingProxy
from fastdata.storage import filesystem, read_remote_index
from fastdata.storage.cache import ShardCache, cache_key, cache_root
from fastdata.storage.cachefolder import boot_id

FETCHER = pathlib.Path(__file__).with_name("fetcher.py")


def s3_cache(url, endpoint, cache_dir, **options):
    """A ShardCache of ``url`` reached through ``endpoint`` (the server, or a proxy in front of it)."""
    storage_options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    index = read_remote_index(url, storage_options)
    return ShardCache(index, filesystem(url, storage_options)[0], cache_dir=cache_dir, **options)


def largest_shard_of(local):
    return int(read_index(local).sizes.max())


def largest_shard(remote_shards):
    return largest_shard_of(remote_shards()[0])


def partials(cache):
    return [name for name in os.listdir(cache.folder) if name.endswith(".partial")]


def shard_files(cache):
    return sorted(name for name in os.listdir(cache.folder) if name in cache.index.names)


def folder_bytes(cache):
    """The bytes of every file in the cache folder, however they got there, but locks and records (~100 bytes)."""
    return sum(entry.stat().st_size for entry in os.scandir(cache.folder) if not entry.name.endswith((".lock", ".ok")))


def start_fetcher(cache, tmp_path, mode, shards, **popen):
    """Start ``fetcher.py`` on ``cache`` pickled; return the Popen."""
    path = tmp_path / f"cache-{time.monotonic_ns()}.pickle"
    path.write_bytes(pickle.dumps(cache))
    return subprocess.Popen([sys.executable, str(FETCHER), str(path), mode, ",".join(map(str, shards))],
                            stdout=subprocess.PIPE, text=True, **popen)


@pytest.fixture
def own_shards(s3_server, sharded_reference):
    """``(local folder, url)``: the hdf5 raw shards in a bucket of this test's own, to damage."""
    from storage.servers import upload

    local = sharded_reference()
    return local, upload(local, s3_server.bucket() + "/train", s3_server.storage_options)


def test_fetch_returns_the_remote_bytes_under_the_index_names(remote_shards, s3_server, tmp_path):
    local, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    assert cache.folder == os.path.join(tmp_path, cache_key(cache.index))
    for shard, name in enumerate(cache.index.names):
        path = cache.fetch(shard)
        assert path == os.path.join(cache.folder, name)
        assert pathlib.Path(path).read_bytes() == (local / name).read_bytes()
    assert not partials(cache)


def test_a_present_shard_is_not_requested_again(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    with ThrottlingProxy(s3_server.endpoint) as proxy:
        cache = s3_cache(url, proxy.url, tmp_path)
        index_requests = proxy.requests  # s3fs: a HEAD and a GET
        cache.fetch(2)
        assert proxy.requests == index_requests + 1  # one ranged GET a shard
        cache.fetch(2)
        s3_cache(url, proxy.url, tmp_path).fetch(2)  # another cache object of the same folder
        assert proxy.requests == 2 * index_requests + 1  # the index, read again; no shard


def test_the_folder_is_keyed_by_url_and_shards(remote_shards, s3_server, tmp_path, monkeypatch):
    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    other = read_remote_index(url, s3_server.storage_options)
    changed = type(other)(**{**other.__dict__, "checksums": ["00000000", *other.checksums[1:]]})
    assert cache_key(changed) != cache_key(cache.index)
    moved = type(other)(**{**other.__dict__, "root": "s3://elsewhere/train"})
    assert cache_key(moved) != cache_key(cache.index)
    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "env"))
    assert cache_root() == str(tmp_path / "env")
    monkeypatch.delenv("FASTDATA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "fastdata")
    assert cache_root(tmp_path / "given") == str(tmp_path / "given")


def test_a_limit_below_the_largest_shard_is_refused(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    largest = largest_shard(remote_shards)
    with pytest.raises(OptionError, match=f"cache_limit should be at least the largest shard \\({largest:,} bytes"):
        s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=largest - 1)
    assert s3_cache(url, s3_server.endpoint, tmp_path).cache_limit >= 2 * largest  # default: half the free space


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_the_limit_holds_within_one_shard_fetching_every_shard_in_turn(remote_shards, s3_server, tmp_path, slots):
    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=slots * largest_shard(remote_shards))
    for shard in [*range(cache.index.num_shards), 0, 3, 1]:
        assert os.path.getsize(cache.fetch(shard)) == cache.index.sizes[shard]
        assert folder_bytes(cache) <= cache.cache_limit
        assert cache.used_bytes() == folder_bytes(cache)
    assert len(shard_files(cache)) == slots


def test_held_shards_are_never_evicted(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=2 * largest_shard(remote_shards))
    held = cache.hold(0)
    assert cache.hold(0) == held and cache.held() == [0]
    for shard in range(1, cache.index.num_shards):
        cache.fetch(shard)
        assert os.path.exists(held)
    cache.release(0)
    assert os.path.exists(held)  # released: evictable, not evicted yet
    cache.fetch(1)
    cache.fetch(2)  # shard 0 is now the least recently used unheld one... once both holds are released
    assert os.path.exists(held)
    cache.release(0)
    cache.fetch(3)
    cache.fetch(4)
    assert not os.path.exists(held) and cache.held() == []


def test_a_fetch_without_wait_asks_the_holder_for_room_once(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=2 * largest_shard(remote_shards))
    cache.hold(0), cache.hold(1)
    asked = []
    assert cache.fetch(2, wait=False) is None  # full of held shards, nobody to ask
    cache.on_full = lambda: asked.append(len(asked))  # a holder that keeps its shards
    assert cache.fetch(2, wait=False) is None and asked == [0]
    cache.on_full = lambda: cache.release(1)  # one that lets one go (as a reader closes an idle shard)
    assert cache.fetch(2, wait=False) == cache.path(2) and cache.held() == [0]
    assert sorted(shard_files(cache)) == sorted(cache.index.names[shard] for shard in (0, 2))


def test_two_processes_download_each_shard_once(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    with ThrottlingProxy(s3_server.endpoint, latency=0.05) as proxy:
        cache = s3_cache(url, proxy.url, tmp_path)
        before = proxy.requests
        shards = list(range(cache.index.num_shards))
        children = [start_fetcher(cache, tmp_path, "fetch", shards) for _ in range(2)]
        outputs = [child.communicate(timeout=60)[0].split() for child in children]
        assert [child.returncode for child in children] == [0, 0]
        assert outputs[0] == outputs[1] == [cache.path(shard) for shard in shards]
        assert proxy.requests - before == len(shards)
    assert shard_files(cache) == sorted(cache.index.names) and not partials(cache)


def test_a_corrupted_remote_shard_is_refused_and_not_kept(own_shards, s3_server, tmp_path):
    local, url = own_shards
    fs, path = filesystem(url, s3_server.storage_options)
    data = bytearray((local / "shard-00002.h5").read_bytes())
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path + "/shard-00002.h5", bytes(data))
    with ThrottlingProxy(s3_server.endpoint) as proxy:
        cache = s3_cache(url, proxy.url, tmp_path)
        before = proxy.requests
        with pytest.raises(FormatError, match=r"shard-00002.h5' \(shard 2\) .* the remote copy is damaged; convert "
                                              "again or restore it"):
            cache.fetch(2)
        assert proxy.requests - before == 2  # downloaded once more before giving up
    assert not shard_files(cache) and not partials(cache)
    assert cache.fetch(1)  # the others are fine


@pytest.mark.parametrize("chunk", [None, 4096])
def test_a_remote_shard_of_the_wrong_size_is_refused(own_shards, s3_server, tmp_path, monkeypatch, chunk):
    import fastdata.storage.cache as cache_module

    if chunk:
        monkeypatch.setattr(cache_module, "CHUNK_BYTES", chunk)  # ranged requests
    local, url = own_shards
    fs, path = filesystem(url, s3_server.storage_options)
    data = (local / "shard-00001.h5").read_bytes()
    fs.pipe_file(path + "/shard-00001.h5", data + b"more")
    fs.pipe_file(path + "/shard-00002.h5", data[:-100])
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    with pytest.raises(FormatError, match=r"\(shard 1\) has more than 24,968 bytes"):
        cache.fetch(1)
    with pytest.raises(FormatError, match=r"\(shard 2\) has 24,868 bytes"):
        cache.fetch(2)
    assert not shard_files(cache) and not partials(cache)


def test_a_missing_remote_shard_is_named(own_shards, s3_server, tmp_path):
    _, url = own_shards
    fs, path = filesystem(url, s3_server.storage_options)
    fs.rm_file(path + "/shard-00003.h5")
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    with pytest.raises(NotFoundError, match=r"shard-00003.h5' \(shard 3 of 's3://.*/train'\) does not exist"):
        cache.fetch(3)
    assert not shard_files(cache) and not partials(cache)


@pytest.mark.parametrize("chunk", [None, 4096, 3121])  # 3121: 8 chunks make a 24,968-byte shard exactly
def test_a_server_failing_one_request_in_five_is_ridden_out(remote_shards, s3_server, tmp_path, monkeypatch, chunk):
    import fastdata.storage.cache as cache_module

    if chunk:
        monkeypatch.setattr(cache_module, "CHUNK_BYTES", chunk)  # about 7 ranged requests a shard
    local, url = remote_shards()
    with ThrottlingProxy(s3_server.endpoint, fail_every=5) as proxy:
        cache = s3_cache(url, proxy.url, tmp_path)
        paths = cache.fetch_many(range(cache.index.num_shards), threads=3)
        assert proxy.failed >= 1
    for path in paths:
        assert pathlib.Path(path).read_bytes() == (local / os.path.basename(path)).read_bytes()


@pytest.mark.parametrize(("status", "transient"), [(503, True), (500, True), (403, False)])
def test_what_s3fs_raises_for_a_failed_request_is_classified(s3_server, remote_shards, status, transient):
    """s3fs's own retries off: the error it raises for each status, as the cache's retries see it."""
    from fastdata.storage import is_transient

    _, url = remote_shards()
    with ThrottlingProxy(s3_server.endpoint, fail_every=1, fail_status=status) as proxy:
        fs, path = filesystem(url, {"endpoint_url": proxy.url, "key": "testing", "secret": "testing",
                                    "skip_instance_cache": True, "config_kwargs": {"retries": {"max_attempts": 1}}})
        fs.retries = 1
        with pytest.raises(Exception) as caught:
            fs.cat_file(path + "/index.json")
    assert is_transient(caught.value) == transient, repr(caught.value)


def test_a_download_killed_midway_leaves_nothing_in_the_way(remote_shards, s3_server, tmp_path):
    local, url = remote_shards()
    with ThrottlingProxy(s3_server.endpoint, bandwidth=8000) as proxy:  # 25 kB shard: about 3 s
        cache = s3_cache(url, proxy.url, tmp_path)
        child = start_fetcher(cache, tmp_path, "fetch", [0])
        try:
            deadline = time.monotonic() + 20
            while not partials(cache):
                assert time.monotonic() < deadline and child.poll() is None
                time.sleep(0.02)
            time.sleep(0.5)  # mid-download
            assert child.poll() is None
        finally:
            child.kill()
            child.communicate()
        assert partials(cache)  # left by the killed process
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    rerun = start_fetcher(cache, tmp_path, "fetch", [0, 1])
    assert rerun.communicate(timeout=30)[0].split() == [cache.path(0), cache.path(1)]
    assert not partials(cache)
    assert pathlib.Path(cache.path(0)).read_bytes() == (local / "shard-00000.h5").read_bytes()


def test_a_tiny_limit_held_by_two_processes_still_progresses(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=2 * largest_shard(remote_shards),
                     wait_seconds=0.5)
    holders = [start_fetcher(cache, tmp_path, "hold", [shard], stdin=subprocess.PIPE) for shard in (0, 1)]
    try:
        assert [holder.stdout.readline() for holder in holders] == ["held\n", "held\n"]
        calls = []
        cache.on_full = lambda: calls.append(1)
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"cache_limit=49,936 bytes, 2 shards, all held by readers"):
            cache.fetch(2)
        assert 0.5 <= time.monotonic() - start < 10 and calls
        assert shard_files(cache) == sorted(cache.index.names[:3])  # over by one shard
    finally:
        for holder in holders:
            holder.communicate(timeout=30)  # closes stdin: the holder releases and exits
    cache.fetch(3)  # released: back within the limit
    assert folder_bytes(cache) <= cache.cache_limit


def test_the_cache_pickles_without_its_holds(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    cache.hold(1)
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.held() == [] and cache.held() == [1] and clone.folder == cache.folder
    assert clone.fetch(1) == cache.path(1)
    cache.release(1)


def test_shards_over_plain_http(http_server, sharded_reference, tmp_path):
    local = sharded_reference()
    shutil.copytree(local, tmp_path / "train")
    url = http_server.url_of("train")
    index = read_remote_index(url)
    cache = ShardCache(index, filesystem(url)[0], cache_dir=tmp_path / "cache")
    for shard, path in enumerate(cache.fetch_many(range(index.num_shards), threads=2)):
        assert pathlib.Path(path).read_bytes() == (local / index.names[shard]).read_bytes()
    assert len(shard_files(cache)) == index.num_shards


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_keeps_none_of_the_parents_locks(remote_shards, s3_server, tmp_path):
    """A DataLoader worker forked while the main process holds a shard or downloads one (see NOTE
    [locks across fork]): once the parent lets go, other processes may evict and fetch."""
    import fcntl
    import multiprocessing

    _, url = remote_shards()
    cache = s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=2 * largest_shard(remote_shards))
    cache.hold(0)
    with cache._locked(".shard-00003.h5.lock"):
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
    try:
        cache.release(0)
        cache.fetch(1)
        cache.fetch(2)
        assert not cache.is_present(0)  # evicted: the child's copy of the hold went with the fork
        with cache._locked(".shard-00003.h5.lock", fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
            assert taken
    finally:
        child.kill()
        child.join()


def pretend_a_reboot(cache):
    """Make ``cache``'s folder look written in another boot, as after a crash (see NOTE [unsynced shards])."""
    with open(os.path.join(cache.folder, ".room.lock"), "r+b") as f:
        assert f.read() == boot_id().encode(), "the folder records the boot it was filled in"
        f.seek(0)
        f.write(b"0" * len(boot_id()))


def unverified(cache):
    return sorted(name for name in os.listdir(cache.folder) if name.endswith(".unverified"))


@pytest.mark.skipif(boot_id() is None, reason="the system does not say its boot id")
def test_shards_from_an_earlier_boot_are_checked_before_use_and_a_damaged_one_fetched_again(own_shards, s3_server,
                                                                                           tmp_path):
    local, url = own_shards
    filled = s3_cache(url, s3_server.endpoint, tmp_path)
    for shard in range(filled.index.num_shards):
        filled.fetch(shard)
    damaged = filled.path(1)
    with open(damaged, "r+b") as f:  # same size: what a crash can leave under a complete name
        f.seek(100)
        f.write(bytes(255 - b for b in f.read(64)))
    pretend_a_reboot(filled)
    with ThrottlingProxy(s3_server.endpoint) as proxy:
        cache = s3_cache(url, proxy.url, tmp_path)
        index_requests = proxy.requests
        assert not shard_files(cache) and len(unverified(cache)) == cache.index.num_shards
        assert cache.used_bytes() == folder_bytes(cache) == sum(cache.index.sizes)
        assert not cache.is_present(0)
        for shard, name in enumerate(cache.index.names):
            assert pathlib.Path(cache.fetch(shard)).read_bytes() == (local / name).read_bytes()
        assert proxy.requests == index_requests + 1, "only the damaged shard is downloaded again"
    assert shard_files(cache) == sorted(cache.index.names) and not unverified(cache)
    s3_cache(url, s3_server.endpoint, tmp_path)  # the same boot: nothing to check again
    assert shard_files(cache) == sorted(cache.index.names)


@pytest.mark.skipif(boot_id() is None, reason="the system does not say its boot id")
def test_shards_from_an_earlier_boot_are_evicted_to_make_room(remote_shards, s3_server, tmp_path):
    _, url = remote_shards()
    filled = s3_cache(url, s3_server.endpoint, tmp_path)
    for shard in range(filled.index.num_shards):
        filled.fetch(shard)
    pretend_a_reboot(filled)
    cache = s3_cache(url, s3_server.endpoint, tmp_path, cache_limit=2 * largest_shard(remote_shards))
    os.unlink(os.path.join(cache.folder, f".{cache.index.names[3]}.unverified"))
    cache.fetch(3)  # downloaded: room made by evicting the unverified copies
    assert folder_bytes(cache) <= cache.cache_limit
    assert shard_files(cache) == [cache.index.names[3]] and len(unverified(cache)) <= 1


def test_without_a_boot_id_every_download_is_synced(remote_shards, s3_server, tmp_path, monkeypatch):
    import fastdata.storage.cache as cache_module
    import fastdata.storage.cachefolder as folder_module

    _, url = remote_shards()
    synced = []
    monkeypatch.setattr(folder_module, "_BOOT_ID", str(tmp_path / "no-such-file"))
    monkeypatch.setattr(cache_module.os, "fsync", lambda fd: synced.append(fd))
    cache = s3_cache(url, s3_server.endpoint, tmp_path)
    cache.fetch(0)
    assert len(synced) >= 2, "the shard's file and its folder"
    monkeypatch.undo()
    synced.clear()
    monkeypatch.setattr(cache_module.os, "fsync", lambda fd: synced.append(fd))
    s3_cache(url, s3_server.endpoint, tmp_path).fetch(1)
    assert not synced, "with this boot's id recorded, a download is not synced"
