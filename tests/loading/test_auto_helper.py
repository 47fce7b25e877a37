"""helper_process="auto": reading moves to a helper process once the loop computes on its own thread.

See NOTE [auto helper] in fastdata/loading/batchloader.py.
"""

import gc
import time
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import memory_short_of, wait_for

from fastdata import make_loader, open_dataset
from fastdata.errors import OptionError
from fastdata.loading import batchloader, overlap
from fastdata.loading.helper import HelperReadAhead
from fastdata.reading.windows import WindowAhead

BUSY_THRESHOLD, STEP = 0.01, 0.03  # as tests/loading/test_loader.py: far from a shared machine's noise
KINDS = [("hdf5", "raw"), ("hdf5", "jpeg"), ("arrow", "raw"), ("arrow", "jpeg")]


@pytest.fixture(autouse=True)
def noise_proof(monkeypatch):
    monkeypatch.setattr(overlap, "BUSY_CONSUMER_SECONDS", BUSY_THRESHOLD)
    monkeypatch.setattr(overlap, "COMPUTES_ABOVE", 0.2)  # a spinning body on a loaded machine still counts
    monkeypatch.setattr(overlap, "COMPUTES_UNTIL_BELOW", 0.1)


def compute(seconds=STEP):
    """A loop body that keeps its core (and the GIL) busy."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def wait(seconds=STEP):
    """A loop body that waits, as on a GPU: the GIL and the core are free."""
    time.sleep(seconds)


def from_helper(loader, tensor):
    """Whether ``tensor`` lies in a slot of the loader's auto helper (mapped from it, not read here)."""
    helper = loader.auto_helper
    return helper is not None and any(
        slot.data_ptr() <= tensor.data_ptr() < slot.data_ptr() + slot.numel() for slot in helper._buffers)


def run_epoch(loader, body):
    """Return each batch of an epoch (cloned) and whether it came from the helper, running ``body`` after each."""
    batches, sources = [], []
    for batch in loader:
        sources.append(from_helper(loader, batch[0]))
        batches.append(tuple(tensor.clone() for tensor in batch))
        body()
    return batches, sources


def same_batches(got, expected):
    return len(got) == len(expected) and all(
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(got, expected))


@pytest.mark.parametrize("fmt, storage", KINDS)
def test_a_loop_that_computes_gets_the_same_batches_from_a_helper(packed_files, monkeypatch, fmt, storage):
    monkeypatch.setattr(batchloader, "MAX_GROUP", 2)  # raw: reads two batches at a time, a read ahead
    dataset = open_dataset(packed_files(fmt, storage))
    expected = make_loader(dataset, 2, shuffle=True, seed=4, helper_process=False)
    with make_loader(dataset, 2, shuffle=True, seed=4) as loader:
        first, sources = run_epoch(loader, compute)
        assert same_batches(first, [tuple(t.clone() for t in b) for b in expected])
        if storage == "jpeg":  # read a step at a time: the steps after the streak of long bodies go to the helper
            assert sources == [False] * overlap.STREAK + [True] * (len(sources) - overlap.STREAK)
        else:  # read a group ahead: the batches started here are read here, the rest by the helper
            assert sources == sorted(sources) and not any(sources[: overlap.STREAK + 1]) and sources[-1]
        second, sources = run_epoch(loader, compute)
        assert all(sources) and same_batches(second, [tuple(t.clone() for t in b) for b in expected])
        process = loader.auto_helper._process
        assert process.is_alive()
    assert not process.is_alive()  # closed with the loader


def test_the_helper_decodes_on_every_usable_core_as_helper_process_true_does(packed_files, monkeypatch):
    # NOTE [auto helper]: with a core left to the loop, 64 px JPEG kept 0.29-0.46 of a 5 ms step, 0.51-0.54 on all
    monkeypatch.setattr("fastdata.loading.loader.usable_cpus", lambda: 3)
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    explicit = make_loader(dataset, 2, helper_process=True)
    with make_loader(dataset, 2) as loader:
        run_epoch(loader, compute)
        assert loader.auto_helper is not None
        assert loader.auto_helper.options["threads"] == explicit.helper.options["threads"] == 3
    explicit.close()


@pytest.mark.parametrize("body", [wait, lambda: None], ids=["waits", "tight"])
def test_a_loop_that_waits_or_does_nothing_keeps_reading_here(packed_files, body):
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    loader = make_loader(dataset, 2, shuffle=True, seed=1)
    for _ in range(2):
        _, sources = run_epoch(loader, body)
        assert not any(sources)
    assert loader.auto_helper is None


def test_helper_process_false_reads_here_whatever_the_loop(packed_files):
    loader = make_loader(open_dataset(packed_files("arrow", "jpeg")), 3, helper_process=False)
    for _ in range(2):
        run_epoch(loader, compute)
    assert loader.auto_helper is None


def test_a_resumed_loop_gets_the_rest_of_the_epoch_after_the_move(packed_files):
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    expected = [tuple(t.clone() for t in b) for b in make_loader(dataset, 2, shuffle=True, seed=5)]
    with make_loader(dataset, 2, shuffle=True, seed=5) as loader:
        iterator = iter(loader)
        for _ in range(overlap.STREAK + 2):  # past the move to the helper
            batch = next(iterator)
            compute()
        assert from_helper(loader, batch[0])
        state = loader.state_dict()
    resumed = make_loader(dataset, 2, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    rest, _ = run_epoch(resumed, lambda: None)
    assert same_batches(rest, expected[overlap.STREAK + 2:])


def test_helper_process_is_true_false_or_auto(packed_files):
    with pytest.raises(OptionError, match="helper_process should be True, False or 'auto', got 'yes'"):
        make_loader(open_dataset(packed_files("hdf5", "raw")), 2, helper_process="yes")


@pytest.mark.slow
def test_a_loop_that_stops_computing_gets_its_batches_read_here_again(packed_files, monkeypatch):
    monkeypatch.setattr(batchloader, "MAX_GROUP", 2)
    dataset = open_dataset(packed_files("hdf5", "raw"))
    expected = make_loader(dataset, 1, shuffle=True, seed=6)
    with make_loader(dataset, 1, shuffle=True, seed=6) as loader:  # 24 batches an epoch
        sources, step = [], 0
        for _ in range(3):  # the CPU share decays over ~10 bodies: the helper stops paying some bodies later
            got = []
            for batch in loader:
                sources.append(from_helper(loader, batch[0]))
                got.append(tuple(tensor.clone() for tensor in batch))
                (compute if step < 10 else wait)()
                step += 1
            assert same_batches(got, [tuple(t.clone() for t in b) for b in expected])
        moved = sources.index(True)
        back = moved + sources[moved:].index(False)
        assert not any(sources[back:])  # the loop waits from step 10: once back here, it stays here
        assert loader.auto_helper._process.is_alive()


def test_a_loop_that_starts_computing_while_a_thread_reads_ahead_moves_to_the_helper(packed_files):
    dataset = open_dataset(packed_files("arrow", "jpeg"))
    expected = [tuple(t.clone() for t in b) for b in make_loader(dataset, 1, shuffle=True, seed=7)]
    with make_loader(dataset, 1, shuffle=True, seed=7) as loader:  # 24 batches
        got, sources = [], []
        for step, batch in enumerate(loader):
            sources.append(from_helper(loader, batch[0]))
            got.append(tuple(tensor.clone() for tensor in batch))
            (wait if step < 8 else compute)()  # waits: read ahead on a thread here; then computes
        assert same_batches(got, expected)
        assert sources == sorted(sources) and not any(sources[:8]) and sources[-1]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the thresholds are patched alike for all
@given(shares=st.lists(st.floats(0.0, 1.0), max_size=60), start=st.booleans())
def test_the_computing_decision_changes_only_past_its_far_threshold(shares, start):
    # NOTE [computing hysteresis]: a share wandering between the two thresholds never flips the decision
    low, high = overlap.COMPUTES_UNTIL_BELOW, overlap.COMPUTES_ABOVE
    assert (low, high) == (0.1, 0.2)  # the noise-proof fixture's
    decided = start
    for share in shares:
        now = overlap.computes(share, decided)
        if now != decided:
            assert share > high if now else share <= low
        if low < share <= high:
            assert now == decided
        decided = now


def test_a_loop_over_data_bigger_than_memory_takes_the_block_orders_windows_with_it(shard_converted, monkeypatch):
    # NOTE [auto helper]: the read-ahead runs where the batches are read, and moves with them at the step they move
    folder = shard_converted("hdf5", "raw")
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    options = {"shuffle": True, "block_size": 5, "window": 2, "seed": 6}
    reference = make_loader(open_dataset(folder), 2, **options)
    expected = [[tuple(t.clone() for t in b) for b in reference] for _ in range(6)]  # six epochs' orders
    with make_loader(dataset, 2, **options) as loader:
        assert loader.sampler.shuffle == "block" and isinstance(loader.steps.readahead, WindowAhead)
        windows_here = weakref.ref(loader.steps.readahead.reads)
        first, sources = run_epoch(loader, compute)  # moves to the helper after the streak of long bodies
        assert same_batches(first, expected[0]) and any(sources) and not all(sources)
        assert isinstance(loader.steps.readahead, HelperReadAhead) and dataset._store.windows is None
        wait_for(lambda: gc.collect() is not None and windows_here() is None, "the windows here (their memory) to go")
        second, sources = run_epoch(loader, compute)
        assert same_batches(second, expected[1]) and all(sources)
        here = dataset.read_path_log.counts["windows"]  # read here before the move: the rest in the helper's windows
        for epoch in range(2, 6):  # a loop that waits: back here once its share of CPU has decayed, windows with it
            batches, sources = run_epoch(loader, wait)
            assert same_batches(batches, expected[epoch])
            if not sources[-1]:
                break
        assert not all(sources) and not sources[-1], epoch
        assert isinstance(loader.steps.readahead, WindowAhead) and dataset.read_path_log.counts["windows"] > here
        report = loader.auto_helper.report()
    assert report["readahead"] is None and report["misses"] is None  # the helper ended its windows
    counts = dataset.read_paths()  # here and in the helper: every batch from windows (the next epoch's first too)
    assert counts["windows"] == sum(counts.values()) >= 3 * len(loader), counts
    assert report["read_paths"]["windows"] >= len(loader) + sum(sources), report
