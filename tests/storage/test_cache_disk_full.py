"""A shard cache on a full disk says which folder, how many bytes and what to do (issue 27).

Before: a bare ``OSError: [Errno 28] No space left on device`` out of the download, naming nothing.
Real tmpfs mounts of a few KiB (conftest's small_disk: root only, unmounted at teardown) and a real HTTP server.
"""

import os
import re
import shutil

import pytest

from fastdata import open_dataset
from fastdata.errors import DiskFullError


@pytest.fixture
def served(sharded_reference, http_server):
    """The converted hdf5 raw shard folder (shards of 24,968 bytes) served over HTTP; returns its URL."""
    shutil.copytree(sharded_reference(), os.path.join(http_server.root, "served"))
    return http_server.url_of("served")


def test_a_download_onto_a_full_disk_names_the_cache_folder_and_the_bytes(served, small_disk):
    disk = small_disk("40k")  # room for one shard, not two
    dataset = open_dataset(served, cache_dir=disk)
    dataset[0]
    with pytest.raises(DiskFullError) as caught:
        for index in range(len(dataset)):
            dataset[index]
    message = str(caught.value)
    assert isinstance(caught.value, OSError) and "Errno" not in message
    assert re.search(r"cannot cache shard 1 of '.*/served' \(\d{2},\d{3} bytes\): no space left on the device of "
                     rf"the cache folder '{re.escape(os.fspath(disk))}/[0-9a-f]{{16}}' \([\d,]+ bytes free\)", message)
    assert "give cache_dir= (or $FASTDATA_CACHE) a folder on a disk with room" in message and "cache_limit=" in message
    assert not [name for name in os.listdir(next(disk.iterdir())) if name.endswith(".partial")]  # none left behind


def test_a_cache_that_cannot_even_start_on_a_full_disk_names_its_folder(served, small_disk):
    disk = small_disk("16k")
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill it to the last byte
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(DiskFullError, match=rf"cannot set up the shard cache: no space left on the device of the "
                                            rf"cache folder '{re.escape(os.fspath(disk))}/"):
        open_dataset(served, cache_dir=disk)[0]
