"""Copying host batches to a CUDA device: page-locked staging slots, a side stream, events the consumer waits on.

The DevicePipeline (device.py) copies through a CudaCopier; on the CPU it copies nothing.
"""

import torch


class CudaCopier:
    """Copy host batches to a CUDA device through ``slots`` page-locked buffers reused round-robin.

    NOTE [pinned slots]: a copy from pageable memory is synchronous (the
    driver stages it through its own pinned buffer), so each host batch is
    first copied (a memcpy on the host) into the next of ``slots`` pinned
    buffers, allocated once and grown as needed, then copied to the device
    with ``non_blocking=True``. A slot is rewritten only after its previous
    copy finished: each slot keeps the CUDA event recorded after its copy,
    and the host waits on that event before refilling it. The pipeline keeps
    ``ahead`` copies in flight, so with ``ahead + 2`` slots the slot about to
    be refilled was last copied ``ahead + 1`` batches ago and its event has
    (almost always) fired: the wait costs nothing. A batch already pinned
    (``pin_memory=True``) is copied from where it is: torch's pinned host
    allocator keeps such a block until the copies using it are done.

    NOTE [pinned reads]: with a CUDA device make_loader reads into pinned
    memory by default (``pin_memory=None`` -> True), so the read-ahead
    thread (or the DataLoader's pin thread) writes the batch where the copy
    starts and the staging memcpy above runs only for batches that arrive
    unpinned (``pin_memory=False``, a helper process's slots), not in the
    training thread inside ``next()``. Measured on an H200 with 16 CPUs
    (gpu-check, batches of 256 x 3 x 256 x 256 uint8, 50 MB): make_loader
    delivered 6.29 GB/s staged, 6.87 and 6.68 GB/s (two runs) reading
    pinned, against 55.3 for a plain pinned ``copy_``: no gain that shows,
    since the limit is the host read itself (the same raw file read alone,
    batches of 128: 23,300-28,100 img/s, 4.6-5.5 GB/s).

    NOTE [copy stream]: copies are issued on a side stream, so they overlap
    with the kernels of the training step on the consumer's stream. The
    device tensors are allocated on the side stream; before the consumer
    gets a batch, its stream waits for the batch's event (``wait_event``: no
    kernel of the step reads the batch before its copy is done, and the host
    does not block), and ``record_stream`` tells the caching allocator that
    the consumer's stream uses the tensors, so their memory is not handed
    to the side stream for a later batch until the step's kernels that read
    them finished. Not measured: no GPU on this machine.
    """

    def __init__(self, device, slots):
        self.device = device
        self.stream = None  # made on the first copy: making a loader does not start CUDA
        self.slots = StagingSlots(slots, _pinned)
        self._events = [None] * slots  # slot -> event of its last copy

    def copy(self, tensors):
        """Issue the copies of ``tensors`` on the side stream; return ``(device tensors, event)``."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        slot = self.slots.take()
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # see NOTE [pinned slots]: its last copy is done
        staged = [tensor if tensor.is_pinned() else self.slots.stage(slot, k, tensor)
                  for k, tensor in enumerate(tensors)]
        with torch.cuda.stream(self.stream):
            moved = [tensor.to(self.device, non_blocking=True) for tensor in staged]
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[slot] = event
        return moved, event

    def wait(self, tensors, event):
        """Make the consumer's stream wait for ``event`` and own ``tensors`` (see NOTE [copy stream])."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(consumer)
        return tensors


def _pinned(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class StagingSlots:
    """``count`` sets of host buffers, taken round-robin, each holding one batch (see NOTE [pinned slots]).

    Args:
        count: slots.
        allocate: ``allocate(nbytes) -> uint8 tensor [nbytes]`` (page-locked for CUDA copies).
    """

    def __init__(self, count: int, allocate):
        self._buffers = [[] for _ in range(count)]  # slot -> flat uint8 buffers, one per tensor of a batch
        self._allocate = allocate
        self._next = 0

    def take(self) -> int:
        """Return the next slot, round-robin; the caller makes sure its last use is over."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        return slot

    def stage(self, slot: int, k: int, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into buffer ``k`` of ``slot`` (grown as needed); return that view, same shape and strides.

        A tensor with gaps in its memory (a slice) is staged contiguous.
        """
        buffers, nbytes = self._buffers[slot], tensor.numel() * tensor.element_size()
        buffers.extend(torch.empty(0, dtype=torch.uint8) for _ in range(k + 1 - len(buffers)))  # k: a batch's
        # k-th tensor; those before it may be pinned already and never staged (a pinned read's images, its labels not)
        if buffers[k].numel() < nbytes:
            buffers[k] = self._allocate(nbytes)
        strides = tensor.stride() if _dense(tensor) else _contiguous_strides(tensor.shape)
        view = buffers[k][:nbytes].view(tensor.dtype).as_strided(tensor.shape, strides)
        return view.copy_(tensor)


def _dense(tensor):
    """Whether ``tensor`` covers its memory without gaps (contiguous, or channels_last as a JPEG batch is)."""
    return tensor.is_contiguous() or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
