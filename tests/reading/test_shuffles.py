"""The shuffle that fits: uniform while the data can stay in the page cache, blocks of about BLOCK_BYTES otherwise."""

import os
import subprocess
import sys

import pytest

from fastdata import open_dataset
from fastdata.reading.shuffles import (
    BLOCK_BYTES,
    CACHE_SHARE,
    WINDOW_BLOCKS,
    available_memory,
    block_settings,
    choose_shuffle,
)

CGROUP_V1 = "/sys/fs/cgroup/memory"


def test_choose_shuffle_picks_block_when_the_data_cannot_stay_in_the_page_cache(packed_files):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    mode, reason = choose_shuffle(dataset, available_bytes=2 * dataset.nbytes)
    assert mode == "uniform" and f"fit in {CACHE_SHARE:.0%} of" in reason and "(given)" in reason
    mode, reason = choose_shuffle(dataset, available_bytes=dataset.nbytes)
    assert mode == "block" and "do not fit" in reason
    assert choose_shuffle(dataset)[0] == "uniform"  # a few hundred kB


def test_block_settings_make_blocks_of_about_block_bytes(packed_files, packed_text):
    for dataset in (open_dataset(packed_files("hdf5", "raw")), open_dataset(packed_text("arrow"))):
        block_size, window = block_settings(dataset)
        per_sample = dataset.nbytes / len(dataset)
        assert window == WINDOW_BLOCKS
        assert abs(block_size * per_sample - BLOCK_BYTES) <= per_sample / 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cgroups are Linux")
@pytest.mark.skipif(not os.access(CGROUP_V1, os.W_OK), reason="needs a writable cgroup v1 memory hierarchy (root)")
@pytest.mark.integration
def test_available_memory_is_bounded_by_the_cgroup_limit(tmp_path):
    group = os.path.join(CGROUP_V1, f"fastdata-test-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(300 << 20))
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
                "from fastdata.reading.shuffles import available_memory; print(*available_memory())")
        out = subprocess.run([sys.executable, "-c", code, group], capture_output=True, text=True, check=True).stdout
    finally:
        os.rmdir(group)
    room, where = out.split(maxsplit=1)
    assert where.strip() == "cgroup limit" and 0 < int(room) <= 300 << 20
    assert available_memory()[0] > 0
