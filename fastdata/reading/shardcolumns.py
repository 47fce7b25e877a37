"""The columns of a store's shards beside its batches: dataset-wide labels and lengths, the sample bytes in files.

ShardColumns is mixed into ShardStore (store.py): every shard's labels and lengths together (from the column files
beside the shards, else shard by shard), where each shard's sample column lies in its file, and the kernel's advice
and hints on those bytes.
"""

import os

import numpy as np

from fastdata.errors import FormatError
from fastdata.formats import column_offsets
from fastdata.formats.layout import bad_label_samples, format_samples, label_bounds
from fastdata.formats.shards import COLUMN_FILES, INDEX_NAME, parse_column
from fastdata.reading.kernel import advise_column, hint_spans, sharded_spans


class ShardColumns:
    """The columns of ShardStore's shards (store.py) as a whole and as bytes in their files, mixed into it.

    Uses the store's ``index``, ``source``, ``columns(shards)``, ``_path(shard)``, ``_cached`` (name -> a
    concatenated column), ``_advice``, ``_open``, ``_lock`` and ``_pid``.
    """

    def labels(self):
        """Return int64 labels ``[N]``: the file's memory map, or every shard's concatenated once."""
        if self.index.num_shards == 1:
            return self.columns([0])[0].labels
        return self._concatenated("labels", lambda columns: np.asarray(columns.labels))

    def lengths(self):
        """Return int64 stored lengths ``[N]`` of ragged samples, or None for fixed-size ones."""
        if self.index.num_shards == 1:
            offsets = self.columns([0])[0].offsets
            return None if offsets is None else np.diff(offsets)
        return self._concatenated("lengths", lambda columns: None if columns.offsets is None
                                  else np.diff(columns.offsets))

    def _concatenated(self, name, column):
        """Return ``column(columns)`` of every shard, concatenated, made once: from the column file the index
        lists (NOTE [column files] in formats/shards.py), else each shard read (through the cache)."""
        if name not in self._cached:
            entry = self.index.columns.get(name)
            if entry is not None:
                self._cached[name] = self._column_file(entry)
            else:
                parts = [column(self.columns([shard])[0]) for shard in range(self.index.num_shards)]
                self._cached[name] = None if parts and parts[0] is None else np.concatenate(
                    [np.empty(0, np.int64), *parts]).astype(np.int64)
        return self._cached[name]

    def _column_file(self, entry):
        """Return the column in the file of ``entry`` beside the shards, checked against it."""
        where = os.path.join(self.index.root, entry["name"])  # a path, or a URL (as index.path)
        data = self.source.read_file(entry["name"])
        values = parse_column(data, entry, self.index.num_samples, where)
        if entry["name"] == COLUMN_FILES["labels"] and len(bad := bad_label_samples(values, self.index.metadata)):
            raise FormatError(f"{where!r} holds labels outside {label_bounds(self.index.metadata)}, the classes its "
                              f"{INDEX_NAME} lists, at {format_samples(bad)}: the index's classes are cut short or the "
                              f'labels damaged. Run "fastdata verify {self.index.root}" for details, and convert again')
        return values

    def column_offsets(self, shard):
        """Return ``(samples, labels)``: the byte offsets of ``shard``'s sample and label columns in its file.

        The shard is opened (and checked) first.
        """
        self.columns([shard])
        return column_offsets(self._path(shard))

    def usual_remainder(self, modulo):
        """Return the most common sample column offset modulo ``modulo`` of the first, middle and last shards.

        The byte the stitched rows and the window reads lay their views out from (NOTE [stitched rows],
        NOTE [window reads]). Read without opening the shards: a shard that cannot be read so has no say
        (it is checked, and its damage reported, when it is opened). None where no shard could be read, or
        for a cached store (its shards are not fetched for this).
        """
        paths = self.source.local_paths
        if paths is None:
            return None
        last, remainders = self.index.num_shards - 1, []
        for shard in sorted({0, last // 2, last}):
            try:
                remainders.append(column_offsets(paths[shard])[0] % modulo)
            except (OSError, ValueError, FormatError):  # pyarrow's ArrowInvalid is a ValueError
                continue
        return max(remainders, key=remainders.count) if remainders else None

    def advise(self, pattern):
        """Set the access ``pattern`` ("random", "normal") of every shard's sample column: open ones and later ones."""
        self._advice = pattern
        if self._pid == os.getpid():
            with self._lock:
                for columns in self._open:
                    if columns is not None:
                        advise_column(columns.samples, pattern)

    def hint(self, ranges, hint, give=None):
        """Give the kernel a ``hint`` ("will_need", "done") on the sample bytes of int64 ``[K, 2]`` global ``ranges``.

        Returns whether it was asked (see ``hint_spans``, which ``give`` goes to); ``ranges`` are checked.
        """
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        if not len(ranges):
            return False
        starts, stops = sharded_spans(ranges, self.index.starts, lambda shards: (
            (columns.samples, columns.offsets) for columns in self.columns(shards)))
        return hint_spans(starts, stops, hint, give)
