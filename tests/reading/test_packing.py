"""The best-fit plan of whole documents into rows (NOTE [best-fit rows]): from lengths alone, property-tested."""

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fastdata.reading.packing import best_fit_rows


@given(lengths=st.lists(st.integers(0, 60), max_size=80), seq_len=st.integers(1, 40))
def test_rows_hold_whole_documents_and_every_label_once(lengths, seq_len):
    row_starts, documents, starts, stops = best_fit_rows(np.array(lengths, np.int64), seq_len)
    capacity = seq_len + 1
    loads = np.add.reduceat(stops - starts, row_starts[:-1]) if len(documents) else np.zeros(0, np.int64)
    assert (loads <= capacity).all() and (np.diff(row_starts) > 0).all()
    assert (loads <= capacity / 2).sum() <= 1  # every row but at most one more than half full
    labels = Counter()
    for document, length in enumerate(lengths):
        mine = np.flatnonzero(documents == document)
        pieces = sorted(zip(starts[mine].tolist(), stops[mine].tolist()))
        if length + 1 <= capacity and length:  # fits a row: one piece, whole
            assert pieces == [(0, length + 1)]
        for start, stop in pieces:
            assert 0 <= start < stop <= length + 1 and stop - start >= 2
            labels.update((document, position) for position in range(start + 1, stop))
    expected = Counter((document, position) for document, length in enumerate(lengths)
                       for position in range(1, length + 1))
    assert labels == expected  # every token but a document's first is a label exactly once


def test_the_plan_depends_on_the_lengths_only():
    lengths = np.random.default_rng(4).integers(0, 300, 2000)
    first, again = best_fit_rows(lengths, 128), best_fit_rows(lengths.copy(), 128)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    loads = np.add.reduceat(first[3] - first[2], first[0][:-1])
    assert loads.mean() > 0.95 * 129  # best fit decreasing fills these rows nearly whole
