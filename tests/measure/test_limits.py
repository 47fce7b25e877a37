"""fastdata.measure.limits and the engine's timed loops: epochs that cover every stored sample once."""

import io
import multiprocessing
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fastdata.formats import read_packed
from fastdata.measure.engine import interleaved_rates, measure_rate
from fastdata.measure.limits import DecodeEpochs, copy_epochs, ending_pool, shuffled_batches, token_copy_epochs
from fastdata.measure.memory import MemoryProbe, process_memory
from fastdata.measure.synthetic import make_photo


def jpeg_columns(count, damaged=None):
    """Columns of ``count`` stored JPEGs (``samples`` uint8 bytes, ``offsets``); sample ``damaged`` is garbage."""
    rng = np.random.default_rng(0)
    blobs = []
    for index in range(count):
        buffer = io.BytesIO()
        make_photo(rng, 40, 30).save(buffer, "JPEG", quality=90)
        blobs.append(b"not a jpeg" if index == damaged else buffer.getvalue())
    offsets = np.cumsum([0, *map(len, blobs)])
    return SimpleNamespace(samples=np.frombuffer(b"".join(blobs), np.uint8), offsets=offsets)


def test_shuffled_batches_cover_every_sample_once_sorted():
    batches = shuffled_batches(10, 4, seed=3)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert all(np.all(np.diff(b) > 0) for b in batches)
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))


@pytest.mark.parametrize("mode, threads", [("clip", 1), ("raise", 1), (None, 1), ("clip", 2), ("clip", 3)])
def test_copy_epochs_take_every_stored_sample(packed_files, mode, threads):
    columns, metadata = read_packed(packed_files("hdf5", "raw"))
    run_epoch = copy_epochs(columns.samples, 5, mode=mode, threads=threads)
    assert run_epoch() == metadata["num_samples"] == run_epoch()


@pytest.mark.parametrize("contiguous", [False, True])
def test_token_copy_epochs_count_every_sequence(packed_text, contiguous):
    columns, metadata = read_packed(packed_text("hdf5"))
    longest = int(np.diff(columns.offsets).max())
    run_epoch = token_copy_epochs(columns.samples, columns.offsets, 4, longest, contiguous=contiguous)
    assert run_epoch() == metadata["num_samples"]


@pytest.mark.parametrize("processes", [False, True])
def test_decode_epochs_decode_every_stored_jpeg(processes):
    with DecodeEpochs(jpeg_columns(9), 2, processes=processes) as run_epoch:
        assert run_epoch() == 9 == run_epoch()


def test_decode_processes_end_under_a_parent_sigterm_handler_that_returns():
    # NOTE [forked SIGTERM]: the autouse restore_sigterm fixture puts the runner's handler back
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    pool = DecodeEpochs(jpeg_columns(9), 2, processes=True)
    assert pool() == 9
    closing = threading.Thread(target=pool.close, daemon=True)
    closing.start()
    closing.join(timeout=60)
    assert not closing.is_alive(), "Pool.terminate hung: a worker survived its SIGTERM"


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.01, 0.05])
def test_a_pool_terminated_at_any_moment_of_its_start_ends_under_a_returning_sigterm_handler(delay):
    # NOTE [forked SIGTERM]: the SIGTERM of terminate lands before, during or after each worker's initializer
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    for _ in range(4):
        pool = ending_pool(2, time.sleep, (0.01,))
        time.sleep(delay)
        closing = threading.Thread(target=lambda pool=pool: (pool.terminate(), pool.join()), daemon=True)
        closing.start()
        closing.join(timeout=20)
        assert not closing.is_alive(), f"Pool.terminate hung {delay} s after the pool started"


def test_decode_epochs_really_decode():
    with DecodeEpochs(jpeg_columns(5, damaged=3), 2) as run_epoch, pytest.raises(ValueError):
        run_epoch()


def test_decode_epochs_read_a_packed_jpeg_file(packed_files):
    columns, metadata = read_packed(packed_files("arrow", "jpeg"))
    with DecodeEpochs(columns, 1) as run_epoch:
        assert run_epoch() == metadata["num_samples"]


def test_measure_rate_checks_the_expected_epoch():
    with pytest.raises(RuntimeError, match="an epoch gave 5 samples, expected 6"):
        measure_rate(lambda: 5, 1, min_seconds=0, expected=6)


def test_interleaved_rates_time_each_method_per_round():
    rates = interleaved_rates({"a": lambda: 3, "b": lambda: 4}, rounds=3, min_seconds=0.001)
    assert set(rates) == {"a", "b"} and all(len(r) == 3 and min(r) > 0 for r in rates.values())


def test_interleaved_rates_fail_on_a_changing_epoch():
    calls = []

    def run_epoch():  # the warm-up and the steady epoch give 5 samples, later epochs 4
        calls.append(1)
        return 5 if len(calls) <= 2 else 4

    with pytest.raises(RuntimeError, match="samples, expected"):
        interleaved_rates({"a": run_epoch}, rounds=2, min_seconds=0.001)


def test_process_memory_reads_smaps_fields():
    memory = process_memory(os.getpid())
    assert memory["uss"] > 0 and memory["pss"] > 0 and memory["uss"] >= memory["private_dirty"]


def _hold_memory(ready, stop):
    block = np.ones(8 << 20, np.uint8)  # 8 MB of private dirty pages
    ready.set()
    stop.wait(30)
    return block


def test_memory_probe_reads_the_children_started_by_the_warm_up():
    context = multiprocessing.get_context("fork")
    ready, stop = context.Event(), context.Event()
    child = None

    def run_epoch():
        nonlocal child
        if child is None:
            child = context.Process(target=_hold_memory, args=(ready, stop))
            child.start()
            ready.wait(30)
        return 1

    probe = MemoryProbe()
    try:
        epoch = probe.wrap(run_epoch)
        epoch(), epoch()
        growth = probe.growth()
    finally:
        stop.set()
        child.join(30)
    (worker,) = [w for w in growth["workers"] if w["pid"] == child.pid]
    assert worker["private_dirty"] >= 8 << 20 and worker["uss_growth"] is not None
