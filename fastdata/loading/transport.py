"""Batches from worker processes through reused shared-memory slots.

NOTE [slot transport]: a stock DataLoader worker returns each batch in a
newly allocated shared-memory tensor: the worker creates a segment, passes
its file descriptor, and the main process maps and later unmaps it, for
every batch. Measured on a 2-core machine that ran packed 64x64 batches
about 30 times slower than reading them in one process. Here each worker
owns a few shared buffers ("slots") allocated once before the workers
start; it writes a batch into a free slot and returns a small SlotBatch
naming it (its images read straight into the slot: NOTE [read into the
slot] in buffers.py). The main process (or the pin-memory thread) copies
the batch out into ordinary or pinned memory and frees the slot at once,
so a batch the user keeps is never overwritten. A batch that does not fit,
or finds no free slot in time, travels the stock way.
"""

import itertools
import os
import time
import weakref
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastdata.loading import slots as layouts
from fastdata.reading.buffers import BufferPool, read_into

_WAIT_SECONDS = 5.0  # then give up on slots for this batch and return it as is
_LIVE = weakref.WeakValueDictionary()  # key -> SharedSlots, in the main process
_KEYS = itertools.count()


class SharedSlots:
    """``slots_per_worker`` reusable byte buffers for each worker, each holding a batch of ``batch_bytes``.

    Create it in the main process before the workers start; it travels to
    them inside the dataset. Batches come back as SlotBatch references.

    Args:
        num_workers: DataLoader workers.
        slots_per_worker: buffers per worker (batches in flight + 1).
        batch_bytes: the most bytes of a batch's tensors (``dataset.max_batch_bytes``);
            larger batches bypass slots.
    """

    def __init__(self, num_workers: int, slots_per_worker: int, batch_bytes: int):
        slot_bytes = layouts.slot_bytes(batch_bytes)
        self.key = f"{os.getpid()}-{next(_KEYS)}"
        self.buffers = torch.empty((num_workers, slots_per_worker, slot_bytes), dtype=torch.uint8).share_memory_()
        self.busy = torch.zeros((num_workers, slots_per_worker), dtype=torch.int32).share_memory_()
        self.unpacked = BufferPool()  # the main process's batch memory, reused once dropped
        _LIVE[self.key] = self

    def __getstate__(self):  # workers get the shared tensors, not the main process's pool
        return {**self.__dict__, "unpacked": None}

    @contextmanager
    def packing(self):
        """In a worker: yield ``pack(batch)``, which puts a batch read inside the block into a free slot and returns
        its SlotBatch; the batch's images are read straight into the slot (NOTE [read into the slot] in buffers.py).

        ``batch`` is a tuple of tensors, or a dict batch of records, whose values that are not tensors
        (text, JSON) travel pickled beside the slot's name (slots.split). Outside a worker, with no slot free
        in time, or for a batch the slot cannot hold, ``pack`` returns the batch itself.
        """
        info = get_worker_info()
        slot = None if info is None else self._free_slot(info.id)
        if slot is None:
            yield lambda batch: batch
            return
        with read_into(self.buffers[info.id, slot].numpy()):
            yield partial(self._pack, info.id, slot)

    def _pack(self, worker, slot, batch):
        buffer = self.buffers[worker, slot]
        tensors, shape = layouts.split(batch)
        layout, end = layouts.layout_of(tensors, buffer)
        if end > len(buffer):
            return layouts.joined(layouts.moved_out(tensors, buffer), shape)
        placed = layouts.write(buffer, tensors, layout)
        self.busy[worker, slot] = 1
        return SlotBatch(self.key, worker, slot, layout, shape, placed)

    def _free_slot(self, worker):
        deadline = time.monotonic() + _WAIT_SECONDS
        while True:
            free = (self.busy[worker] == 0).nonzero()
            if len(free):
                return int(free[0])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0002)


class SlotBatch:
    """A batch waiting in a worker's shared slot (a few bytes to pickle, and a dict batch's text)."""

    def __init__(self, key, worker, slot, layout, shape, placed=0):
        self.key, self.worker, self.slot, self.layout, self.shape = key, worker, slot, layout, shape
        self.placed = placed  # tensors read straight into the slot: NOTE [read into the slot] in buffers.py

    def unpack(self, pin_memory=False):
        """In the main process: copy the batch out (a tuple of tensors, or a dict batch), free the slot."""
        slots = _LIVE[self.key]
        buffer = slots.buffers[self.worker, self.slot]
        out = []
        for dtype, shape, strides, start in self.layout:
            if pin_memory:  # pinned batches are not pooled (see NOTE [buffer reuse])
                tensor = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)
            else:
                memory = torch.from_numpy(slots.unpacked.take((layouts.nbytes(dtype, shape),), np.uint8))
                tensor = layouts.view(memory, 0, dtype, shape, strides)
            tensor.copy_(layouts.view(buffer, start, dtype, shape, strides))
            out.append(tensor)
        slots.busy[self.worker, self.slot] = 0
        return layouts.joined(out, self.shape)

    def pin_memory(self):
        # DataLoader's pin-memory thread calls this: copy straight into pinned memory.
        return self.unpack(pin_memory=True)
