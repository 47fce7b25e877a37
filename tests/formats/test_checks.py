"""The value checks of the layout (offsets, labels) against plain per-sample references (hypothesis)."""

from unittest import mock

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fastdata.formats import layout
from fastdata.formats.layout import bad_label_samples, bad_offset_samples, format_samples, sample_ranges

values = st.one_of(st.integers(-5, 60), st.sampled_from([-(2**63), -(2**40), 2**40, 2**63 - 1]))


def plain_bad_offsets(offsets, num_values, max_length=None):
    n = len(offsets) - 1
    bad = {i for i in range(n) if not 0 <= offsets[i] <= offsets[i + 1] <= num_values}
    if max_length is not None:
        bad |= {i for i in range(n) if offsets[i + 1] - offsets[i] > max_length}
    if n and offsets[0] != 0:
        bad.add(0)
    if n and offsets[-1] != num_values:
        bad.add(n - 1)
    return sorted(bad)


@given(st.lists(values, min_size=1, max_size=40), st.integers(0, 60), st.sampled_from([1, 3, 1 << 20]),
       st.one_of(st.none(), st.integers(0, 20)))
def test_bad_offsets_are_the_samples_whose_range_is_not_in_the_values(offsets, num_values, scan, max_length):
    with mock.patch.object(layout, "_SCAN", scan):  # numpy passes of any size give the same answer
        found = bad_offset_samples(np.array(offsets, np.int64), num_values, max_length)
    assert found.dtype == np.int64 and found.tolist() == plain_bad_offsets(offsets, num_values, max_length)


@given(st.lists(st.integers(0, 40), min_size=0, max_size=30), st.integers(0, 200))
def test_good_offsets_have_no_bad_sample(lengths, extra):
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    assert len(bad_offset_samples(offsets, int(offsets[-1]))) == 0
    if lengths:
        assert bad_offset_samples(offsets, int(offsets[-1]) + extra + 1).tolist() == [len(lengths) - 1]


@given(st.lists(values, max_size=40), st.integers(0, 6), st.sampled_from([1, 3, 1 << 20]))
def test_bad_labels_are_below_minus_one_or_past_the_classes(labels, num_classes, scan):
    metadata = {"classes": [f"c{i}" for i in range(num_classes)]}
    with mock.patch.object(layout, "_SCAN", scan):
        found = bad_label_samples(np.array(labels, np.int64), metadata)
        unbounded = bad_label_samples(np.array(labels, np.int64), {})
    assert found.tolist() == [i for i, label in enumerate(labels) if not -1 <= label < num_classes]
    assert unbounded.tolist() == [i for i, label in enumerate(labels) if label < -1]


@given(st.sets(st.integers(0, 100)), st.integers(1, 5))
def test_sample_ranges_are_the_maximal_runs(indices, limit):
    indices = sorted(indices)
    ranges = sample_ranges(indices)
    assert [i for start, stop in ranges for i in range(start, stop)] == indices
    assert all(stop < next_start for (_, stop), (next_start, _) in zip(ranges, ranges[1:]))
    if indices:
        text = format_samples(indices, limit)
        assert text.startswith("sample " if len(indices) == 1 else "samples ")
        assert ("more ranges" in text) == (len(ranges) > limit)
