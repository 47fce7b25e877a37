"""fastdata.measure.pagecache on real files: disk counters, sequential reads, a memory cgroup bounding the cache."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdata.measure.pagecache import (
    CgroupError,
    MemoryCgroup,
    ReadCounter,
    cgroup_problem,
    device_of,
    disk_read_bytes,
    random_read,
    sequential_read,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks.machine: page residency by mincore
from benchmarks.machine import page_residency  # noqa: E402

MB = 1 << 20
no_cgroup = pytest.mark.skipif(cgroup_problem() is not None, reason=f"no memory cgroup: {cgroup_problem()}")


def write_file(path, size):
    """Write ``size`` random bytes (nothing the disk could compress) to ``path``, flushed and evicted."""
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    evict(path)
    return str(path)


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_sequential_read_reads_every_file_in_order_and_stops_at_max_bytes(tmp_path):
    paths = [write_file(tmp_path / f"{k}.bin", size) for k, size in enumerate((5 * MB + 3, 1, 2 * MB))]
    done, seconds = sequential_read(paths)
    assert done == 7 * MB + 4 and seconds > 0
    done, _ = sequential_read(paths, max_bytes=4 * MB)
    assert done == 4 * MB  # whole 4 MiB reads: stops at the first read that reaches it


def test_a_cold_read_shows_in_the_disk_and_process_counters_and_a_warm_one_does_not(tmp_path):
    path = write_file(tmp_path / "data.bin", 16 * MB)
    counter = ReadCounter(path).start()
    sequential_read([path])
    disk, process = counter.stop()
    assert process >= 15 * MB and disk >= process * 0.9  # the device counts every process; 4 KB pages may be merged
    counter.start()
    sequential_read([path])  # now cached
    assert counter.stop()[1] < MB


def test_device_names_come_from_diskstats(tmp_path):
    device = device_of(write_file(tmp_path / "x", 10))
    assert device and disk_read_bytes(device) > 0
    with pytest.raises(CgroupError, match="no device 'no-such-disk'"):
        disk_read_bytes("no-such-disk")


def test_without_a_controller_the_problem_is_said(tmp_path):
    assert "no cgroup v1 memory controller" in cgroup_problem(str(tmp_path))
    with pytest.raises(CgroupError, match="cannot bound the page cache"):
        MemoryCgroup(64 * MB, root=str(tmp_path))


READER = """\
import sys
from fastdata.measure.pagecache import sequential_read
print(sequential_read([sys.argv[1]])[0])
"""


@no_cgroup
@pytest.mark.slow
def test_a_reader_in_a_cgroup_keeps_at_most_its_limit_of_the_file_cached(tmp_path):
    path = write_file(tmp_path / "big.bin", 256 * MB)
    with MemoryCgroup(96 * MB, name=f"fastdata-test-{os.getpid()}") as group:
        assert os.path.isdir(group.path) and group.stat()["limit"] == 96 * MB
        done = group.run([sys.executable, "-c", READER, path], timeout=120)
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == 256 * MB
        stat = group.stat()
        assert stat["max_usage"] <= 96 * MB and stat["cache"] <= 96 * MB
        assert page_residency(path) < 0.4  # the rest was reclaimed inside the group
        assert group.pids() == []
    assert not os.path.isdir(group.path)


@no_cgroup
def test_without_a_cgroup_the_same_read_stays_cached(tmp_path):
    path = write_file(tmp_path / "big.bin", 64 * MB)
    sequential_read([path])
    assert page_residency(path) > 0.9  # the bound above is the group's, not the machine's


def test_random_read_reads_samples_at_random_offsets_from_disk_until_the_time_is_up(tmp_path):
    paths = [write_file(tmp_path / f"{k}.bin", size) for k, size in enumerate((8 * MB, 3 * MB, 100))]  # evicted
    counter = ReadCounter(paths[0]).start()
    reads, seconds = random_read(paths, 12288, max_seconds=0.3, threads=4)
    _, process = counter.stop()
    assert reads > 0 and reads % 64 == 0 and 0.3 <= seconds < 30
    assert process >= 4096 * min(reads, 100)  # evicted: at least the first reads came from the disk
    with pytest.raises(ValueError, match="longer than a read"):
        random_read(paths[2:], 12288, max_seconds=0.1)
