"""Where a loader stands in its epochs: the step cursor its read-ahead follows, and its resumable state."""

from collections.abc import Mapping

from fastdata.errors import OptionError
from fastdata.loading.agreement import check_agreement
from fastdata.loading.samplers import EpochSampler

STATE_VERSION = 3  # of state_dict's format and of its order (3: NOTE [keyed bijection]'s 32-bit mix); others refused


class Steps:
    """The cursor a loader and its read-ahead both follow: a batch sampler's batches as ``(epoch, indices)``.

    NOTE [one read-ahead]: every way of getting ahead of the reader (kernel
    hints, window reads, shard fetches; readahead.ReadsAhead) is told by
    this cursor, and only by it, where an epoch starts and which step's
    indices were just produced, as the loader asks for them: the sampler
    stays a pure order, and a walk of it elsewhere moves nothing (Mosaic
    Streaming's iterator is shared the same way by its yield loop and its
    download thread). ``make_readahead(sampler)`` (make_loader's) returns
    the ReadsAhead of the sampler's order, or None where none pays; it is
    made again when binding to a process group changed the order, before
    the loader's workers start (the advice it sets travels with the dataset).
    The epoch goes with each batch to the device pipeline's augmentation
    (see NOTE [device pipeline]); ``epochs=False`` yields the indices alone.
    ``make_helper_readahead(sampler)`` makes the one that follows the order
    while a helper process reads the batches (NOTE [auto helper] in
    batchloader.py): ``read_in_helper`` changes between the two from the
    next step on.
    """

    def __init__(self, sampler, make_readahead=None, *, epochs=True, make_helper_readahead=None):
        self.sampler, self.epochs, self._with_epochs = sampler, 0, epochs
        self._makers = {False: make_readahead, True: make_helper_readahead}
        self.in_helper = False  # whose read-ahead follows the order: the helper process's, or this process's
        self._order, self.readahead = None, None
        self.follow()

    def follow(self):
        """Return the ReadsAhead of the sampler's order as bound now (made again where binding changed it), or None."""
        maker = self._makers[self.in_helper]
        if maker is None:
            return None
        self.sampler.bind()
        if self.sampler.order is not self._order:
            self.close()
            self._order, self.readahead = self.sampler.order, maker(self.sampler)
        return self.readahead

    def read_in_helper(self, in_helper):
        """Have the helper process's read-ahead (``in_helper``) or this process's follow the order from the next step
        on; the one left is closed and made again when it is wanted back. Return whether anything changed."""
        if in_helper == self.in_helper:
            return False
        self.close()
        self.in_helper, self.readahead, self._order = in_helper, None, None  # made by the next follow()
        return True

    def batches(self, epoch, start=0):
        """Yield an EpochSampler's indices of ``epoch``'s batches from step ``start`` on, telling the read-ahead."""
        self.sampler.bind(iterating=True)
        readahead = self.follow()
        if readahead is None and self._makers[True] is None:
            yield from self.sampler.batches(epoch, start)
            return
        if readahead is not None:
            readahead.start(epoch, start)
        in_helper = self.in_helper
        for step, indices in enumerate(self.sampler.batches(epoch, start), start):
            if self.in_helper != in_helper:  # read_in_helper: the other read-ahead starts at this step
                readahead, in_helper = self.follow(), self.in_helper
                if readahead is not None:
                    readahead.start(epoch, step)
            if readahead is not None:
                readahead.advance(step)
            yield indices

    def __iter__(self):  # a generator: the epoch is taken when the first batch is asked for, as the sampler's
        if isinstance(self.sampler, EpochSampler):
            self.sampler.bind(iterating=True)
            epoch, start = self.sampler.take_epoch()
            batches = self.batches(epoch, start)
        else:
            epoch, self.epochs = self.epochs, self.epochs + 1
            batches = iter(self.sampler)
        for indices in batches:
            yield (epoch, indices) if self._with_epochs else indices

    def __len__(self):
        return len(self.sampler)

    def close(self):
        """End the read-ahead's threads (the next epoch starts them again)."""
        if self.readahead is not None:
            self.readahead.close()


class Resumable:
    """``state_dict`` and ``load_state_dict`` of a loader over an EpochSampler.

    NOTE [loader state]: the state names a position in the global order
    (NOTE [global order] in order.py): the epoch and the samples of the
    global steps whose batches this loader handed to the loop, counted as
    they are yielded, not as they are read ahead (by the read-ahead thread,
    the next epoch's first batch or workers). Resuming sets the sampler's
    epoch and start step, O(1), and the next iteration continues there;
    as the order depends on the global batch only, on any world size and
    number of workers. The state also holds the settings that decide the
    order and the dataset's fingerprint; a state whose settings differ
    would continue another order, so it is refused.
    """

    sampler: EpochSampler
    _position = None  # [epoch, steps handed] of the iteration in progress, or None between epochs
    _agreed = False  # the ranks compared this loader: not again (see NOTE [rank agreement] in agreement.py)

    def _begin_epoch(self):
        """Return ``[epoch, start step]`` of the epoch about to be iterated (None without an EpochSampler).

        Raises:
            OptionError: at the first iteration under a process group, the ranks' loaders differ (see NOTE
                [rank agreement]).
        """
        if not self._agreed:
            self._agreed = check_agreement(self)
        if isinstance(self.sampler, EpochSampler):
            self._position = [self.sampler.epoch, self.sampler.start_step]
            return self._position
        return None

    def _counted(self, batches, position):
        """Yield ``batches``, counting in ``position`` those handed over; forget it at the epoch's end."""
        if position is None:
            yield from batches
            return
        for batch in batches:
            position[1] += 1  # handed over once yielded: a state taken in the loop body counts this batch
            yield batch
        if self._position is position:  # not replaced by a later iteration or a load_state_dict
            self._position = None

    def state_dict(self) -> dict:
        """Return where the loader stands, JSON-able: the epoch and samples consumed in it, and what decides the order.

        Raises:
            TypeError: the loader's batch sampler is not an EpochSampler.
        """
        sampler = self._epoch_sampler()
        epoch, step = self._position or (sampler.epoch, sampler.start_step)
        if step >= len(sampler):
            epoch, step = epoch + 1, 0
        return {"version": STATE_VERSION, "dataset": _fingerprint(self.packed_dataset), **sampler.describe(),
                "epoch": epoch, "samples_consumed": step * sampler.global_batch}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue at the position of ``state`` (from ``state_dict``) with the next iteration, in O(1).

        Raises:
            TypeError: ``state`` is not a mapping, or the batch sampler not an EpochSampler.
            ValueError: ``state`` is from another dataset or order settings, or malformed.
        """
        sampler = self._epoch_sampler()
        if not isinstance(state, Mapping):
            raise TypeError(f"state should be a dict from loader.state_dict(), got {type(state).__name__}")
        expected = {"version": STATE_VERSION, "dataset": _fingerprint(self.packed_dataset), **sampler.describe()}
        if sampler.num_samples % sampler.global_batch == 0:  # no short last batch: every remainder gives one order
            del expected["remainder"]  # (a default that differs between one rank and more)
        _check_state(state, expected)
        epoch, consumed = state.get("epoch"), state.get("samples_consumed")
        steps = consumed // sampler.global_batch if isinstance(consumed, int) else -1
        if not isinstance(epoch, int) or epoch < 0 or not 0 <= steps <= len(sampler) or \
                consumed != steps * sampler.global_batch:
            raise OptionError(f"state has epoch={epoch!r} and samples_consumed={consumed!r}; expected an epoch >= 0 "
                              f"and a multiple of the global batch ({sampler.global_batch}) up to "
                              f"{len(sampler) * sampler.global_batch}; pass a dict from loader.state_dict()")
        sampler.resume(epoch, steps)
        self._position = None
        self._next_epoch = None  # a next epoch's first batch read early is of another position

    def _epoch_sampler(self):
        if not isinstance(self.sampler, EpochSampler):
            raise TypeError(f"a loader over a {type(self.sampler).__name__} cannot say where an epoch stands; "
                            "make it with make_loader's own sampler or a BucketBatchSampler to checkpoint it")
        return self.sampler



def _fingerprint(dataset):
    return getattr(dataset, "fingerprint", None)


def _check_state(state, expected):
    """Raise OptionError naming the first field of ``state`` that differs from ``expected``."""
    for field, ours in expected.items():
        saved = state.get(field)
        if saved == ours:
            continue
        if field == "dataset":
            advice = "resume over the dataset it was saved from (a copy of it is fine)"
        elif field == "global_batch":
            advice = f"make the loader with batch_size * world_size = {saved!r}"
        elif field == "version":
            advice = "save the state again with this version of fastdata"
        else:
            advice = f"make the loader with {field}={saved!r}"
        raise OptionError(f"cannot resume from this state: its {field} is {saved!r}, this loader's is {ours!r}; "
                          f"{advice}")
