"""Batch samplers of the sweeps and the simulated GPU step: batches from an endless stream of shuffled epochs.

(The baseline datasets live in fastdata.measure.baselines.)
"""

import itertools

import numpy as np

from fastdata.loading.samplers import EpochSampler


class StreamBatches:
    """Yield sorted int64 index batches of shuffled epochs without end (full batches only).

    Used as a ``batch_sampler`` so that a pass can be any number of batches
    from one running iterator: workers stay busy across epoch boundaries
    and a pass need not be a whole epoch of a small file.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch (at most ``num_samples``).
        seed: seed of the permutations.
    """

    def __init__(self, num_samples, batch_size, seed=0):
        self.num_samples, self.batch_size, self.seed = num_samples, min(batch_size, num_samples), seed

    def __len__(self):
        return 2**31 - 1  # endless; DataLoader only needs a number

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        while True:
            order = rng.permutation(self.num_samples)
            for start in range(0, self.num_samples - self.batch_size + 1, self.batch_size):
                yield np.sort(order[start : start + self.batch_size])


class EpochBatches(EpochSampler):
    """``num_batches`` batches of StreamBatches per iteration: an epoch of a chosen length.

    An EpochSampler (see NOTE [epoch protocol] in fastdata/loading/samplers.py),
    so make_loader reads ahead into its next epoch as with its own samplers.
    """

    def __init__(self, num_samples, batch_size, num_batches, seed=0):
        super().__init__(num_samples, min(batch_size, num_samples), seed=seed, rank=0, world_size=1)
        self.num_batches = num_batches

    def __len__(self):
        return self.num_batches

    def batches(self, epoch, start_step=0):
        stream = StreamBatches(self.num_samples, self.batch_size, [self.seed, epoch])
        return itertools.islice(stream, start_step, self.num_batches)

    def describe(self):
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "num_batches": self.num_batches,
                "seed": self.seed}
