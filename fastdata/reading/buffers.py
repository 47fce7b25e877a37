"""Batch arrays reused once nobody holds them any more."""

import sys
import threading
from contextlib import contextmanager

import numpy as np

_place = threading.local()  # see read_into


class BufferPool:
    """Batch arrays reused once nobody holds them any more.

    NOTE [buffer reuse]: a fresh multi-megabyte array per batch, while the
    caller still holds the previous batch, costs a page fault per 4 KiB
    (measured: 0.4M img/s at 64x64 against 1.5M for a copy into a warm
    buffer). A buffer is reused only when its reference count shows that no
    tensor, view or array made from it is alive, so a batch the caller keeps
    is never overwritten. Pinned batches are copies and are not pooled.
    """

    _FREE_REFS = 3  # the pool's list, the loop variable, getrefcount's argument

    def __init__(self, size=8):
        self._size = size
        self._arrays = []
        self._lock = threading.Lock()

    def take(self, shape, dtype):
        """Return an array of ``shape`` and ``dtype`` that nobody else references (inside ``read_into``, the first
        that fits its memory: a view of it)."""
        memory = getattr(_place, "memory", None)
        if memory is not None:
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if size <= memory.nbytes:
                _place.memory = None
                return memory[:size].view(dtype).reshape(shape)
        with self._lock:
            for array in self._arrays:
                if len(array) >= shape[0] and array.shape[1:] == shape[1:] and array.dtype == dtype:
                    if sys.getrefcount(array) == self._FREE_REFS:
                        return array[: shape[0]]
            array = np.empty(shape, dtype)
            if len(self._arrays) < self._size:
                self._arrays.append(array)
            return array


@contextmanager
def read_into(memory):
    """Have the first ``BufferPool.take`` on this thread that fits ``memory`` (a 1-D uint8 array) return a view of it.

    NOTE [read into the slot]: the helper process read each batch into a
    pooled array and then copied it into the shared slot the training
    process maps; a batch's images (its largest part) are instead read
    straight into the slot, so the copy is left out for them
    (``slots.write`` finds them in place). Pooled arrays are left alone:
    the slot's memory is never kept by a pool. Measured through
    make_loader(helper_process=True), batch 256, a tight loop, 4 / 3 rounds
    alternating fresh processes with the commit before (/tmp/hp/cpu.sh):
    64 px raw (one .h5 file), the helper's CPU 6.8-9.0 against 12.7-13.7 ms
    per 1,000 images and 84,000-155,000 against 70,000-78,000 img/s; 224 px
    JPEG (a shard folder) 448-460 against 481-488 ms and 3,453-3,926 against
    3,173-3,355 img/s. DataLoader workers read into their slots the same way
    (transport.py): 64 px raw, num_workers=2, 3 rounds (/tmp/hp/wcpu.py),
    the workers' CPU 11.4-12.3 against 14.6-15.5 ms per 1,000 images; the
    rate, 30,700-52,000 against 38,800-47,100 img/s, is the main process's
    (24.5-31.7 ms per 1,000 images in the DataLoader's machinery and the
    copy out of the slot), so it did not move.
    """
    _place.memory = memory
    try:
        yield
    finally:
        _place.memory = None
