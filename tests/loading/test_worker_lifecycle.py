"""An iteration of a worker loader left early frees its slots and workers (NOTE [abandoned iterations])."""

import multiprocessing
import os

import pytest
import torch

from fastdata import make_loader, open_dataset
from fastdata.errors import FormatError

pytestmark = pytest.mark.integration  # worker processes started, killed and ended

BATCH = 4


@pytest.fixture
def loader_of(packed_files):
    """Return ``make(**options)``: a loader with 2 workers over the converter's raw file, closed after the test."""
    made = []

    def make(**options):
        made.append(make_loader(open_dataset(packed_files("hdf5", "raw")), BATCH, shuffle=True, seed=3,
                                num_workers=2, multiprocessing_context="fork", **options))
        return made[-1]

    yield make
    for loader in made:
        loader.close()


def epoch_labels(loader):
    return sorted(label for _, labels in loader for label in labels.tolist())


@pytest.mark.parametrize("persistent", [True, False])
def test_iterations_left_after_k_batches_free_every_slot_and_the_next_epoch_reads_all(loader_of, persistent):
    loader = loader_of(persistent_workers=persistent)
    expected = sorted(loader.packed_dataset.labels.tolist())
    assert epoch_labels(loader) == expected
    for attempt in range(100):
        for step, _ in enumerate(loader):
            if step == attempt % 3:
                break
        assert not loader.dataset.slots.busy.any(), attempt  # no batch left waiting in a slot
        assert len(multiprocessing.active_children()) <= 2  # the left iteration's workers are gone
    assert epoch_labels(loader) == expected  # and the next full epoch gets every batch through its slots


def test_an_exception_in_the_loop_body_frees_the_slots_too(loader_of):
    loader = loader_of()
    with pytest.raises(ZeroDivisionError):
        for _ in loader:
            raise ZeroDivisionError("the loop body failed")
    assert not loader.dataset.slots.busy.any() and not multiprocessing.active_children()
    assert epoch_labels(loader) == sorted(loader.packed_dataset.labels.tolist())


def test_an_iteration_ended_by_a_later_one_says_so_instead_of_stopping_short(loader_of):
    loader = loader_of()
    first = iter(loader)
    next(first)
    second = iter(loader)
    images, labels = next(second)
    with pytest.raises(RuntimeError, match="ended when another iteration of it began"):
        next(first)
    rest = [label for _, batch in second for label in batch.tolist()]
    assert sorted(labels.tolist() + rest) == sorted(loader.packed_dataset.labels.tolist())


def test_a_with_block_ends_the_workers(loader_of):
    with loader_of() as loader:
        batches = iter(loader)
        images, _ = next(batches)
        assert isinstance(images, torch.Tensor) and multiprocessing.active_children()
    assert not multiprocessing.active_children() and not loader.dataset.slots.busy.any()


def test_a_worker_killed_by_shards_truncated_under_it_reports_the_files_that_changed(shard_converted, shard_copy):
    # NOTE [worker bus error]: with every shard open in the workers, their next touch past a shard's new end is a
    # SIGBUS unless their own fingerprint check (at most once a second) comes first: a FormatError naming a shard
    folder = shard_copy(shard_converted("hdf5", "jpeg"))
    loader = make_loader(open_dataset(folder), BATCH, shuffle=True, seed=3, num_workers=2, persistent_workers=True,
                         multiprocessing_context="fork")
    try:
        epoch_labels(loader)  # every shard opened and checked in both workers
        batches = iter(loader)
        next(batches)
        shards = sorted(folder.glob("*.h5"))
        assert len(shards) > 1
        for shard in shards:
            os.truncate(shard, shard.stat().st_size // 2)
        with pytest.raises(FormatError, match=f"{folder}/shard-\\d+\\.h5'"):
            for _ in batches:
                pass
    finally:
        loader.close()
