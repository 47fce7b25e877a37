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
the paths taken on folders the converter wrote.
"""

import warnings

from fastdata.errors import FastPathWarning

WINDOWS = "windows"  # a block order's window, read whole with direct I/O (windows.py)
STITCHED = "stitched"  # one take from the stitched rows of a folder's shards (stitch.py)
BY_SHARD = "by shard"  # a take per shard the batch touches
ONE_FILE = "one file"  # a packed file, or a folder of one shard
PATHS = (WINDOWS, STITCHED, BY_SHARD, ONE_FILE)


class ReadPaths:
    """Batches read by each of ``PATHS`` in this process, and the fallbacks warned about."""

    def __init__(self):
        self.counts = dict.fromkeys(PATHS, 0)
        self.fallbacks = {}  # reason key -> the message warned

    def count(self, path, batches=1):
        self.counts[path] += batches

    def fall_back(self, key, message):
        """Warn ``message`` (FastPathWarning) unless a fallback of ``key`` was warned about already."""
        if key not in self.fallbacks:
            self.fallbacks[key] = message
            warnings.warn(message, FastPathWarning, stacklevel=3)

    def __getstate__(self):  # another process counts its own batches
        return {"counts": dict.fromkeys(PATHS, 0), "fallbacks": dict(self.fallbacks)}
