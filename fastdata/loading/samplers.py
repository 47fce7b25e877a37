"""Batch samplers yielding int64 index arrays, one array per batch."""

import numpy as np


class _EpochSampler:
    """What both samplers share: argument checks, epoch counting and ``len``."""

    def __init__(self, num_samples, batch_size, shuffle, seed, drop_last):
        _check_positive("batch_size", batch_size)
        self.num_samples = int(num_samples)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch):
        """Use the batches of ``epoch`` next (each iteration also advances it)."""
        self.epoch = epoch

    def __len__(self):
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)


def _check_positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} should be a positive integer, got {name}={value!r}")


class BatchIndexSampler(_EpochSampler):
    """Yield the indices of each batch as a sorted int64 array.

    Every sample appears exactly once per epoch (or not at all in a dropped
    last batch). With ``shuffle`` the order is drawn from ``seed`` and the
    epoch number, so runs are reproducible and epochs differ. Indices are
    sorted inside each batch: a batch is a set to the optimizer, and sorted
    reads go through the file in one forward pass.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch.
        shuffle: draw a new permutation each epoch.
        seed: base seed of the permutations.
        drop_last: leave out a last batch smaller than ``batch_size``.
    """

    def __init__(self, num_samples, batch_size, *, shuffle=False, seed=0, drop_last=False):
        super().__init__(num_samples, batch_size, shuffle, seed, drop_last)

    def __iter__(self):
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples, dtype=np.int64)
        self.epoch += 1
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = order[start : start + self.batch_size]
            yield np.sort(batch) if self.shuffle else batch


class BucketBatchSampler(_EpochSampler):
    """Yield batches of samples of similar length, as sorted int64 index arrays.

    Each epoch draws a permutation, cuts it into pools of ``pool_batches``
    batches, sorts each pool by length and cuts it into batches, then
    shuffles the order of all the batches. Every sample appears exactly once
    per epoch (or not at all in a dropped last batch); batches hold samples
    of close length, so padding them costs little, yet which samples share a
    batch and the batch order change every epoch.

    Args:
        lengths: int ``[N]`` sample lengths, e.g. ``dataset.lengths``.
        batch_size: samples per batch.
        pool_batches: batches per pool; larger pools pad less, smaller ones
            mix more.
        shuffle: draw pools and batch order at random (seeded); otherwise
            pools follow the index order and batches keep pool order.
        seed: base seed; the epoch number is mixed in.
        drop_last: leave out the one batch smaller than ``batch_size``.

    Example:
        >>> sampler = BucketBatchSampler(dataset.lengths, 64, shuffle=True)
        >>> loader = make_loader(dataset, batch_sampler=sampler)
        >>> sampler.padding()["saved"]   # share of padded cells saved
    """

    def __init__(self, lengths, batch_size, *, pool_batches=50, shuffle=True, seed=0, drop_last=False):
        _check_positive("pool_batches", pool_batches)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise ValueError(f"lengths should be 1-D, got shape {self.lengths.shape}")
        super().__init__(len(self.lengths), batch_size, shuffle, seed, drop_last)
        self.pool_batches = pool_batches

    def __iter__(self):
        batches = self.batches(self.epoch)
        self.epoch += 1
        yield from batches

    def batches(self, epoch):
        """Return the list of sorted int64 index arrays of ``epoch``."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples, dtype=np.int64)
        pool_size = self.pool_batches * self.batch_size
        batches = []
        for start in range(0, self.num_samples, pool_size):
            pool = order[start : start + pool_size]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]  # ties keep their random order
            batches += [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()  # only the last pool can end in a short batch
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return [np.sort(batch) for batch in batches]

    def padding(self, epoch=None):
        """Compare padding with and without bucketing for ``epoch`` (default: the next one).

        Returns:
            dict: ``bucketed`` and ``random``, the share of padded cells in
            ``[B, T]`` batches padded to their longest sample, with these
            batches and with plain random batches of the same size; and
            ``saved``, the share of padded ``[B, T]`` cells bucketing saves.
        """
        epoch = self.epoch if epoch is None else epoch
        bucketed_cells, tokens = _cells(self.lengths, self.batches(epoch))
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        stop = len(self) * self.batch_size if self.drop_last else self.num_samples
        random_batches = [order[i : min(i + self.batch_size, stop)] for i in range(0, stop, self.batch_size)]
        random_cells, _ = _cells(self.lengths, random_batches)
        return {
            "bucketed": 1 - tokens / bucketed_cells if bucketed_cells else 0.0,
            "random": 1 - tokens / random_cells if random_cells else 0.0,
            "saved": 1 - bucketed_cells / random_cells if random_cells else 0.0,
        }


def _cells(lengths, batches):
    """Return ``(cells of the padded batches, tokens in them)``."""
    cells = sum(int(lengths[batch].max(initial=0)) * len(batch) for batch in batches)
    tokens = sum(int(lengths[batch].sum()) for batch in batches)
    return cells, tokens
