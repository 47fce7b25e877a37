"""Batches from worker processes through reused shared-memory slots.

NOTE [slot transport]: a stock DataLoader worker returns each batch in a
newly allocated shared-memory tensor: the worker creates a segment, passes
its file descriptor, and the main process maps and later unmaps it, for
every batch. Measured on a 2-core machine that ran packed 64x64 batches
about 30 times slower than reading them in one process. Here each worker
owns a few shared buffers ("slots") allocated once before the workers
start; it writes a batch into a free slot and returns a small SlotBatch
naming it. The main process (or the pin-memory thread) copies the batch out
into ordinary or pinned memory and frees the slot at once, so a batch the
user keeps is never overwritten. A batch that does not fit, or finds no
free slot in time, travels the stock way.
"""

import itertools
import math
import os
import time
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastdata.reading.buffers import BufferPool

_WAIT_SECONDS = 5.0  # then give up on slots for this batch and return it as is
TENSOR_ALIGN = _ALIGN = 64  # each tensor starts on a cache line, so any dtype view is aligned
_MAX_TENSORS = 4  # alignment room per slot: a batch has 2 tensors (images, labels) or 3 (tokens, lengths, labels)
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
        slot_bytes = batch_bytes + _MAX_TENSORS * _ALIGN  # each tensor starts aligned, see _layout
        self.key = f"{os.getpid()}-{next(_KEYS)}"
        self.buffers = torch.empty((num_workers, slots_per_worker, slot_bytes), dtype=torch.uint8).share_memory_()
        self.busy = torch.zeros((num_workers, slots_per_worker), dtype=torch.int32).share_memory_()
        self.unpacked = BufferPool()  # the main process's batch memory, reused once dropped
        _LIVE[self.key] = self

    def __getstate__(self):  # workers get the shared tensors, not the main process's pool
        return {**self.__dict__, "unpacked": None}

    def pack(self, batch):
        """In a worker: copy the tensors of ``batch`` into a free slot; return a SlotBatch, or ``batch``.

        ``batch`` is a tuple of tensors, or a dict batch of records, whose values that are not tensors
        (text, JSON) travel pickled beside the slot's name.
        """
        if isinstance(batch, dict):
            names = [name for name, value in batch.items() if isinstance(value, torch.Tensor)]
            packed = self._pack_tensors([batch[name] for name in names])
            if isinstance(packed, SlotBatch):
                packed.names, packed.rest = list(batch), {n: v for n, v in batch.items() if n not in names}
                return packed
            return batch
        return self._pack_tensors(batch)

    def _pack_tensors(self, tensors):
        info = get_worker_info()
        starts, end = _layout(tensors)
        if info is None or end > self.buffers.shape[2]:
            return tensors
        slot = self._free_slot(info.id)
        if slot is None:
            return tensors
        buffer = self.buffers[info.id, slot]
        layout = [(t.dtype, tuple(t.shape), _dense_strides(t), start) for t, start in zip(tensors, starts)]
        for tensor, (dtype, shape, strides, start) in zip(tensors, layout):
            _view(buffer, start, dtype, shape, strides).copy_(tensor)  # same strides: a plain copy
        self.busy[info.id, slot] = 1
        return SlotBatch(self.key, info.id, slot, layout)

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
    """A batch waiting in a worker's shared slot (a few bytes to pickle)."""

    def __init__(self, key, worker, slot, layout):
        self.key, self.worker, self.slot, self.layout = key, worker, slot, layout
        self.names, self.rest = None, None  # a dict batch's keys in order, and its values that are not tensors

    def unpack(self, pin_memory=False):
        """In the main process: copy the batch out (a tuple of tensors, or a dict batch), free the slot."""
        slots = _LIVE[self.key]
        buffer = slots.buffers[self.worker, self.slot]
        out = []
        for dtype, shape, strides, start in self.layout:
            if pin_memory:  # pinned batches are not pooled (see NOTE [buffer reuse])
                tensor = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)
            else:
                memory = torch.from_numpy(slots.unpacked.take((_nbytes(dtype, shape),), np.uint8))
                tensor = _view(memory, 0, dtype, shape, strides)
            tensor.copy_(_view(buffer, start, dtype, shape, strides))
            out.append(tensor)
        slots.busy[self.worker, self.slot] = 0
        if self.names is None:
            return tuple(out)
        tensors = iter(out)
        return {name: self.rest[name] if name in self.rest else next(tensors) for name in self.names}

    def pin_memory(self):
        # DataLoader's pin-memory thread calls this: copy straight into pinned memory.
        return self.unpack(pin_memory=True)


def _layout(tensors):
    starts, end = [], 0
    for tensor in tensors:
        starts.append(end)
        end += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return starts, end


def _dense_strides(tensor):
    """Return ``tensor``'s strides if it is channels_last, else contiguous ones.

    Keeping that layout makes both copies plain memory copies (a JPEG batch
    is a channels_last view, see NOTE [channels last] in decoders.py).
    """
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor.stride()
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _view(buffer, start, dtype, shape, strides):
    """View uint8 ``buffer`` from byte ``start`` as a dense tensor of ``dtype``, ``shape`` and ``strides``."""
    return buffer[start : start + _nbytes(dtype, shape)].view(dtype).as_strided(shape, strides)


def _nbytes(dtype, shape):
    return math.prod(shape) * dtype.itemsize
