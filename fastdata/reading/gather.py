"""Read int64 values out of many arrays (the label columns of a folder's shards) in one call.

NOTE [address-space gather]: a shuffled batch of 256 from a folder of ~33
shards touches every shard; one numpy take per shard for its labels cost
24 us a batch (0.7 us a call), and a 64 MiB-shard folder of ImageNet at
64 px (~240 shards) would pay ~140 us of a ~400 us batch copy. Instead,
numpy fancy indexing of one int64 view of the process's whole address
space, with each label's address, reads them all in one call: 3.6 us
(best of 7 x 3,000 calls, 2 shared cores). The view reads only the
addresses asked for, which come from arrays the caller holds while it
reads (a Parts holds its Columns) at rows checked before they get here.
Linux keeps user addresses below 2**56 (57-bit with 5-level page tables)
and never maps the first page.

The pixel rows are not gathered this way. torch.index_select over a row
view of the address space took 83-150 us against 182 us for the per-shard
takes on a quiet machine, but it runs on torch's intra-op threads and fell
to 14,000 img/s when other processes kept the cores busy; numpy's fancy
indexing needs a fresh output array per batch (see NOTE [buffer reuse]);
and numpy's take copies a strided source whole. Fixed-size rows are
stitched into one array instead (NOTE [stitched rows] in stitch.py).
"""

import ctypes
import functools

import numpy as np

_FIRST = 4096  # the view's first address: page 0 is never mapped (NULL)
_END = 1 << 56  # past the highest user address on Linux (x86-64 and arm64, 5-level page tables included)


@functools.cache
def _int64_view():
    """Return int64 ``[_]``: item ``a`` is the int64 at address ``_FIRST + a``; a view, nothing is read."""
    memory = (ctypes.c_char * (_END - _FIRST)).from_address(_FIRST)
    return np.ndarray((_END - _FIRST - 7,), np.int64, buffer=memory, strides=(1,))


def address(array):
    """Return the address of ``array``'s first byte (it must be C-contiguous)."""
    if not array.flags.c_contiguous:
        raise ValueError("an address-space gather needs C-contiguous arrays")
    return array.__array_interface__["data"][0]


def row_positions(bases, bounds, rows, row_bytes):
    """Return the int64 addresses of rows: batch rows ``bounds[j]:bounds[j + 1]`` are ``rows`` of array ``j``.

    ``bases`` are the arrays' ``address``; ``rows`` are in range (checked by the caller).
    """
    edges = np.asarray(bounds)
    return np.repeat(bases, edges[1:] - edges[:-1]) + rows * row_bytes


def gather_int64(positions):
    """Return the int64 values at addresses ``positions`` (int64) as a new array."""
    return _int64_view()[positions - _FIRST]
