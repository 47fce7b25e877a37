"""Baselines: torchvision-style resize, a plain Pool conversion, JPEG decode loops.

Nothing here imports torch (see NOTE [light main] in images.py).
"""

import multiprocessing
from functools import partial

import numpy as np

from fastdata.codecs.images import decode_jpeg
from fastdata.measure.baselines import load_resized

_BLOBS = None  # JPEG bytes held by each decode-pool worker


def pool_decode(paths, size, workers):
    """Decode and resize every path on a plain ``multiprocessing.Pool``; return uint8 ``[N, size, size, 3]``.

    Pool start-up is included, as a conversion script would pay it.
    """
    out = np.empty((len(paths), size, size, 3), np.uint8)
    chunksize = max(1, min(64, len(paths) // (workers * 8)))
    with multiprocessing.Pool(workers) as pool:
        for index, pixels in enumerate(pool.imap(partial(load_resized, size=size), paths, chunksize)):
            out[index] = pixels
    return out


def decode_jpegs(blobs):
    """Decode each JPEG of ``blobs`` (bytes) to a uint8 array in memory; return how many.

    Uses the decoder the loader uses (simplejpeg where installed, else
    Pillow), so the loader is compared with the same work in a tight loop.
    """
    for blob in blobs:
        decode_jpeg(blob)
    return len(blobs)


def start_decode_pool(blobs, workers):
    """Start ``workers`` processes that each hold ``blobs``; use with ``decode_range``.

    Forked where possible, so the bytes are inherited rather than pickled.
    """
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    return context.Pool(workers, initializer=_hold_blobs, initargs=(blobs,))


def _hold_blobs(blobs):
    global _BLOBS
    _BLOBS = blobs


def decode_range(bounds):
    """Decode ``_BLOBS[start:stop]`` in a decode-pool worker; return how many."""
    start, stop = bounds
    return decode_jpegs(_BLOBS[start:stop])


def split_ranges(count, parts):
    """Return ``parts`` contiguous ``(start, stop)`` ranges covering ``range(count)``."""
    edges = np.linspace(0, count, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]
