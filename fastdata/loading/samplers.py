"""Batch samplers: each iteration (an epoch) yields the int64 index array of every batch.

NOTE [epoch protocol]: make_loader takes as ``batch_sampler`` any iterable of
index batches (a list of lists, a torch BatchSampler, a generator's owner);
the loader iterates it once per epoch and asks it nothing else. An
EpochSampler also says which batches any epoch has, and the loader uses
that to read the next epoch's first batch while the loop still works on the
previous epoch (see NOTE [next epoch's first batch] in loader.py):

- ``epoch``: the epoch the next iteration yields;
- ``batches(epoch)``: that epoch's batches, without changing any state;
- ``set_epoch(epoch)``: as torch's DistributedSampler, choose the next epoch;
- iterating yields ``batches(epoch)`` and advances ``epoch`` by one when the
  first batch is asked for; the loader, having read an epoch from
  ``batches``, advances it with ``set_epoch(epoch + 1)``.
"""

import abc
from collections.abc import Iterable, Iterator

import numpy as np

from fastdata.errors import OptionError


class EpochSampler(abc.ABC):
    """Base of batch samplers that follow the epoch protocol (see NOTE [epoch protocol]).

    Subclasses implement ``batches(epoch)``; this class counts epochs and
    gives ``len``.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch.
        shuffle: draw a new order each epoch.
        seed: base seed; the epoch number is mixed in.
        drop_last: leave out a last batch smaller than ``batch_size``.
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool):
        _check_positive("batch_size", batch_size)
        self.num_samples = int(num_samples)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    @abc.abstractmethod
    def batches(self, epoch: int) -> Iterable[np.ndarray]:
        """Return the int64 index arrays of ``epoch``'s batches; change no state."""

    def set_epoch(self, epoch: int) -> None:
        """Use the batches of ``epoch`` next (each iteration also advances it)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[np.ndarray]:
        epoch = self.epoch  # a generator: the epoch advances when its first batch is asked for, as torch's
        self.epoch += 1  # DataLoader calls iter() twice on its first epoch
        yield from self.batches(epoch)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)


def _check_positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(f"{name} should be a positive integer, got {name}={value!r}")


class BatchIndexSampler(EpochSampler):
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

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False):
        super().__init__(num_samples, batch_size, shuffle, seed, drop_last)

    def batches(self, epoch):
        """Yield the sorted int64 index arrays of ``epoch``'s batches (drawn on the first one)."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples, dtype=np.int64)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = order[start : start + self.batch_size]
            yield np.sort(batch) if self.shuffle else batch


class BucketBatchSampler(EpochSampler):
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

    def __init__(self, lengths: np.ndarray, batch_size: int, *, pool_batches: int = 50, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        _check_positive("pool_batches", pool_batches)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise OptionError(f"lengths should be 1-D, got shape {self.lengths.shape}")
        super().__init__(len(self.lengths), batch_size, shuffle, seed, drop_last)
        self.pool_batches = pool_batches

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
