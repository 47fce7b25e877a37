"""Batch samplers yielding int64 index arrays, one array per batch."""

import numpy as np


class BatchIndexSampler:
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
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size should be a positive integer, got batch_size={batch_size!r}")
        self.num_samples = int(num_samples)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch):
        """Use the permutation of ``epoch`` next (each iteration also advances it)."""
        self.epoch = epoch

    def __len__(self):
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __iter__(self):
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples, dtype=np.int64)
        self.epoch += 1
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = order[start : start + self.batch_size]
            yield np.sort(batch) if self.shuffle else batch
