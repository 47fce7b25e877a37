"""The limits a loader is measured against: the stored samples copied, or the stored JPEGs decoded, with no loader.

Each limit is an epoch function for ``engine.measure_rate``: it does the
loader's unavoidable work over every stored sample once and returns how
many samples it covered. `fastdata bench` and benchmarks/ use the same ones.

NOTE [np.take out]: with ``out=`` and the default ``mode="raise"``, numpy
takes into a temporary and then copies it into ``out`` (so ``out`` is
untouched on an IndexError): twice the memory traffic. ``mode="clip"``
writes straight into ``out``.
"""

import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from fastdata._processes import end_on_sigterm, held_signals

_HELD = None  # (data, offsets) of the stored JPEGs in a decode-pool process


def shuffled_batches(count, batch_size, seed=0):
    """Return the sorted int64 index batches of one shuffled epoch of ``count`` samples."""
    order = np.random.default_rng(seed).permutation(count)
    return [np.sort(order[i : i + batch_size]) for i in range(0, count, batch_size)]


def copy_epochs(samples, batch_size, *, mode="clip", seed=0, threads=1):
    """Return an epoch function copying shuffled, sorted batches of fixed-size ``samples`` (e.g. a memmap).

    Args:
        samples: ``[N, ...]`` array of stored samples.
        mode: ``np.take`` mode into one preallocated batch array ("clip" or
            "raise", see NOTE [np.take out]); None takes into a fresh array
            per batch, alive until the next one, as in a loader loop.
        threads: with ``mode="clip"``, each batch is cut in this many equal
            pieces copied at once, one by the calling thread (numpy frees
            the GIL while it copies): what the memory bus gives more cores.
    """
    batches = shuffled_batches(len(samples), batch_size, seed)
    out = np.empty((batch_size, *samples.shape[1:]), samples.dtype)
    helpers = ThreadPoolExecutor(threads - 1) if threads > 1 and mode == "clip" else None

    def copy_into():
        for indices in batches:
            np.take(samples, indices, axis=0, out=out[: len(indices)], mode=mode)
        return len(samples)

    def copy_in_pieces():
        for indices in batches:
            edges = [len(indices) * piece // threads for piece in range(threads + 1)]
            pieces = [helpers.submit(np.take, samples, indices[a:b], 0, out[a:b], "clip")
                      for a, b in zip(edges[1:-1], edges[2:])]
            np.take(samples, indices[: edges[1]], axis=0, out=out[: edges[1]], mode="clip")
            for piece in pieces:
                piece.result()
        return len(samples)

    def copy_fresh():
        count = 0
        for indices in batches:
            images = np.take(samples, indices, axis=0)
            count += len(images)
        return count

    return copy_fresh if mode is None else copy_in_pieces if helpers is not None else copy_into


def token_copy_epochs(values, offsets, batch_size, max_length, *, contiguous=False, seed=0):
    """Return an epoch function copying each shuffled batch's stored token ids (ragged ``values``/``offsets``).

    Row by row into a preallocated ``[batch_size, max_length]`` array (no
    padding fill, no widening); with ``contiguous``, as many bytes per batch
    in one contiguous slice instead (random samples cannot be read that way:
    for scale only).
    """
    values, offsets = np.asarray(values), np.asarray(offsets)
    batches = shuffled_batches(len(offsets) - 1, batch_size, seed)
    out = np.zeros((batch_size, max_length), values.dtype)
    flat = out.reshape(-1)

    def copy_rows():
        for indices in batches:
            starts, stops = offsets[indices].tolist(), offsets[indices + 1].tolist()
            for row, (start, stop) in enumerate(zip(starts, stops)):
                out[row, : stop - start] = values[start:stop]
        return len(offsets) - 1

    def copy_slices():
        for indices in batches:
            count = int((offsets[indices + 1] - offsets[indices]).sum())
            start = int(offsets[indices[0]]) % max(1, len(values) - count)
            flat[:count] = values[start : start + count]
        return len(offsets) - 1

    return copy_slices if contiguous else copy_rows


class DecodeEpochs:
    """Epochs decoding every stored JPEG with ``decode_jpeg`` (as the loader does), on threads or processes.

    The JPEGs are read from ``columns`` (``samples`` bytes and ``offsets``,
    e.g. a memory map) where they lie; processes are forked where possible,
    so they inherit the mapping rather than a copy. Call the object for one
    epoch; ``close()`` (or leaving a ``with`` block) stops the pool.

    Args:
        columns: the jpeg-storage columns of a packed file.
        workers: threads (or processes) decoding at once.
        processes: decode on a process pool instead of threads.
    """

    def __init__(self, columns, workers, *, processes=False):
        data, offsets = memoryview(np.asarray(columns.samples)), np.asarray(columns.offsets).tolist()
        self._ranges = _split_ranges(len(offsets) - 1, 4 * workers)
        if processes:
            self._pool = ending_pool(workers, _hold, (data, offsets))
            self._decode = _decode_held
        else:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fastdata-decode")
            self._decode = partial(_decode, data, offsets)

    def __call__(self):
        return sum(self._pool.map(self._decode, self._ranges))

    def close(self):
        if isinstance(self._pool, ThreadPoolExecutor):
            self._pool.shutdown()
        else:
            self._pool.terminate()
            self._pool.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


def ending_pool(workers, initializer=None, initargs=()):
    """Return a ``multiprocessing.Pool`` (forked where possible) whose workers SIGTERM always ends.

    SIGTERM is held while the workers fork and each worker sets its default
    action before it lets one through (NOTE [forked SIGTERM] in
    fastdata/_processes.py); a SIGTERM to this process meanwhile lands once
    the pool exists, and a pool made by then is ended, not lost.
    """
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = None
    try:
        with held_signals(context.get_start_method()):
            pool = context.Pool(workers, initializer=_start_worker, initargs=(initializer, initargs))
    except BaseException:
        if pool is not None:
            pool.terminate()
            pool.join()
        raise
    return pool


def _start_worker(initializer, initargs):
    """A pool worker's start: SIGTERM ends it from now on (NOTE [forked SIGTERM]); then ``initializer``."""
    end_on_sigterm()
    if initializer is not None:
        initializer(*initargs)


def _hold(data, offsets):
    """A decoding process's start: keep the stored bytes."""
    global _HELD
    _HELD = (data, offsets)


def _decode_held(bounds):
    return _decode(*_HELD, bounds)


def _decode(data, offsets, bounds):
    """Decode the stored JPEGs ``start`` to ``stop`` of ``bounds``; return how many."""
    from fastdata.codecs.images import decode_jpeg

    start, stop = bounds
    for index in range(start, stop):
        decode_jpeg(data[offsets[index] : offsets[index + 1]])
    return stop - start


def _split_ranges(count, parts):
    """Return at most ``parts`` contiguous non-empty ``(start, stop)`` ranges covering ``range(count)``."""
    edges = np.linspace(0, count, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]
