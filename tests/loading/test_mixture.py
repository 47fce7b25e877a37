"""fastdata.mix: datasets interleaved in set proportions in every window, drawn anew each epoch."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastdata import OptionError, make_loader, mix, open_dataset


class Sized:
    """A dataset of ``size`` samples whose sample ``i`` is ``(base + i)``, in int64 ``[B]`` tuple batches."""

    def __init__(self, size, base=0):
        self.size, self.base, self.fingerprint = size, base, f"sized-{size}-{base}"

    def __len__(self):
        return self.size

    def read_batch(self, indices, pin_memory=False):
        return (torch.as_tensor(np.asarray(indices) + self.base),)

    def max_batch_bytes(self, batch_size):
        return 8 * batch_size


@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=4), data=st.data(),
       period=st.integers(4, 300))
def test_every_window_holds_each_share_and_every_draw_cycles_its_source(sizes, data, period):
    weights = {f"s{number}": data.draw(st.floats(0.05, 20)) for number in range(len(sizes))}
    if period < len(sizes):
        return
    mixture = mix({name: Sized(size) for name, size in zip(weights, sizes)}, weights, period=period, seed=3,
                  length=3 * period + 17)
    assert mixture.counts.sum() == period and (mixture.counts >= 1).all()
    sources, samples = mixture.locate(np.arange(len(mixture)), epoch=1)
    for number, count in enumerate(mixture.counts.tolist()):
        mine = sources == number
        for start in range(0, len(mixture) - period + 1, max(1, period // 7)):  # any window of a period or less
            for width in (period, max(1, period // 3)):
                held = int(mine[start : start + width].sum())
                assert abs(held - width * count / period) < 2
        drawn = samples[mine]
        size = sizes[number]
        for cycle in range(0, len(drawn), size):  # each cycle through a source draws each sample once
            piece = drawn[cycle : cycle + size]
            assert len(set(piece.tolist())) == len(piece) and piece.max(initial=0) < size


def test_the_draws_are_the_same_anywhere_and_differ_by_epoch_and_seed():
    sources = {"a": Sized(50), "b": Sized(30, 1000)}
    one, two = mix(sources, {"a": 2, "b": 1}, seed=5), mix(sources, {"a": 2, "b": 1}, seed=5)
    positions = np.random.default_rng(0).permutation(len(one))
    assert np.array_equal(one.locate(positions, 2)[1], two.locate(positions, 2)[1])  # no state: any order
    assert not np.array_equal(one.locate(np.arange(80), 0)[1], one.locate(np.arange(80), 1)[1])
    assert not np.array_equal(one.locate(np.arange(80), 0)[1], mix(sources, {"a": 2, "b": 1}, seed=6).locate(
        np.arange(80), 0)[1])


def test_a_loader_over_mixed_image_files_gives_each_sources_samples_in_place(packed_files):
    raw, jpeg = open_dataset(packed_files("hdf5", "raw")), open_dataset(packed_files("arrow", "raw"))
    mixture = mix({"raw": raw, "other": jpeg}, {"raw": 1, "other": 3}, period=8, length=40)
    loader = make_loader(mixture, 8)
    for epoch in range(2):  # a new draw from each source every epoch
        for step, (images, labels) in enumerate(loader):
            sources, samples = mixture.locate(np.arange(step * 8, step * 8 + 8), epoch=epoch)
            assert (sources == 0).sum() == 2  # 1 in 4 of every 8 positions
            for row, (source, sample) in enumerate(zip(sources.tolist(), samples.tolist())):
                image, label = (raw, jpeg)[source][sample]
                assert torch.equal(images[row], image) and int(labels[row]) == label


def test_workers_ranks_and_resume_follow_the_positions(packed_files):
    sources = {"a": open_dataset(packed_files("hdf5", "raw")), "b": open_dataset(packed_files("arrow", "raw"))}
    mixture = mix(sources, {"a": 1, "b": 1}, seed=2)
    in_process = make_loader(mixture, 6)
    here = [batch[1].tolist() for _ in range(2) for batch in in_process]
    loader = make_loader(mixture, 6, num_workers=2)
    try:
        there = [batch[1].tolist() for _ in range(2) for batch in loader]
    finally:
        loader.close()
    assert there == here  # epochs 0 and 1: the workers draw what this process draws
    first = make_loader(mixture, 6)
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()
    resumed = make_loader(mix(sources, {"a": 1, "b": 1}, seed=2), 6)
    resumed.load_state_dict(state)
    assert [batch[1].tolist() for batch in resumed] == here[2 : len(here) // 2]
    with pytest.raises(OptionError):
        make_loader(mix(sources, {"a": 2, "b": 1}, seed=2), 6).load_state_dict(state)  # other weights: refused
    ranks = [[row for batch in make_loader(mixture, 3, rank=rank, world_size=2) for row in batch[1].tolist()]
             for rank in range(2)]
    assert sorted(ranks[0] + ranks[1]) == sorted(label for batch in make_loader(mixture, 6) for label in
                                                 batch[1].tolist())


def test_tokens_weigh_samples_by_their_mean_length_and_options_are_checked(packed_text, packed_files):
    short, long = open_dataset(packed_text("hdf5")), open_dataset(packed_text("arrow"))
    mixture = mix({"s": short, "l": long}, {"s": 1, "l": 1}, by="tokens", period=1000)
    ratio = mixture.counts[0] / mixture.counts[1]
    assert ratio == pytest.approx(np.mean(long.lengths) / np.mean(short.lengths), rel=0.01)
    image = open_dataset(packed_files("hdf5", "raw"))
    for kwargs, message in [
        ({"datasets": {"a": image}, "weights": {"b": 1}}, "weights should give every dataset a weight"),
        ({"datasets": {"a": image}, "weights": {"a": -1}}, "weights should be positive numbers"),
        ({"datasets": {"a": image}, "by": "bytes"}, r"by should be one of \('samples', 'tokens'\)"),
        ({"datasets": {"a": image}, "by": "tokens"}, "by='tokens' weighs samples by their tokens; 'a' is a 'image'"),
        ({"datasets": [image]}, "mix takes a dict of name -> dataset"),
    ]:
        datasets = kwargs.pop("datasets")
        with pytest.raises(OptionError, match=message):
            mix(datasets, **kwargs)
    with pytest.raises(OptionError, match="a Mixture shuffles its sources itself"):
        make_loader(mix({"a": image}), 4, shuffle=True)
