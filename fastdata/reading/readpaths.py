"""Which way each batch of a dataset was read, counted, and a warning the first time a fast path cannot apply.

NOTE [no silent fallbacks]: a shard folder written by the converter put
shard 0's pixels 8 bytes from every other shard's; the window reader
caught the error laying out the first window and read all 282 batches of
the run sample by sample through the memory map, at 0.035 of the disk,
without a word, and the benchmark could not see it (it measured copies of
one shard). Now every batch a store reads is counted under the path it
took (``PATHS``), ``dataset.read_paths()`` and ``fastdata.profile`` show
the counts, and a fast path that cannot apply to data that asked for it
warns once (FastPathWarning) with the reason and what it costs. Tests count
the paths taken on folders the converter wrote. A helper process reads for
the training process (NOTE [helper process] in helper.py): its counts add
into the training process's through a shared tally, and what it would warn
is warned in the training process, where the user's filters apply (NOTE
[paths read elsewhere] in helper.py).
"""

import warnings

from fastdata.errors import FastPathWarning

WINDOWS = "windows"  # a block order's window, read whole with direct I/O (windows.py)
STITCHED = "stitched"  # one take from the stitched rows of a folder's shards (stitch.py)
BY_SHARD = "by shard"  # a take per shard the batch touches
ONE_FILE = "one file"  # a packed file, or a folder of one shard
PATHS = (WINDOWS, STITCHED, BY_SHARD, ONE_FILE)


class ReadPaths:
    """Batches read by each of ``PATHS`` for this process (here, or by its helper processes), and the fallbacks
    warned about."""

    def __init__(self):
        self.counts = dict.fromkeys(PATHS, 0)  # read in this process
        self.fallbacks = {}  # reason key -> the message warned
        self._tallies = []  # a helper process's counts: int64 [len(PATHS)] each, in shared memory

    def count(self, path, batches=1):
        self.counts[path] += batches

    def totals(self):
        """Return the batches read by each path, here and by every helper process added with ``add_tally``."""
        totals = dict(self.counts)
        for tally in self._tallies:
            for path, count in zip(PATHS, tally.tolist()):
                totals[path] += count
        return totals

    def add_tally(self, tally):
        """Count in ``totals`` what another process reads for this one: ``tally`` is its int64 ``[len(PATHS)]``."""
        self._tallies.append(tally)

    def fold_tally(self, tally):
        """Keep what ``tally`` (added before) counted as this process's own counts, and let it go."""
        for path, count in zip(PATHS, tally.tolist()):
            self.counts[path] += count
        self._tallies = [kept for kept in self._tallies if kept is not tally]

    def fall_back(self, key, message):
        """Warn ``message`` (FastPathWarning) unless a fallback of ``key`` was warned about already."""
        if key not in self.fallbacks:
            self.fallbacks[key] = message
            warnings.warn(message, FastPathWarning, stacklevel=3)

    def __getstate__(self):  # another process counts its own batches
        return {"counts": dict.fromkeys(PATHS, 0), "fallbacks": dict(self.fallbacks), "_tallies": []}
