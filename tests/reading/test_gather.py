"""The address-space gather of int64 values from many arrays (gather.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdata.reading.gather import address, gather_int64, row_positions


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), data=st.data())
def test_one_gather_equals_a_take_per_array(tmp_path_factory, sizes, data):
    root = tmp_path_factory.mktemp("maps")
    arrays = []
    for k, size in enumerate(sizes):  # memory maps (as shards are) and plain arrays, apart in the address space
        values = np.random.default_rng(k).integers(-(2**62), 2**62, size)
        if k % 2:
            mapped = np.lib.format.open_memmap(root / f"{k}.npy", mode="w+", dtype=np.int64, shape=(size,))
            mapped[:] = values
            values = np.asarray(mapped)
        arrays.append(values)
    counts = [data.draw(st.integers(0, 20)) for _ in sizes]
    rows = np.concatenate([np.sort(data.draw(st.lists(st.integers(0, size - 1), min_size=n, max_size=n)))
                           for size, n in zip(sizes, counts)]).astype(np.int64)
    bounds = np.cumsum([0, *counts]).tolist()
    bases = np.array([address(array) for array in arrays], np.int64)
    got = gather_int64(row_positions(bases, bounds, rows, 8))
    expected = np.concatenate([array[rows[a:b]] for array, a, b in zip(arrays, bounds, bounds[1:])])
    assert got.dtype == np.int64 and np.array_equal(got, expected)


def test_an_array_with_gaps_between_its_rows_is_refused():
    with pytest.raises(ValueError, match="C-contiguous"):
        address(np.arange(10, dtype=np.int64)[::2])
