"""The rows of a batch, grouped by the file that holds them: what the store hands a decoder."""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fastdata.formats import Columns
from fastdata.reading.gather import address, gather_int64, row_positions


class Part(NamedTuple):
    """The rows of one file in a batch: ``indices`` (int64, checked, in range) of ``columns``, read from ``path``."""

    columns: Columns
    indices: np.ndarray
    path: str


class Parts(Sequence):
    """The rows of a batch grouped by the file holding them: a sequence of Part, made only when asked for.

    Batch rows ``bounds[j]:bounds[j + 1]`` are rows ``indices[bounds[j]:bounds[j + 1]]``
    of ``columns[j]``, read from ``paths[j]``.

    NOTE [parts without objects]: a shuffled batch of 256 from a folder of
    ~32 shards has a part per shard. Making a Part (0.6 us) and a labels
    gather per part, then concatenating, cost about a tenth of the read rate;
    the raw decoder runs one loop over (columns, bounds) into one
    preallocated array, and ``labels`` gathers every part's labels in one
    call (see NOTE [address-space gather] in gather.py) from the address of
    each part's label column (``label_bases``, int64 ``[P]``: kept by the
    shard store, or taken from the columns).
    """

    __slots__ = ("_columns", "_indices", "_bounds", "_paths", "_label_bases", "_label_positions", "_expand",
                 "num_rows", "stitched", "_release", "_origin", "_keep")

    def __init__(self, columns, indices, bounds, paths, label_bases=None, origin=None):
        self._columns, self._indices, self._bounds, self._paths = columns, indices, bounds, paths
        self._label_bases, self._label_positions, self._expand = label_bases, None, None
        self.num_rows = bounds[-1]
        self.stitched, self._release = None, None  # see hold()
        self._origin, self._keep = origin, None  # see row_origin, of_stitched_rows

    @classmethod
    def of_stitched_rows(cls, view, rows, label_positions, expand, release, keep=None):
        """Return the Parts of a batch that is one take of ``view[rows]``, its labels at ``label_positions``.

        Its columns, indices, bounds and paths are ``expand()`` (a tuple of the four), made only
        when asked for (see NOTE [steady batches] in store.py); ``release`` as for ``hold``. ``keep``:
        the array the label addresses lie in, held as long as the Parts (a window's labels: the windows
        may be made anew meanwhile, and a gather from freed memory crashed the process).
        """
        parts = cls.__new__(cls)
        parts._label_bases, parts._label_positions, parts._expand = None, label_positions, expand
        parts.num_rows, parts.stitched, parts._release, parts._origin = len(rows), (view, rows), release, None
        parts._keep = keep
        return parts

    def row_origin(self, row):
        """Return ``(path, index)``: the file and the sample in it of batch ``row``, for error messages.

        Rows read from memory that holds them for a while (a window: windows.py) name the file they were read
        from through the ``origin`` the Parts were made with.
        """
        if self._origin is not None:
            return self._origin(row)
        part = int(np.searchsorted(self.bounds, row, side="right")) - 1
        return self.paths[part], int(self.indices[row])

    def _expanded(self):
        if self._expand is not None:
            self._columns, self._indices, self._bounds, self._paths = self._expand()
            self._expand = None
        return self

    columns = property(lambda self: self._expanded()._columns)
    indices = property(lambda self: self._expanded()._indices)
    bounds = property(lambda self: self._expanded()._bounds)
    paths = property(lambda self: self._expanded()._paths)

    def hold(self, release, stitched=None):
        """Keep the rows mapped until ``release()`` (see NOTE [stitched rows] in stitch.py).

        ``stitched``: ``(view, rows)`` where batch row ``i`` is also ``view[rows[i]]``, or None.
        """
        self.stitched, self._release = stitched, release

    def release(self):
        """Let the stitched rows go (after the batch is read); a no-op without them, or the second time."""
        release, self._release, self.stitched = self._release, None, None
        if release is not None:
            release()

    @classmethod
    def of(cls, parts):
        """Return ``parts`` (Parts, or any sequence of Part) as Parts."""
        if isinstance(parts, Parts):
            return parts
        indices = np.concatenate([np.empty(0, np.int64)] + [np.asarray(part.indices, np.int64) for part in parts])
        bounds = np.cumsum([0] + [len(part.indices) for part in parts]).tolist()
        return cls([part.columns for part in parts], indices, bounds, [part.path for part in parts])

    def __len__(self):
        return len(self.columns)

    def __getitem__(self, part):
        part = range(len(self.columns))[part]
        if isinstance(part, range):
            return [self[j] for j in part]
        return Part(self.columns[part], self.indices[self.bounds[part] : self.bounds[part + 1]], self.paths[part])

    @property
    def label_bases(self):
        """int64 ``[P]``: the ``address`` of each part's labels (see gather.py)."""
        if self._label_bases is None:
            self._label_bases = label_bases(self.columns)
        return self._label_bases

    def labels(self):
        """Return the int64 labels ``[B]`` of the batch's rows; call it before ``release``."""
        if self._label_positions is not None:  # one address per row, from the store
            return gather_int64(self._label_positions)
        if len(self.columns) == 1:  # one file: a take costs a third of the gather's address arithmetic
            return self.columns[0].labels.take(self.indices, mode="clip")
        return gather_int64(row_positions(self.label_bases, self.bounds, self.indices, 8))


def label_bases(columns):
    """Return int64 ``[P]``: the ``address`` of the label column of each of ``columns``."""
    return np.array([address(c.labels) for c in columns], np.int64)
