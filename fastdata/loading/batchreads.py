"""How a PackedDataset reads a batch: in one pass, begun and finished later, grouped, or shard by shard.

BatchReads is mixed into PackedDataset (datasets.py): ``read_batch`` and the ``start_batch`` / ``start_batches``
pair the loaders pipeline (NOTE [pipelined reads] in batchloader.py), a batch whose shards do not fit a URL's cache
read one shard at a time, and the batch options and sizes of the dataset's decoder.
"""

import functools

import numpy as np
import torch

from fastdata.loading.decoders import decoder_for


class BatchReads:
    """The batch reads of PackedDataset (datasets.py), mixed into it.

    Uses the dataset's ``_store`` (a ShardStore), ``_open()`` (its decoder in this process), ``transform``,
    ``kind``, ``metadata``, ``path`` and ``_num_samples``.
    """

    @property
    def copies_in_background(self):
        """Whether ``start_batch`` leaves the rows copying on helper threads (raw images)."""
        return self._open().copies_in_background

    def fits_cache(self, indices) -> bool:
        """Whether the shards of samples ``indices`` (in range) fit a URL's cache together; always for local files."""
        return self._store.fits_cache(np.asarray(indices, dtype=np.int64))

    def read_batch(self, indices, pin_memory=False, **options):
        """Read a batch in one pass; return ``(*samples, labels int64 [B])``.

        For images ``samples`` is ``images uint8 [B, 3, H, W]``; for text it
        is ``tokens int64 [B, T], lengths int64 [B]``, padded with the stored
        pad id to the longest sample or to ``options["pad_to"]``. ``indices``
        should be sorted for a single forward pass over the file (and one
        part per shard of a folder); any order is read correctly. With
        ``pin_memory`` the batch is written straight into page-locked memory.

        Raises:
            IndexError: an index is out of range.
        """
        return self.start_batch(indices, pin_memory, **options)()

    def start_batch(self, indices, pin_memory=False, **options):
        """Begin ``read_batch(indices, pin_memory, **options)``; return a function that finishes it and returns it.

        Where ``copies_in_background``, the rows go on being copied on helper
        threads until that function is called (NOTE [pipelined reads] in
        batchloader.py); call it exactly once: until then the batch's shards stay
        open (and a URL's held in its cache: start another batch before only
        where ``fits_cache`` of both batches' indices).

        Raises:
            IndexError: an index is out of range.
        """
        indices = self._check_indices(np.asarray(indices, dtype=np.int64))
        if not self._store.fits_cache(indices):
            batch = self._read_shard_by_shard(indices, pin_memory, **options)
            return lambda: batch
        return functools.partial(self._finish, *self._start(indices, pin_memory, options))

    def start_batches(self, indices, sizes, pin_memory=False, **options):
        """Begin reading consecutive batches of ``sizes`` samples of ``indices`` as one read (NOTE [grouped reads]).

        Returns a function that finishes the read and returns the list of
        batches, each as ``read_batch`` returns it (views of one array). For
        samples of one shape only (raw images) and local files, where the
        read counts as ``len(sizes)`` batches in ``read_paths``.

        Raises:
            IndexError: an index is out of range.
        """
        indices = self._check_indices(np.asarray(indices, dtype=np.int64))
        finish = functools.partial(self._finish, *self._start(indices, pin_memory, options, len(sizes)))
        return lambda: list(zip(*(torch.split(column, sizes) for column in finish())))

    def _start(self, indices, pin_memory, options, batches=1):
        self._store.enter()  # until _finish: a writer of the files waits (NOTE [read leases] in leases.py)
        try:
            parts = self._store.parts(indices, batches)
        except BaseException:
            self._store.leave()
            raise
        try:
            finish_samples = self._open().start_parts(parts, pin_memory, **options)
            labels = parts.labels()  # read before the release (NOTE [steady batches] in store.py)
        except BaseException:
            parts.release()
            self._store.leave()
            raise
        return parts, finish_samples, labels

    def _finish(self, parts, finish_samples, labels):
        try:
            samples = finish_samples()
        finally:
            parts.release()  # see NOTE [stitched rows] in stitch.py
            self._store.leave()
        if self.transform is not None:
            samples = (torch.stack([self.transform(sample) for sample in samples[0]]), *samples[1:])
        return (*samples, torch.from_numpy(labels))

    def _read_shard_by_shard(self, indices, pin_memory, **options):
        """Read a batch whose shards do not fit the cache together one shard at a time, then join the pieces.

        NOTE [batch past the cache]: a batch holds every shard it reads until it
        is read, so with a cache_limit smaller than a batch's shards the
        reader waited for room it held itself (the streaming benchmark's 2-
        and 4-shard limits stalled past 20 s). Read piece by piece, each
        shard can be released before the next is fetched; the pieces are
        joined (text tokens padded to the longest piece) in the batch's order.
        """
        shards = self._store.index.shard_of(indices)
        groups = [np.flatnonzero(shards == shard) for shard in np.unique(shards)]
        pieces = [self.read_batch(indices[group], **options) for group in groups]
        width = max(piece[0].shape[-1] for piece in pieces) if self.kind == "text" else None
        if width is not None:  # tokens [b, T_k]: pad each to the longest
            pad = self._open().pad_id
            pieces = [(torch.nn.functional.pad(piece[0], (0, width - piece[0].shape[-1]), value=pad), *piece[1:])
                      for piece in pieces]
        inverse = torch.from_numpy(np.argsort(np.concatenate(groups), kind="stable"))
        *samples, labels = (torch.cat(column)[inverse] for column in zip(*pieces))
        return (*(sample.pin_memory() if pin_memory else sample for sample in samples), labels)

    @property
    def read_options(self):
        """Names of the keyword options ``read_batch`` takes for this file, e.g. ``("pad_to",)``."""
        return decoder_for(self.metadata, self.path).read_options

    def max_batch_bytes(self, batch_size, **options):
        """Return the most bytes of a ``read_batch`` of ``batch_size`` samples with ``options`` (labels included)."""
        return decoder_for(self.metadata, self.path).max_batch_bytes(batch_size, **options) + 8 * batch_size

    def _check_indices(self, indices):
        return checked_indices(indices, self._num_samples, self.path)


def checked_indices(indices, num_samples, path):
    """Return 1-D int64 ``indices``, negative ones counted from the end; IndexError naming ``path`` if out of range."""
    if indices.ndim != 1:
        raise ValueError(f"indices should be 1-D, got shape {indices.shape}")
    if not len(indices):
        return indices
    least = indices.min()
    if least < -num_samples or indices.max() >= num_samples:
        bad = indices[(indices < -num_samples) | (indices >= num_samples)][0]
        raise IndexError(f"index {bad} is out of range for {num_samples} samples in {path!r}")
    return indices if least >= 0 else np.where(indices < 0, indices + num_samples, indices)
