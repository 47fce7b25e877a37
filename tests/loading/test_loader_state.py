"""Loader state: state_dict counts the batches handed over, load_state_dict resumes the same order on any topology."""

import gc
import json
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdata import BucketBatchSampler, HDF5Dataset, make_loader, open_dataset
from fastdata.errors import OptionError

STATE_KEYS = {"version", "dataset", "num_samples", "seed", "shuffle", "remainder", "global_batch", "block_size",
              "window", "epoch", "samples_consumed"}


class IndexedHDF5(HDF5Dataset):
    """Adds the batch's sample indices (int64) as a last element: which samples the loader read, per step."""

    reads = 0

    def read_batch(self, indices, *args, **kwargs):
        IndexedHDF5.reads += 1
        return (*super().read_batch(indices, *args, **kwargs), torch.as_tensor(np.asarray(indices)))


@pytest.fixture(scope="module")
def path(packed_files):
    return packed_files("hdf5", "raw")  # 24 samples


def indices_of(batches):
    return [batch[-1].tolist() for batch in batches]


def global_steps(loaders, epochs=1):
    """Iterate rank loaders side by side for ``epochs``; return each step's global batch (sorted indices)."""
    steps = []
    for _ in range(epochs):
        shares = [indices_of(loader) for loader in loaders]
        assert len({len(share) for share in shares}) == 1, "every rank should yield as many batches"
        steps += [sorted(i for share in shares for i in share[step]) for step in range(len(shares[0]))]
    return steps


def rank_loaders(path, global_batch, world_size, **options):
    return [make_loader(IndexedHDF5(path), global_batch // world_size, rank=rank, world_size=world_size,
                        **options) for rank in range(world_size)]


def position(loader):
    state = loader.state_dict()
    return state["epoch"], state["samples_consumed"]


def shutdown(loaders):
    for loader in loaders:
        if hasattr(loader, "close"):
            loader.close()
    gc.collect()


# ---------------------------------------------------------------- what the state holds


def test_state_is_small_json_and_names_the_order(path):
    loader = make_loader(IndexedHDF5(path), 5, shuffle="uniform", seed=3)
    state = loader.state_dict()
    assert set(state) == STATE_KEYS and len(json.dumps(state)) < 1024
    assert state == {**state, "version": 3, "dataset": open_dataset(path).fingerprint, "num_samples": 24, "seed": 3,
                     "shuffle": "uniform", "remainder": "partial", "global_batch": 5, "epoch": 0,
                     "samples_consumed": 0}


def test_state_counts_the_batches_handed_over_and_moves_to_the_next_epoch_at_the_end(path):
    loader = make_loader(IndexedHDF5(path), 5, shuffle="uniform", rank=1, world_size=2)  # 3 steps of 10
    seen = [position(loader) for _ in loader]
    assert seen == [(0, 10), (0, 20), (1, 0)]  # the last batch handed over ends the epoch
    assert position(loader) == (1, 0)
    iterator = iter(loader)
    next(iterator)
    iterator.close()  # a loop that stops mid-epoch: the state stays where it stopped
    assert position(loader) == (1, 10)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_batches_read_ahead_are_not_counted(path, num_workers):
    # A busy loop hands reading to a thread (or workers) that reads up to 4 batches ahead, and the next epoch's first.
    loader = make_loader(IndexedHDF5(path), 4, shuffle="uniform", prefetch_factor=4, num_workers=num_workers,
                         multiprocessing_context="fork")
    for epoch in range(2):
        seen = []
        for _ in loader:
            time.sleep(0.02)  # see NOTE [noise-proof timing] in test_loader.py
            seen.append(position(loader))
        assert seen == [(epoch, 4 * step) for step in range(1, 6)] + [(epoch + 1, 0)]
    shutdown([loader])


# ---------------------------------------------------------------- resuming


topologies = st.fixed_dictionaries({
    "global_batch": st.sampled_from([1, 2, 4, 6, 12]), "shuffle": st.sampled_from(["none", "uniform", "block"]),
    "seed": st.integers(0, 2**20), "drop_last": st.booleans(),
    "before": st.sampled_from([1, 2, 3]), "after": st.sampled_from([1, 2, 3]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
@given(topology=topologies, data=st.data())
def test_a_state_resumes_the_same_global_order_on_another_world_size(path, topology, data):
    options = {"shuffle": topology["shuffle"], "seed": topology["seed"], "drop_last": topology["drop_last"],
               "remainder": None if topology["drop_last"] else "pad", "prefetch_factor": 0}
    if topology["shuffle"] == "block":
        options |= {"block_size": 3, "window": 2}
    batch, before, after = topology["global_batch"], topology["before"], topology["after"]
    if batch % before or batch % after:
        before = after = 1
    reference = global_steps(rank_loaders(path, batch, 1, **options), epochs=2)
    steps = len(reference) // 2
    kill = data.draw(st.integers(0, steps))
    first = rank_loaders(path, batch, before, **options)
    iterators = [iter(loader) for loader in first]
    for _ in range(kill):
        for iterator in iterators:
            next(iterator)
    states = [loader.state_dict() for loader in first]
    assert all(state == states[0] for state in states)  # every rank's state is the same
    resumed = rank_loaders(path, batch, after, **options)
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert global_steps(resumed, epochs=2 - states[0]["epoch"]) == reference[kill:]  # the rest of epoch 0, epoch 1


@pytest.mark.parametrize("before, after", [((2, 0), (1, 2)), ((1, 1), (4, 0))])
def test_a_state_resumes_the_same_order_with_other_workers(path, before, after):
    # (world size, num_workers) before and after; uniform order, global batch 4, stopped at step 3 of 6
    options = {"shuffle": "uniform", "seed": 9, "multiprocessing_context": "fork"}
    reference = global_steps(rank_loaders(path, 4, 1, **options), epochs=2)
    first = rank_loaders(path, 4, before[0], num_workers=before[1], **options)
    iterators = [iter(loader) for loader in first]
    for _ in range(3):
        for iterator in iterators:
            next(iterator)
    state = first[0].state_dict()
    resumed = rank_loaders(path, 4, after[0], num_workers=after[1], **options)
    for loader in resumed:
        loader.load_state_dict(state)
    assert global_steps(resumed, epochs=2) == reference[3:]
    del iterators
    shutdown(first + resumed)


def test_resuming_reads_only_the_rest_of_the_epoch(path):
    # O(1): nothing before the resumed step is read (or computed: the sampler starts its order at that step)
    loader = make_loader(IndexedHDF5(path), 2, shuffle="uniform", prefetch_factor=0)  # 12 steps
    loader.load_state_dict({**loader.state_dict(), "epoch": 5, "samples_consumed": 20})
    IndexedHDF5.reads = 0
    batches = indices_of(loader)
    assert IndexedHDF5.reads == len(batches) == 2
    assert batches == [batch.tolist() for batch in loader.sampler.batches(5)][10:]


def test_a_trainer_calling_set_epoch_after_loading_keeps_the_resumed_step(path):
    loader = make_loader(IndexedHDF5(path), 4, shuffle="uniform")
    loader.load_state_dict({**loader.state_dict(), "epoch": 2, "samples_consumed": 8})
    loader.sampler.set_epoch(2)
    assert len(indices_of(loader)) == 4


def test_a_state_loaded_while_the_next_epoch_was_read_early_wins(path):
    # see NOTE [next epoch's first batch]: a busy loop has the next epoch's first batch read when the epoch ends
    loader = make_loader(IndexedHDF5(path), 4, shuffle="uniform")
    for _ in loader:
        time.sleep(0.02)
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "samples_consumed": 12})
    assert indices_of(loader) == [batch.tolist() for batch in loader.sampler.batches(1)][3:]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("options, field, saved, ours", [
    ({"seed": 4}, "seed", 3, 4),
    ({"batch_size": 6}, "global_batch", 5, 6),
    ({"shuffle": "none"}, "shuffle", "'uniform'", "'none'"),
    ({"drop_last": True}, "remainder", "'partial'", "'drop'"),
    ({"shuffle": "block", "block_size": 2, "window": 3}, "shuffle", "'uniform'", "'block'"),
])
def test_a_state_of_other_order_settings_is_refused_naming_the_field(path, options, field, saved, ours):
    state = make_loader(IndexedHDF5(path), 5, shuffle="uniform", seed=3).state_dict()  # 24 samples: a short last
    loader = make_loader(IndexedHDF5(path), **{"batch_size": 5, "shuffle": "uniform", "seed": 3, **options})
    with pytest.raises(OptionError, match=f"its {field} is {saved}, this loader's is {ours}; make the loader with"):
        loader.load_state_dict(state)


def test_the_remainder_matters_only_where_the_global_batch_leaves_a_short_last_batch(path):
    # One rank defaults to "partial", more to "pad": the same order where the global batch divides the epoch.
    two_ranks = make_loader(IndexedHDF5(path), 4, rank=0, world_size=2)
    make_loader(IndexedHDF5(path), 8).load_state_dict(two_ranks.state_dict())  # 24 samples, 3 steps of 8
    two_ranks = make_loader(IndexedHDF5(path), 5, rank=0, world_size=2)
    with pytest.raises(OptionError, match="its remainder is 'pad', this loader's is 'partial'"):
        make_loader(IndexedHDF5(path), 10).load_state_dict(two_ranks.state_dict())
    make_loader(IndexedHDF5(path), 10, remainder="pad").load_state_dict(two_ranks.state_dict())


def test_a_state_of_another_dataset_is_refused(path, packed_files):
    state = make_loader(IndexedHDF5(path), 4).state_dict()
    other = make_loader(open_dataset(packed_files("hdf5", "jpeg")), 4)
    with pytest.raises(OptionError, match=f"its dataset is '{state['dataset']}', .*the dataset it was saved from"):
        other.load_state_dict(state)
    other.load_state_dict({**state, "dataset": other.state_dict()["dataset"]})  # the same settings otherwise


@pytest.mark.parametrize("change, match", [
    ({"version": 2}, "its version is 2, this loader's is 3"),
    ({"samples_consumed": 6}, "samples_consumed=6; expected .* multiple of the global batch \\(4\\) up to 24"),
    ({"samples_consumed": 28}, "samples_consumed=28"),
    ({"epoch": -1}, "epoch=-1"),
    ({"epoch": "1"}, "epoch='1'"),
])
def test_a_malformed_state_is_refused(path, change, match):
    loader = make_loader(IndexedHDF5(path), 4)
    with pytest.raises(OptionError, match=match):
        loader.load_state_dict({**loader.state_dict(), **change})


def test_state_needs_a_sampler_that_knows_its_epoch(path):
    loader = make_loader(IndexedHDF5(path), batch_sampler=[[0, 1], [2]])
    with pytest.raises(TypeError, match="a loader over a list cannot say where an epoch stands"):
        loader.state_dict()
    with pytest.raises(TypeError, match="state should be a dict"):
        make_loader(IndexedHDF5(path), 4).load_state_dict([("epoch", 1)])


def test_a_bucketed_loader_resumes_too(path):
    lengths = np.arange(24) % 7
    loaders = [make_loader(IndexedHDF5(path), batch_sampler=BucketBatchSampler(lengths, 2, pool_batches=2, seed=5))
               for _ in range(2)]
    reference = indices_of(loaders[0])
    iterator = iter(loaders[1])
    next(iterator), next(iterator)
    state = loaders[1].state_dict()
    assert state["pool_batches"] == 2 and state["samples_consumed"] == 4
    fresh = make_loader(IndexedHDF5(path), batch_sampler=BucketBatchSampler(lengths, 2, pool_batches=2, seed=5))
    fresh.load_state_dict(state)
    assert indices_of(fresh) == reference[2:]
    with pytest.raises(OptionError, match="its pool_batches is 2, this loader's is 3"):
        make_loader(IndexedHDF5(path), batch_sampler=BucketBatchSampler(lengths, 2, pool_batches=3, seed=5)
                    ).load_state_dict(state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_stopped_mid_epoch_resumes_from_a_state_of_its_own(path, num_workers):
    # Persistent workers still hold batches read ahead for the stopped epoch; the resumed one must not see them.
    loader = make_loader(IndexedHDF5(path), 2, shuffle="uniform", seed=2, num_workers=num_workers, prefetch_factor=3,
                         multiprocessing_context="fork")
    reference = indices_of(loader)  # epoch 0, 12 steps
    loader.load_state_dict({**loader.state_dict(), "epoch": 0})
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    next(iterator), next(iterator)
    del iterator
    loader.load_state_dict(state)
    assert indices_of(loader) == reference[1:]
    shutdown([loader])
