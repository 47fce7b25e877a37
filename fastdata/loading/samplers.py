"""Batch samplers: each iteration (an epoch) yields the int64 index array of every batch.

NOTE [epoch protocol]: make_loader takes as ``batch_sampler`` any iterable of
index batches (a list of lists, a torch BatchSampler, a generator's owner);
the loader iterates it once per epoch and asks it nothing else. An
EpochSampler also says which batches any epoch has, and the loader uses
that to read the next epoch's first batch while the loop still works on the
previous epoch (see NOTE [next epoch's first batch] in batchloader.py):

- ``epoch``: the epoch the next iteration yields; ``start_step``: the
  global step it starts at (0 unless resumed);
- ``batches(epoch, start_step=0)``: that epoch's batches from that step on,
  without changing any state;
- ``set_epoch(epoch)``: as torch's DistributedSampler, choose the next epoch
  (a resumed step stays if it is the same epoch: trainers call it after
  loading a checkpoint); ``resume(epoch, step)``: choose both;
- iterating yields ``batches(epoch, start_step)`` and advances ``epoch`` by
  one (``start_step`` back to 0) when the first batch is asked for; the
  loader, having read an epoch from ``batches``, advances it with
  ``set_epoch(epoch + 1)``;
- ``describe()``: the settings that decide the batches, and
  ``global_batch``: samples per step over all ranks (for a loader's state,
  NOTE [loader state] in state.py);
- ``bind()``: take rank and world size from a process group made after the
  sampler (see NOTE [late rank]).

NOTE [late rank]: a sampler made before torch.distributed's process group
exists (in a LightningDataModule's ``__init__``, at a script's top level
under Lightning's DDP launcher, before ``init_process_group``), with rank
and world size left to it, would read the whole dataset on every rank. So
it takes them from the group when it is next asked for its length, batches
or settings, once a group exists; its global batch then becomes
``batch_size * world_size``, the order is the one a sampler made after the
group has (NOTE [global order] in order.py). Iterated under torchrun
(``WORLD_SIZE`` > 1) with still no group, it refuses, rather than read
everything on every rank.
"""

import abc
import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch.distributed as dist

from fastdata.errors import OptionError
from fastdata.loading.collectives import broadcast_object
from fastdata.reading.order import EpochOrder, check_positive

_CHUNK_SAMPLES = 16384  # positions computed per order.samples call (see NOTE [chunked order])
_CHUNK_STEPS = 1024


class EpochSampler(abc.ABC):
    """Base of batch samplers that follow the epoch protocol (see NOTE [epoch protocol]).

    Subclasses implement ``batches(epoch, start_step)`` and ``describe()``;
    this class counts epochs, resumes mid-epoch and gives ``len``.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch of this rank.
        seed: base seed; the epoch number is mixed in.
        rank: this process's rank; default: torch.distributed's where a process group is initialized, else 0.
        world_size: ranks sharing each global batch of ``batch_size * world_size`` samples; default as ``rank``
            (1 without a group).
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int | None, world_size: int | None):
        check_positive("batch_size", batch_size)
        self._late = rank is None and world_size is None and not _group_exists()  # see NOTE [late rank]
        rank, world_size = resolve_rank(rank, world_size)
        self.num_samples = int(num_samples)
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self.epoch = 0
        self.start_step = 0  # the step the next iteration starts at (a resumed epoch)

    @abc.abstractmethod
    def batches(self, epoch: int, start_step: int = 0) -> Iterable[np.ndarray]:
        """Return the int64 index arrays of ``epoch``'s batches from ``start_step`` on; change no state."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """Return the JSON-able settings that decide the order (they go into a loader's state)."""

    def bind(self, iterating: bool = False) -> None:
        """Take rank and world size from the process group if one exists now and they were left to it.

        See NOTE [late rank]. ``iterating``: about to yield batches, so refuse
        where torchrun started several ranks yet no group exists.

        Raises:
            ValueError: ``iterating`` under torchrun's ``WORLD_SIZE`` > 1 without a process group.
        """
        if not self._late:
            return
        if not _group_exists():
            if iterating and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
                raise OptionError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed has no process "
                                  "group, so this rank would read every batch: call "
                                  "torch.distributed.init_process_group first, or pass rank and world_size")
            return
        self._late = False
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if (rank, world_size) != (self.rank, self.world_size):
            self.rank, self.world_size, self.global_batch = rank, world_size, self.batch_size * world_size
            self._rebind()

    def _rebind(self) -> None:  # noqa: B027 (a hook: subclasses without world-size state need none)
        """Redo what depends on the world size after ``bind`` changed it (subclasses)."""

    def set_epoch(self, epoch: int) -> None:
        """Use the batches of ``epoch`` next (each iteration also advances it); a resumed step stays for its epoch."""
        if epoch != self.epoch:
            self.start_step = 0
        self.epoch = epoch

    def resume(self, epoch: int, step: int) -> None:
        """Start the next iteration at global ``step`` of ``epoch`` (O(1): nothing is replayed)."""
        self.epoch, self.start_step = epoch, step

    def __iter__(self) -> Iterator[np.ndarray]:
        self.bind(iterating=True)
        # a generator: the epoch advances when its first batch is asked for, as torch's DataLoader calls iter()
        yield from self.batches(*self.take_epoch())  # twice on its first epoch

    def take_epoch(self) -> tuple[int, int]:
        """Return ``(epoch, start step)`` of the iteration starting now, and move on to the next epoch from step 0."""
        epoch, start = self.epoch, self.start_step
        self.epoch, self.start_step = epoch + 1, 0
        return epoch, start

    def __len__(self) -> int:
        self.bind()
        if self.drop_last:
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)


def _group_exists():
    return dist.is_available() and dist.is_initialized()


def resolve_rank(rank, world_size):
    """Return ``(rank, world_size)``, checked: as given, else the initialized process group's, else 0 of 1."""
    group = _group_exists()
    world_size = (dist.get_world_size() if group else 1) if world_size is None else world_size
    rank = (dist.get_rank() if group else 0) if rank is None else rank
    check_rank(rank, world_size)
    return rank, world_size


def check_rank(rank, world_size):
    """Raise OptionError unless ``0 <= rank < world_size`` are ints."""
    check_positive("world_size", world_size)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise OptionError(f"rank should be an integer in [0, world_size={world_size}), got rank={rank!r}")


def remainder_policy(remainder, drop_last, world_size):
    """Return the remainder mode: ``remainder``, else from ``drop_last`` and ``world_size`` (see NOTE [remainder])."""
    if remainder is None:
        return "drop" if drop_last else ("partial" if world_size == 1 else "pad")
    if drop_last and remainder != "drop":
        raise OptionError(f"drop_last=True asks for remainder='drop', got remainder={remainder!r}; pass one of them")
    return remainder


class BatchIndexSampler(EpochSampler):
    """Yield this rank's indices of each global batch as a sorted int64 array.

    The order is an EpochOrder (see NOTE [global order] in order.py): a
    function of the seed, the epoch and the global batch ``batch_size *
    world_size``, so the union over ranks of every step is the same for any
    world size, and every rank yields ``len(sampler)`` batches. Every sample
    appears exactly once per epoch, less a dropped or plus a padded last
    batch (see NOTE [remainder] in order.py). Indices are sorted inside each
    batch: a batch is a set to the optimizer, and sorted reads go through the
    file in one forward pass.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch of this rank.
        shuffle: "none" (or False), "uniform" or "block". Not True: a sampler
            sees no data to pick an order for, where make_loader's
            ``shuffle=True`` does (NOTE [auto shuffle] in shuffles.py).
        seed: base seed of the order (a non-negative int).
        drop_last: same as ``remainder="drop"``.
        remainder: "partial", "pad" or "drop"; default "drop" with
            ``drop_last``, else "partial" for one rank and "pad" for more.
        rank: this process's rank (default: see EpochSampler).
        world_size: ranks sharing each global batch (default: see EpochSampler).
        block_size: consecutive samples per block ("block" only).
        window: blocks whose samples are shuffled together ("block" only).
    """

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool | str = False, seed: int = 0,
                 drop_last: bool = False, remainder: str | None = None, rank: int | None = None,
                 world_size: int | None = None, block_size: int | None = None, window: int | None = None):
        super().__init__(num_samples, batch_size, seed, rank, world_size)
        if shuffle is True or shuffle == "auto":
            raise OptionError(f"BatchIndexSampler takes shuffle='uniform' or 'block', got shuffle={shuffle!r}: True "
                              "means the order that suits the dataset, which make_loader(dataset, shuffle=True) "
                              "picks and a sampler cannot see")
        if shuffle is False:
            shuffle = "none"
        if shuffle == "block" and (block_size is None or window is None):
            raise OptionError("shuffle='block' needs block_size and window (make_loader picks them from the dataset)")
        self._settings = {"shuffle": shuffle, "block_size": block_size or 1, "window": window or 1}
        self._remainder, self._drop_last = remainder, drop_last
        self.chosen_here = False  # make_loader chose the settings on this rank: rank 0's win when bound later
        self._make_order()

    def _make_order(self):
        self.order = EpochOrder(self.num_samples, self.global_batch, seed=self.seed,
                                remainder=remainder_policy(self._remainder, self._drop_last, self.world_size),
                                **self._settings)
        self.shuffle, self.remainder = self.order.shuffle, self.order.remainder
        self.drop_last = self.remainder == "drop"
        if self.order.num_steps:  # a partial last batch the ranks cannot share is refused now, not at the end
            self.order.step_positions(self.order.num_steps - 1, self.rank, self.world_size)

    def _rebind(self):
        if self.chosen_here and self.world_size > 1:  # as make_loader under a group: rank 0 chooses for all
            self._settings = broadcast_object(self._settings)
        self._make_order()

    def __len__(self):
        self.bind()
        return self.order.num_steps

    def describe(self):
        """Return the order's settings (see EpochOrder.describe)."""
        self.bind()
        return self.order.describe()

    def batches(self, epoch, start_step=0):
        """Yield the sorted int64 index arrays of ``epoch``'s batches from global step ``start_step`` on.

        NOTE [chunked order]: one ``order.samples`` call costs ~50-100 us
        before its first sample, so positions are computed for up to
        _CHUNK_STEPS steps (at most ~_CHUNK_SAMPLES samples) per call.
        Measured on 2 shared cores, 5,000 raw 64 px samples (best of 7
        epochs): batches of 64 cost the sampler 12-16 us each in uniform
        order, 29-30 us in block order (blocks of 21, windows of 64-1,024),
        against 170-230 and 500-1,400 us with one ``order.batch`` call per
        step, and 140-370 us for ``read_batch`` of the batch from the page
        cache (4-9% uniform, 10-16% block); batches of 256: 34-50 us
        uniform, 98-107 us block, against 0.6-1.1 ms to read them. Nearly
        all of it was the order's keyed permutations (~200 ns a sample then;
        NOTE [keyed bijection] in order.py has their cost now).
        Small batches pay each call's cost over few samples: batches of 8
        sequences (the lm benchmark's file, uniform, best of 5 epochs while
        the test suite ran beside it, /tmp/lmt/parts2.py) cost the sampler
        3.7 us each with chunks of 64 steps, 1.8 with 256, 1.4 with 1,024,
        so _CHUNK_STEPS is 1,024 (16,384 samples bound larger batches).
        """
        self.bind(iterating=True)
        steps = max(1, min(_CHUNK_STEPS, _CHUNK_SAMPLES // self.batch_size))
        for first in range(start_step, self.order.num_steps, steps):
            chunk = range(first, min(first + steps, self.order.num_steps))
            yield from self._chunk(epoch, chunk)

    def _chunk(self, epoch, steps):
        """Return this rank's sorted batch of each of ``steps`` (a range), from one ``order.samples`` call."""
        bounds = self.order.steps_positions(steps, self.rank, self.world_size)
        sizes = bounds[:, 1] - bounds[:, 0]
        if np.all(sizes == sizes[0]):  # every batch full: one [steps, batch] array sorted along its rows
            positions = bounds[:, :1] + np.arange(sizes[0], dtype=np.int64)
            return list(np.sort(self.order.samples(epoch, positions.ravel()).reshape(positions.shape), axis=1))
        ends = np.cumsum(sizes)
        positions = np.arange(ends[-1], dtype=np.int64) + np.repeat(bounds[:, 0] - (ends - sizes), sizes)
        return [np.sort(batch) for batch in np.split(self.order.samples(epoch, positions), ends[:-1])]


class BucketBatchSampler(EpochSampler):
    """Yield batches of samples of similar length, as sorted int64 index arrays.

    Each epoch draws a permutation, cuts it into pools of ``pool_batches``
    global batches, sorts each pool by length and cuts it into global
    batches of ``batch_size * world_size``, then shuffles the order of all
    the global batches; rank ``r`` takes the ``r``-th ``batch_size`` of each
    (index order). Every sample appears exactly once per epoch, so padding
    batches costs little, yet which samples share a batch and the batch
    order change every epoch. The global batches depend on the seed, the
    epoch and the global batch only, not on the world size.

    The one short global batch (the last of the last pool): ``drop_last``
    leaves it out; otherwise one rank gets it short, and more ranks get it
    padded to full size with the pool's next-longest samples (repeated
    where the pool has too few), so every rank yields ``len(sampler)``
    batches of ``batch_size``.

    Args:
        lengths: int ``[N]`` sample lengths, e.g. ``dataset.lengths``.
        batch_size: samples per batch of this rank.
        pool_batches: global batches per pool; larger pools pad less, smaller ones
            mix more.
        shuffle: draw pools and batch order at random (seeded); otherwise
            pools follow the index order and batches keep pool order.
        seed: base seed; the epoch number is mixed in.
        drop_last: leave out the one batch smaller than the global batch.
        rank: this process's rank (default: see EpochSampler).
        world_size: ranks sharing each global batch (default: see EpochSampler).

    Example:
        >>> sampler = BucketBatchSampler(dataset.lengths, 64, shuffle=True)
        >>> loader = make_loader(dataset, batch_sampler=sampler)
        >>> sampler.padding()["saved"]   # share of padded cells saved
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, *, pool_batches: int = 50, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, rank: int | None = None, world_size: int | None = None):
        check_positive("pool_batches", pool_batches)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise OptionError(f"lengths should be 1-D, got shape {self.lengths.shape}")
        super().__init__(len(self.lengths), batch_size, seed, rank, world_size)
        self.pool_batches, self.shuffle, self.drop_last = pool_batches, shuffle, drop_last
        self.remainder = remainder_policy(None, drop_last, self.world_size)

    def _rebind(self):
        self.remainder = remainder_policy(None, self.drop_last, self.world_size)

    def describe(self):
        """Return the settings that decide the batches, JSON-able (they go into a loader's state)."""
        self.bind()
        return {"num_samples": self.num_samples, "global_batch": self.global_batch,
                "shuffle": "uniform" if self.shuffle else "none", "seed": self.seed, "remainder": self.remainder,
                "block_size": None, "window": None, "pool_batches": self.pool_batches}

    def batches(self, epoch, start_step=0):
        """Return the list of this rank's sorted int64 index arrays of ``epoch`` from global step ``start_step`` on."""
        self.bind(iterating=True)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples, dtype=np.int64)
        pool_size, size = self.pool_batches * self.global_batch, self.global_batch
        batches = []
        for start in range(0, self.num_samples, pool_size):
            pool = order[start : start + pool_size]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]  # ties keep their random order
            batches += [pool[i : i + size] for i in range(0, len(pool), size)]
        if batches and len(batches[-1]) < size and self.remainder != "partial":  # only the last pool's last batch
            batches[-1:] = [] if self.remainder == "drop" else [_pad(batches[-1], pool, size)]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        share = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return [np.sort(batch)[share] for batch in batches[start_step:]]

    def padding(self, epoch=None):
        """Compare padding with and without bucketing for ``epoch`` (default: the next one).

        Returns:
            dict: ``bucketed`` and ``random``, the share of padded cells in
            ``[B, T]`` batches padded to their longest sample, with this
            rank's batches and with plain random batches of the same size;
            and ``saved``, the share of padded ``[B, T]`` cells per token
            bucketing saves.
        """
        epoch = self.epoch if epoch is None else epoch
        bucketed_cells, bucketed_tokens = _cells(self.lengths, self.batches(epoch))
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        stop = len(self) * self.batch_size if self.drop_last else self.num_samples
        random_batches = [order[i : min(i + self.batch_size, stop)] for i in range(0, stop, self.batch_size)]
        random_cells, random_tokens = _cells(self.lengths, random_batches)
        if not (bucketed_tokens and random_tokens):
            return {"bucketed": 0.0, "random": 0.0, "saved": 0.0}
        return {
            "bucketed": 1 - bucketed_tokens / bucketed_cells,
            "random": 1 - random_tokens / random_cells,
            "saved": 1 - (bucketed_cells / bucketed_tokens) / (random_cells / random_tokens),
        }


def _pad(batch, pool, size):
    """Fill ``batch``, the short end of the length-sorted ``pool``, up to ``size`` with the pool's next-longest."""
    donors = pool[: len(pool) - len(batch)][::-1] if len(pool) > len(batch) else batch
    return np.concatenate([batch, np.resize(donors, size - len(batch))])


def _cells(lengths, batches):
    """Return ``(cells of the padded batches, tokens in them)``."""
    cells = sum(int(lengths[batch].max(initial=0)) * len(batch) for batch in batches)
    tokens = sum(int(lengths[batch].sum()) for batch in batches)
    return cells, tokens
