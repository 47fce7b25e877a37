"""The epoch order: keyed bijections, block windows, global batches and rank slices."""

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdata.errors import OptionError
from fastdata.reading.order import EpochOrder, KeyedPermutation


@given(size=st.integers(1, 5000), key=st.lists(st.integers(0, 2**32), min_size=1, max_size=3))
def test_a_keyed_permutation_is_a_bijection_with_its_inverse(size, key):
    permutation = KeyedPermutation(size, key)
    images = permutation(np.arange(size))
    assert np.array_equal(np.sort(images), np.arange(size))
    assert np.array_equal(permutation.inverse(images), np.arange(size))


@pytest.mark.parametrize("size", [2**32 - 1, 2**32, 2**32 + 1, 10**12])  # the 32-bit mix's last domains, the 64-bit's
def test_a_keyed_permutation_of_a_large_domain_keeps_values_in_range_distinct_and_invertible(size):
    values = np.unique(np.random.default_rng(size).integers(0, size, 200_000))
    values = np.concatenate([values, [0, size - 1]])  # the domain's ends
    permutation = KeyedPermutation(size, (7, 1))
    images = permutation(values)
    assert images.min() >= 0 and images.max() < size
    assert len(np.unique(images)) == len(np.unique(values))
    assert np.array_equal(permutation.inverse(images), values)


def test_keyed_permutations_spread_every_value_evenly_over_keys():
    # Where sample 0 lands, over 4,000 keys: a chi-square test against uniform (99.9% quantile for 9 dof: 27.9).
    landing = np.array([KeyedPermutation(10, (key,))(np.array([0]))[0] for key in range(4000)])
    counts = np.bincount(landing, minlength=10)
    assert ((counts - 400) ** 2 / 400).sum() < 27.9, counts


orders = st.builds(
    dict,
    num_samples=st.integers(1, 3000), global_batch=st.integers(1, 300), shuffle=st.sampled_from(["none", "uniform",
                                                                                                  "block"]),
    seed=st.integers(0, 2**31), block_size=st.integers(1, 64), window=st.integers(1, 40),
).filter(lambda order: order["num_samples"] <= 60 * order["global_batch"])  # at most 60 steps an epoch
slow_examples = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@slow_examples
@given(settings_=orders, epoch=st.integers(0, 1000))
def test_every_sample_appears_once_per_epoch(settings_, epoch):
    order = EpochOrder(**settings_)
    samples = order.samples(epoch, np.arange(order.num_samples))
    assert np.array_equal(np.sort(samples), np.arange(order.num_samples))
    batches = [order.batch(epoch, step) for step in range(order.num_steps)]
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(order.num_samples))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_=orders, world_size=st.sampled_from([1, 2, 3, 4, 6]), remainder=st.sampled_from(["pad", "drop"]),
       epoch=st.integers(0, 5))
def test_the_global_batch_of_every_step_is_the_same_for_any_world_size(settings_, world_size, remainder, epoch):
    settings_["global_batch"] = settings_["global_batch"] // world_size * world_size or world_size
    order = EpochOrder(**settings_, remainder=remainder)
    for step in range(order.num_steps):
        alone = order.batch(epoch, step)
        shares = [order.batch(epoch, step, rank, world_size) for rank in range(world_size)]
        assert {len(share) for share in shares} == {order.global_batch // world_size}  # every rank a full batch
        assert np.array_equal(np.sort(np.concatenate(shares)), alone)


@given(settings_=orders)
def test_pad_wraps_to_the_start_and_drop_leaves_the_last_batch_out(settings_):
    padded, dropped = (EpochOrder(**settings_, remainder=remainder) for remainder in ("pad", "drop"))
    n, batch = padded.num_samples, padded.global_batch
    assert padded.num_steps == -(-n // batch) and dropped.num_steps == n // batch
    sequence = padded.samples(0, np.arange(padded.epoch_length))
    assert np.array_equal(sequence[n:], sequence[: padded.epoch_length - n] if n >= batch else
                          np.resize(sequence[:n], padded.epoch_length)[n:])
    assert np.array_equal(dropped.samples(0, np.arange(dropped.epoch_length)), sequence[: dropped.epoch_length])


def test_a_partial_last_batch_is_shared_only_where_ranks_split_it_evenly():
    order = EpochOrder(100, 32, remainder="partial")
    assert [len(order.batch(0, 3, rank, 2)) for rank in range(2)] == [2, 2]  # 4 samples left
    with pytest.raises(OptionError, match="last batch of 4 samples that 3 ranks cannot share evenly"):
        EpochOrder(100, 24, remainder="partial").batch(0, 4, 0, 3)
    with pytest.raises(OptionError, match=r"global batch \(32\) should be a multiple of the world size \(3\)"):
        order.batch(0, 0, 0, 3)


def test_epochs_and_seeds_give_different_orders_and_the_same_ones_again():
    def sequence(seed, epoch):
        return EpochOrder(1000, 10, seed=seed).samples(epoch, np.arange(1000))

    assert np.array_equal(sequence(1, 2), sequence(1, 2))
    assert not np.array_equal(sequence(1, 2), sequence(1, 3))
    assert not np.array_equal(sequence(1, 2), sequence(2, 2))


@slow_examples
@given(settings_=orders.filter(lambda s: s["shuffle"] == "block"), epoch=st.integers(0, 100))
@pytest.mark.slow
def test_a_window_reads_whole_blocks_and_holds_the_samples_of_its_positions(settings_, epoch):
    order = EpochOrder(**settings_)
    sequence = order.samples(epoch, np.arange(order.num_samples))
    windows = np.array([order.window_of(epoch, position) for position in range(order.num_samples)])
    assert np.all(np.diff(windows) >= 0)  # windows follow each other in the sequence
    for window in np.unique(windows):
        ranges = order.window_ranges(epoch, window)
        assert np.all(ranges[:, 0] % order.block_size == 0) and np.all(ranges[1:, 0] >= ranges[:-1, 1])
        held = np.concatenate([np.arange(start, stop) for start, stop in ranges])
        assert np.array_equal(np.sort(sequence[windows == window]), held)
        assert order.window_stop(epoch, window) == np.flatnonzero(windows == window)[-1] + 1  # its positions end


def test_block_shuffle_keeps_batches_mixed_on_a_class_sorted_dataset():
    # 100 classes of 1,000 consecutive samples; blocks of 21 samples (256 KiB of 64 px rows), 1,024 to a window.
    labels = np.repeat(np.arange(100), 1000)

    def classes_per_batch(**options):
        order = EpochOrder(len(labels), 256, **options)
        return np.mean([len(np.unique(labels[order.batch(0, step)])) for step in range(order.num_steps - 1)])

    uniform = classes_per_batch(shuffle="uniform")
    assert classes_per_batch(shuffle="block", block_size=21, window=1024) >= 0.9 * uniform
    assert classes_per_batch(shuffle="block", block_size=21, window=8) < 0.2 * uniform  # the bound can fail


def test_the_order_of_a_billion_samples_needs_no_permutation_of_them():
    import tracemalloc

    tracemalloc.start()
    try:
        batch = EpochOrder(10**9, 4096, shuffle="block", block_size=85, window=1024).batch(3, 123_456, 2, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(np.unique(batch)) == 512 and batch.max() < 10**9
    assert peak < 2 << 20, peak  # a permutation would be 8 GB


@given(num_samples=st.integers(0, 500), share=st.integers(1, 40), world_size=st.integers(1, 4),
       remainder=st.sampled_from(["partial", "pad", "drop"]), data=st.data())
def test_the_positions_of_a_range_of_steps_are_each_steps_positions(num_samples, share, world_size, remainder, data):
    # the sampler's chunks take a range of steps' positions as one array: the same as step by step
    order = EpochOrder(num_samples, share * world_size, remainder=remainder)
    rank = data.draw(st.integers(0, world_size - 1))
    first = data.draw(st.integers(0, max(order.num_steps - 1, 0)))
    steps = range(first, data.draw(st.integers(first, order.num_steps)))

    def one_by_one():
        return [list(order.step_positions(step, rank, world_size)) for step in steps]

    try:
        expected = one_by_one()
    except OptionError as error:  # a partial last batch the ranks cannot share: refused alike
        with pytest.raises(OptionError, match=re.escape(str(error))):
            order.steps_positions(steps, rank, world_size)
        return
    assert order.steps_positions(steps, rank, world_size).tolist() == (expected or [])
