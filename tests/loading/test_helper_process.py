"""make_loader(helper_process=True): one helper process reads, the loop maps its slots (NOTE [helper process])."""

import gc
import os
import shutil
import signal
import time

import h5py
import pytest
import torch
from support import start_methods, truncate_elsewhere

from fastdata import make_loader, open_dataset
from fastdata.errors import FormatError, OptionError

KINDS = [("hdf5", "raw"), ("hdf5", "jpeg"), ("arrow", "raw"), ("arrow", "jpeg")]


def same_batches(got, expected):
    return len(got) == len(expected) and all(
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(got, expected))


def cloned(batch):
    return tuple(tensor.clone() for tensor in batch)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fmt, storage", KINDS)
def test_batches_are_those_read_in_process_over_epochs(packed_files, fmt, storage):
    dataset = open_dataset(packed_files(fmt, storage))
    expected_loader = make_loader(dataset, 5, shuffle=True, seed=2)
    with make_loader(dataset, 5, shuffle=True, seed=2, helper_process=True) as loader:
        for _ in range(2):  # a new order each epoch, the same helper
            assert same_batches([cloned(batch) for batch in loader], [cloned(b) for b in expected_loader])
        report = loader.helper.report()
    assert report["read_in_place"] == report["batches"] == 2 * len(loader)  # NOTE [read into the slot]


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn", "forkserver"))
def test_the_helper_starts_by_any_method(packed_files, start_method):
    dataset = open_dataset(packed_files("arrow", "jpeg"))
    with make_loader(dataset, 4, shuffle=True, helper_process=True, multiprocessing_context=start_method) as loader:
        assert same_batches([cloned(b) for b in loader], list(make_loader(dataset, 4, shuffle=True)))


def test_text_batches_come_through_the_helper_too(packed_text):
    dataset = open_dataset(packed_text("hdf5"))
    with make_loader(dataset, 4, shuffle=True, helper_process=True) as loader:
        assert same_batches([cloned(batch) for batch in loader], list(make_loader(dataset, 4, shuffle=True)))


def test_batches_the_loop_keeps_are_never_overwritten(packed_files):
    # more batches than slots: the rest travel as themselves, and nothing waits for the kept ones
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    expected = [cloned(b) for b in make_loader(dataset, 2, shuffle=True)]
    with make_loader(dataset, 2, shuffle=True, helper_process=True, prefetch_factor=1) as loader:
        kept = list(loader)
        assert len(kept) > loader.helper._buffers.shape[0]
        for _ in range(2):  # later epochs would reuse any slot a kept batch still held
            list(loader)
        assert same_batches(kept, expected)


def test_a_batch_maps_its_slot_and_frees_it_when_its_last_view_goes(packed_files):
    dataset = open_dataset(packed_files("arrow", "raw"))
    with make_loader(dataset, 4, helper_process=True) as loader:
        helper = loader.helper
        iterator = iter(loader)
        images, labels = next(iterator)
        slots = [helper._buffers[s].data_ptr() for s in range(helper._buffers.shape[0])]
        assert images.data_ptr() in slots  # mapped, not copied
        view = images[1:]
        del images, labels
        iterator.close()  # the loader's generators no longer hold the batch
        gc.collect()
        free = len(helper._free)
        del view
        assert len(helper._free) == free + 1


def test_resuming_mid_epoch_continues_with_the_same_batches(packed_files):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    full = [cloned(b) for b in make_loader(dataset, 3, shuffle=True, seed=5)]
    with make_loader(dataset, 3, shuffle=True, seed=5, helper_process=True) as loader:
        iterator = iter(loader)
        for _ in range(2):
            next(iterator)
        state = loader.state_dict()
        iterator.close()  # two steps read ahead are left in flight
    with make_loader(dataset, 3, shuffle=True, seed=5, helper_process=True) as resumed:
        resumed.load_state_dict(state)
        assert same_batches([cloned(b) for b in resumed], full[2:])


def test_an_epoch_left_early_leaves_the_next_one_whole(packed_files):
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    expected = [cloned(b) for b in make_loader(dataset, 2)]
    with make_loader(dataset, 2, helper_process=True, prefetch_factor=3) as loader:
        for _ in range(3):
            iterator = iter(loader)
            next(iterator)
            iterator.close()  # left after one batch: replies in flight, dropped when the next iteration starts
        assert same_batches([cloned(b) for b in loader], expected)
        assert len(loader.helper._free) == loader.helper._buffers.shape[0]  # every slot back


def test_a_damaged_sample_raises_in_its_turn_naming_file_and_sample(packed_files, tmp_path):
    damaged = tmp_path / "damaged.h5"
    shutil.copy(packed_files("hdf5", "jpeg"), damaged)
    with h5py.File(damaged, "r") as f:
        start, stop = f["offsets"][5:7]
        where = f["samples"].id.get_offset() + int(start)
    with open(damaged, "r+b") as f:
        f.seek(where)
        f.write(bytes(int(stop - start)))
    seen = []
    with make_loader(open_dataset(damaged), 2, helper_process=True) as loader:
        with pytest.raises(FormatError, match=r"damaged\.h5.*sample 5 does not decode"):
            for batch in loader:
                seen.append(batch)
    assert len(seen) == 2  # samples 0-3: the batches before it


def test_a_helper_killed_mid_epoch_is_an_error_and_the_next_epoch_starts_a_new_one(packed_files):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    with make_loader(dataset, 2, helper_process=True) as loader:
        iterator = iter(loader)
        next(iterator)
        pid = loader.helper._process.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"helper process \(pid {pid}\) ended unexpectedly \(killed by "
                                               r"signal 9\)"):
            for _ in iterator:
                pass
        assert same_batches([cloned(b) for b in loader], [cloned(b) for b in make_loader(dataset, 2)])
        assert loader.helper._process.pid != pid


@pytest.mark.integration
def test_a_file_truncated_under_the_helper_is_a_format_error(packed_files, tmp_path):
    path = tmp_path / "copy.h5"
    shutil.copy(packed_files("hdf5", "raw"), path)
    with make_loader(open_dataset(path), 2, helper_process=True) as loader:
        assert len(list(loader)) > 1  # the helper has mapped the file
        truncate_elsewhere(path, os.path.getsize(path) // 2)
        with pytest.raises(FormatError, match="copy.h5"):
            list(loader)


def test_close_and_garbage_collection_end_the_helper(packed_files):
    dataset = open_dataset(packed_files("arrow", "jpeg"))
    loader = make_loader(dataset, 2, helper_process=True)
    list(loader)
    pid = loader.helper._process.pid
    loader.close()
    assert not alive(pid)
    assert len(list(loader)) > 0  # a later iteration starts a new helper
    pid = loader.helper._process.pid
    del loader
    gc.collect()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_the_device_pipeline_runs_on_batches_from_the_helper(packed_files):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    options = dict(shuffle=True, device="cpu", normalize=True, dtype=torch.float32)
    expected = [cloned(b) for b in make_loader(dataset, 4, **options)]
    with make_loader(dataset, 4, helper_process=True, **options) as loader:
        assert same_batches([cloned(b) for b in loader], expected)


def test_helper_process_replaces_num_workers(packed_files):
    with pytest.raises(OptionError, match="helper_process=True .* replaces num_workers; got num_workers=2"):
        make_loader(open_dataset(packed_files("hdf5", "raw")), 2, helper_process=True, num_workers=2)
