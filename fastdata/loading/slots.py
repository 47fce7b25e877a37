"""A batch laid out in a shared byte buffer: its tensors at aligned offsets, its other values beside them.

One layout for the two ways a batch crosses processes through reused
shared memory: a DataLoader worker's slots (transport.py) and the helper
process's (helper.py). A batch is a tuple of tensors, or a dict batch of
records whose tensors go into the buffer and whose other values (text,
JSON) travel pickled with the layout (``split`` and ``joined``).
"""

import math

import torch

ALIGN = 64  # each tensor starts on a cache line, so any dtype's view is aligned
MAX_TENSORS = 4  # alignment room a slot keeps per batch: a (sample, label) batch has 2 or 3 tensors


def split(batch):
    """Return ``(tensors, shape)`` of a batch: ``shape`` None for a tuple, else a dict batch's ``(names, rest)``."""
    if not isinstance(batch, dict):
        return list(batch), None
    names = [name for name, value in batch.items() if isinstance(value, torch.Tensor)]
    return [batch[name] for name in names], (list(batch), {n: v for n, v in batch.items() if n not in names})


def joined(tensors, shape):
    """Return the batch ``split`` took apart, with ``tensors`` in the place of its tensors."""
    if shape is None:
        return tuple(tensors)
    names, rest = shape
    tensors = iter(tensors)
    return {name: rest[name] if name in rest else next(tensors) for name in names}


def slot_bytes(batch_bytes, tensors=MAX_TENSORS):
    """Return the bytes of a slot that holds a batch of ``batch_bytes`` in ``tensors`` tensors or fewer.

    A whole number of ALIGN: slots lie end to end in one buffer, so each must start aligned too (an int64
    tensor in the second slot after one of 66,060 bytes could not be viewed).
    """
    return -(-(batch_bytes + tensors * ALIGN) // ALIGN) * ALIGN


def layout_of(tensors, buffer=None):
    """Return ``([(dtype, shape, strides, start)] of each tensor, the bytes they take)`` in a buffer.

    Each keeps channels_last strides where it has them, else takes contiguous ones (``dense_strides``). A tensor
    read into the start of ``buffer`` (NOTE [read into the slot] in buffers.py) is laid out there, the others
    after it in turn.
    """
    order = sorted(range(len(tensors)), key=lambda k: buffer is None or tensors[k].data_ptr() != buffer.data_ptr())
    starts, end = {}, 0
    for k in order:
        starts[k] = end
        end += -(-nbytes(tensors[k].dtype, tensors[k].shape) // ALIGN) * ALIGN
    return [(tensor.dtype, tuple(tensor.shape), dense_strides(tensor), starts[k])
            for k, tensor in enumerate(tensors)], end


def write(buffer, tensors, layout):
    """Copy ``tensors`` into the uint8 tensor ``buffer`` where ``layout`` places them; return how many were there.

    A tensor already there (read into the buffer: NOTE [read into the slot] in buffers.py) is not copied; one
    elsewhere in the buffer is copied out first, so that no tensor written before it overwrites it.
    """
    targets = [view(buffer, start, dtype, shape, strides) for dtype, shape, strides, start in layout]
    placed = [_at(tensor, target) for tensor, target in zip(tensors, targets)]
    tensors = [tensor.clone() if not there and inside(tensor, buffer) else tensor
               for tensor, there in zip(tensors, placed)]
    for tensor, target, there in zip(tensors, targets, placed):
        if not there:
            target.copy_(tensor)  # same strides where dense: a plain copy
    return sum(placed)


def moved_out(tensors, buffer):
    """Return ``tensors``, those that lie in ``buffer``'s memory copied out (for a batch that leaves the buffer)."""
    return [tensor.clone() if inside(tensor, buffer) else tensor for tensor in tensors]


def inside(tensor, buffer):
    """Whether ``tensor``'s first element lies in the memory of tensor ``buffer``."""
    return buffer.data_ptr() <= tensor.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size()


def _at(tensor, target):
    """Whether ``tensor`` is ``target``'s memory seen the same way (read into place)."""
    return (tensor.data_ptr(), tensor.stride(), tensor.dtype) == (target.data_ptr(), target.stride(), target.dtype)


def view(buffer, start, dtype, shape, strides):
    """View uint8 ``buffer`` from byte ``start`` as a dense tensor of ``dtype``, ``shape`` and ``strides``."""
    return buffer[start : start + nbytes(dtype, shape)].view(dtype).as_strided(shape, strides)


def dense_strides(tensor):
    """Return ``tensor``'s strides if it is channels_last, else contiguous ones.

    Keeping that layout makes both copies plain memory copies (a JPEG batch
    is a channels_last view, see NOTE [channels last] in decoders.py).
    """
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return tuple(tensor.stride())
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def nbytes(dtype, shape):
    return math.prod(shape) * dtype.itemsize
