"""The shard store in a process that inherited it: made its own once, whichever of its threads comes first."""

import threading
import time

import numpy as np

from fastdata import open_dataset
from fastdata.reading.store import ShardStore


def test_threads_of_a_forked_process_make_its_store_once_and_read_right_labels(shard_converted, monkeypatch):
    # NOTE [reset once]: two threads of the auto helper both reset an inherited store; a shard opened under the
    # first kept a fresh check time with a label address of 0, and the next batch crashed the helper (SIGSEGV)
    dataset = open_dataset(shard_converted("hdf5", "raw"))
    indices = np.arange(len(dataset))[::-1].copy()
    expected = dataset.read_batch(indices)
    resets, real_reset = [], ShardStore._reset

    def slow_reset(store):  # a reset that takes a while: the other threads arrive meanwhile
        resets.append(threading.get_ident())
        time.sleep(0.05)
        real_reset(store)

    monkeypatch.setattr(ShardStore, "_reset", slow_reset)
    dataset._store._pid = -1  # as a forked child finds its parent's store
    start, got = threading.Barrier(4), [None] * 4

    def read(thread):
        start.wait()
        got[thread] = dataset.read_batch(indices)

    threads = [threading.Thread(target=read, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(resets) == 1
    for images, labels in got:
        assert images.equal(expected[0]) and labels.equal(expected[1])
