"""The fixed-size rows of many shards placed in one address range, so that a batch spanning shards is one take.

NOTE [stitched rows]: a shuffled batch of 256 from a folder of ~33 shards
has a part per shard. Its parts and a numpy take per part cost 494-542 us a
batch, against 395-440 us for one take of the same rows from one file (raw
64 px, best and median of 15 interleaved rounds on 2 shared cores): the
per-call overhead, and the cold caches each small call meets after the
batch's copies. Instead, each open shard's sample column is mapped into its
slot of one reserved address range (its own map of the column is dropped),
so that every row of every open shard is a row of one ``[R, *row shape]``
array and the batch's rows are one ``np.take`` of ``slot + row``: 381-432 us
for the 33-shard batch above, the parts included.
A shard's file offset is kept modulo the page size in its slot, so a
shard is mapped only where its column's offset has the view's remainder
modulo the page: the one most of the folder's shards have (probed on the
first, middle and last when the range is reserved), 0 in every folder the
converter writes now (NOTE [aligned columns] in formats/layout.py). HDF5
and Arrow columns are both plain byte ranges of their files. A shard whose
column lies elsewhere (shard 0 of a folder written before, 8 bytes apart)
has its rows read into its slot instead, anonymous memory, up to
COPY_BYTES in all, and says so once (FastPathWarning); past that, or where
the kernel refuses the range, the shard is not stitched and the batches
that touch it are read part by part, said once too.

Slots are not unmapped while a batch that may read them is in flight: a
closed shard's slot is retired and unmapped (replaced by an inaccessible
reservation, so a stray read faults instead of reading another shard) once
no lease is held. The range is reserved with PROT_NONE and MAP_NORESERVE:
address space only, no memory and no commit charge; it is released when the
last array viewing it goes away.
"""

import ctypes
import os
import threading
import weakref

import numpy as np

from fastdata.formats import Columns, column_offsets
from fastdata.reading import kernel
from fastdata.reading.kernel import PAGE
from fastdata.reading.readpaths import BY_SHARD

COPY_BYTES = 512 << 20  # the most bytes of shards whose columns lie off the view's pages read into memory instead


class StitchedRows:
    """Slots in one reserved address range for the rows of every shard (see NOTE [stitched rows]).

    Args:
        counts: int64 ``[S]`` rows of each shard.
        row_shape: the shape of one row, e.g. ``(3, 64, 64)``.
        dtype: the rows' dtype.
        read_paths: the store's ReadPaths, warned through where a shard cannot be stitched.
    """

    def __init__(self, counts, row_shape, dtype, read_paths):
        self.row_shape, self.dtype = tuple(row_shape), np.dtype(dtype)
        self.row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        step = PAGE // int(np.gcd(self.row_bytes, PAGE))  # slots start on pages: multiples of this many rows
        extra = -(-PAGE // self.row_bytes)  # room for the column's offset within its first page
        sizes = -(-(np.asarray(counts, np.int64) + extra) // step) * step
        self.slots = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        self._counts, self._total_rows = np.asarray(counts, np.int64), int(sizes.sum())
        self._slot_bases = self.slots - np.concatenate(([0], np.cumsum(self._counts)[:-1]))  # slot - first index
        self.enabled = kernel.available() and self.row_bytes > 0
        self.read_paths = read_paths
        self._reset()

    def _reset(self):
        self.view, self._base, self._residue, self._pid = None, None, None, os.getpid()
        self._mapped, self._retired, self._leases = np.zeros(len(self._counts), bool), set(), 0
        self._copied = {}  # shard -> bytes of its rows read into its slot (its column lies off the view's pages)
        self._kept = []  # the Columns of closed shards, alive (label maps included) until no lease is held
        self._lock = threading.Lock()

    def __getstate__(self):  # another process reserves its own range
        return {**self.__dict__, "view": None, "_base": None, "_lock": None, "_mapped": None, "_retired": set(),
                "_kept": [], "_copied": {}}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def _own(self):
        """In a forked process: the inherited range and maps stay; each slot counts as mapped once mapped again."""
        if self._pid != os.getpid():
            self._mapped, self._retired, self._leases, self._pid = np.zeros_like(self._mapped), set(), 0, os.getpid()
            self._kept, self._lock, self._copied = [], threading.Lock(), {}

    def place(self, shard, columns, path, usual_remainder):
        """Return ``shard``'s Columns with their sample rows read from its slot, or ``columns`` where they cannot be.

        ``path`` is the shard's file; ``usual_remainder(PAGE)`` the column offset modulo the page most
        shards have (or None), which the first call takes for the view's (see NOTE [stitched rows]).
        One map of the rows, not two: the kernel hints of readahead.py (access pattern, reclaim) act on
        the pages of one mapping; the shard's own map of the rows is dropped with ``columns``.
        """
        if not self.map(shard, columns.samples, path, usual_remainder):
            return columns
        start = int(self.slots[shard])
        return Columns(self.view[start : start + int(self._counts[shard])], columns.labels, columns.offsets)

    def map(self, shard, column, path, usual_remainder):
        """Map ``shard``'s rows (``column``, in the file ``path``) into its slot; return False where they cannot be."""
        self._own()
        source = next((array for array in (column, column.base) if isinstance(array, np.memmap)), None)  # or a view
        if not self.enabled or column.dtype != self.dtype or column.shape[1:] != self.row_shape:
            return self._disable(f"its rows are not {self.dtype} {list(self.row_shape)} like the first shard's")
        if len(column) != self._counts[shard]:
            return self._disable(f"shard {shard} holds {len(column)} rows, its index says {int(self._counts[shard])}")
        offset = int(source.offset) if source is not None else int(column_offsets(path)[0])
        with self._lock:
            if self._residue is None:
                usual = usual_remainder(PAGE)
                self._residue = offset % PAGE if usual is None else usual
                if not self._reserve():
                    return self._disable("the kernel refused to reserve an address range for the rows")
            self._retired.discard(shard)
            if offset % PAGE != self._residue:
                return self._copy_file(shard, path, offset)
            return self._map_file(shard, path, offset) or self._disable(f"shard {shard}'s rows could not be mapped")

    def retire(self, shard, columns):
        """Mark ``shard``'s slot for unmapping once no lease is held (its shard was closed).

        ``columns``, the closed shard's, stay referenced until then too: a batch in flight may read
        its labels by address (NOTE [steady batches] in store.py).
        """
        self._own()
        with self._lock:
            if self._mapped[shard]:
                self._retired.add(shard)
                self._kept.append(columns)
                self._settle()

    def lease(self):
        """Keep every mapped slot in place until ``release`` (a batch is being read)."""
        self._own()
        with self._lock:
            self._leases += 1

    def release(self):
        with self._lock:
            self._leases -= 1
            self._settle()

    def rows(self, shards, indices):
        """Return the view's int64 rows of global sample ``indices`` of ``shards`` (both ``[B]``; mapped shards)."""
        return self._slot_bases[shards] + indices

    def covers(self, shards):
        """Return whether every one of ``shards`` (int64 ``[P]``) is mapped."""
        self._own()
        return self.enabled and self.view is not None and bool(self._mapped[shards].all())

    def _disable(self, why):
        """Stitch no more shards (``why`` is warned about once); return False."""
        if self.enabled:
            self.read_paths.fall_back("stitch", f"the shards' rows are not stitched into one array: {why}. Batches "
                                      f"are read '{BY_SHARD}', a take per shard (1.1-1.3x slower measured)")
        self.enabled = False
        return False

    def _reserve(self):
        size = self._total_rows * self.row_bytes + PAGE
        base = kernel.reserve(size)
        if base is None:
            return False
        memory = (ctypes.c_char * (self._total_rows * self.row_bytes)).from_address(base + self._residue)
        self.view = np.ndarray((self._total_rows, *self.row_shape), self.dtype, buffer=memory)
        weakref.finalize(self.view, kernel.release, base, size)  # the range lives as long as any view of it
        self._base = base
        return True

    def _map_file(self, shard, filename, offset):
        start = self._base + int(self.slots[shard]) * self.row_bytes  # a page: slots start on pages
        length = self._residue + int(self._counts[shard]) * self.row_bytes
        fd = os.open(filename, os.O_RDONLY)
        try:
            mapped = kernel.map_file_at(start, length, fd, offset - self._residue)
        finally:
            os.close(fd)
        if not mapped:
            return False
        self._mapped[shard] = True
        return True

    def _copy_file(self, shard, path, offset):
        """Read the rows of ``shard``, whose column lies off the view's pages, into its slot (see NOTE [stitched rows]).

        Returns False, warned once, where COPY_BYTES would be passed or the kernel refuses the memory.
        """
        count, nbytes = int(self._counts[shard]), int(self._counts[shard]) * self.row_bytes
        where = f"shard {shard} ({path!r}) has its rows at byte {offset}, not at {self._residue} modulo {PAGE}"
        if sum(self._copied.values()) + nbytes > COPY_BYTES:
            self.read_paths.fall_back("stitch copies", (
                f"{where}, and the rows of such shards already read into memory fill {COPY_BYTES >> 20} MiB: it is "
                f"not stitched, and the batches that touch it are read '{BY_SHARD}' (1.1-1.3x slower measured). "
                "Convert the folder again to align every shard (NOTE [aligned columns])"))
            return False
        start = self._base + int(self.slots[shard]) * self.row_bytes
        if not kernel.memory_at(start, self._residue + nbytes):
            return self._disable(f"shard {shard}'s slot could not be given memory")
        rows = memoryview(self.view[int(self.slots[shard]) : int(self.slots[shard]) + count]).cast("B")
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < nbytes:
                read = os.preadv(f.fileno(), [rows[done:]], offset + done)
                if not read:
                    raise EOFError(f"{path!r} ended before its {count} rows were read")
                done += read
        self._copied[shard] = nbytes
        self._mapped[shard] = True
        self.read_paths.fall_back("stitch copies", (
            f"{where}: its rows are read into memory ({nbytes / 1e6:.0f} MB) to be stitched with the others, as is "
            "any other such shard. Convert the folder again to align every shard (NOTE [aligned columns])"))
        return True

    def _settle(self):
        """Unmap the retired slots and let the kept Columns go if no batch holds a lease (under the lock)."""
        if self._leases:
            return
        self._kept.clear()
        for shard in self._retired:
            start = self._base + int(self.slots[shard]) * self.row_bytes
            length = self._residue + int(self._counts[shard]) * self.row_bytes
            kernel.unmap_at(start, length)
            self._mapped[shard] = False
            self._copied.pop(shard, None)
        self._retired.clear()
