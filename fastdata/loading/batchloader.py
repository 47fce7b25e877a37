"""BatchLoader: batches read in this process (pipelined, grouped, on a read-ahead thread or the auto helper).

make_loader (loader.py) builds it with the sampler, options and helpers it
chose; see NOTE [in-process default] there.
"""

import itertools
from functools import partial

import numpy as np

from fastdata._cpu import usable_cpus
from fastdata.loading.datasets import PackedDataset
from fastdata.loading.device import read_batch
from fastdata.loading.overlap import LoopBody, read_on_thread
from fastdata.loading.samplers import EpochSampler
from fastdata.loading.state import Resumable, Steps
from fastdata.reading import rowcopy

GROUP_BYTES = 2 * rowcopy.PARALLEL_BYTES  # small batches are read this many bytes at a time: NOTE [grouped reads]
MAX_GROUP = 16  # batches in one read at most


def reads_plainly(dataset):
    """Whether ``dataset`` is a PackedDataset of local files read as fastdata reads them (no override)."""
    return (isinstance(dataset, PackedDataset) and not dataset.is_remote
            and type(dataset).read_batch is PackedDataset.read_batch
            and type(dataset).start_batch is PackedDataset.start_batch)


class BatchLoader(Resumable):
    """Read batches in this process, ``prefetch_factor`` ahead on a background thread.

    Behaves like a DataLoader: iterable, ``len``, ``batch_size``, ``dataset``;
    ``packed_dataset`` is the dataset too, as on a WorkerLoader; resumable
    with ``state_dict`` and ``load_state_dict`` (see NOTE [loader state] in state.py).
    With a ``pipeline`` (a DevicePipeline) batches are read as HostBatches
    and leave through it (see NOTE [device pipeline] in device.py).
    """

    batch_sampler = None  # as a DataLoader's whose sampler yields whole batches: trainers look for it

    def __init__(self, dataset, sampler, *, pin_memory=False, prefetch_factor=2, options=None, pipeline=None,
                 helper=None, auto_helper=None, readahead=None, helper_readahead=None, max_threads=None):
        self.dataset = self.packed_dataset = dataset
        self.helper = helper  # a HelperProcess that reads every batch, or None: read here
        self._make_auto_helper = auto_helper  # makes the HelperProcess of NOTE [auto helper], or None
        self.auto_helper = None  # that HelperProcess, once made
        self.sampler = sampler
        self.pipeline = pipeline  # a DevicePipeline, or None
        # the cursor the read-ahead follows (NOTE [one read-ahead] in state.py); helper_readahead: the one that
        # follows it while the auto helper reads (NOTE [auto helper])
        self.steps = Steps(sampler, readahead, make_helper_readahead=helper_readahead)
        self.batch_size = getattr(sampler, "batch_size", None)  # as a DataLoader's: None where unknown
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.options = options or {}  # keyword options of every read_batch
        names = option_names(dataset)  # asked once: a PackedDataset makes a decoder to say
        self._takes_threads = "threads" in names  # see NOTE [leave a core]
        self._takes_epoch = "epoch" in names
        self.max_threads = max_threads  # make_loader's max_cpu, in cores: None for no cap
        self._body = LoopBody()  # see NOTE [adaptive read-ahead]
        self._next_epoch = None  # see NOTE [next epoch's first batch]

    def __len__(self):
        return len(self.sampler)

    def close(self):
        """End the helper process, if any (a later iteration starts a new one); nothing else holds resources."""
        for helper in (self.helper, self.auto_helper):
            if helper is not None:
                helper.close()
        self.steps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def __iter__(self):
        position = self._begin_epoch()  # see NOTE [loader state] in state.py: taken before the sampler advances
        first, steps = self._take_next_epoch()
        if self.helper is not None:  # see NOTE [helper process] in helper.py
            batches = self.helper.batches(steps, ahead=max(self.prefetch_factor, 1), cursor=self.steps,
                                          threads=self._threads)
        elif self._make_auto_helper is not None:
            batches = self._switching(steps, first)
        else:
            batches = self._here(_Cuttable(steps), first)
        if self.pipeline is not None:
            batches = self.pipeline.run(batches)
        return self._counted(self._body.timed(batches), position)

    def _read(self, steps):
        """Yield the batch of each step; see NOTE [pipelined reads] and NOTE [grouped reads]."""
        if self.pipeline is None and (group := _read_group(self.dataset, self.steps, self.batch_size)) > 1:
            yield from self._read_groups(steps, group)
            return
        if self.pipeline is not None or not _pipelines_reads(self.dataset, self.batch_size):
            for epoch, indices in steps:
                yield self._read_batch(indices, epoch)
            return
        # NOTE [pipelined reads]: a raw batch's copy frees the GIL, so the
        # next step's indices and rows are worked out (Python, ~80 us of a
        # ~300 us step at 64 px) while helper threads copy this batch: each
        # batch is started one step before it is finished and yielded.
        # Measured: see NOTE [copy on two cores] in rowcopy.py. A URL's
        # batch holds its shards in the cache until finished, so the next
        # one starts first only where both batches' shards fit the cache
        # together; else the reader would wait for room it holds itself.
        pending, error = [], None  # (indices, finish) of batches started, not yet yielded
        remote = self.dataset.is_remote
        try:
            for _, indices in steps:
                if pending and remote and not self.dataset.fits_cache(np.concatenate([pending[-1][0], indices])):
                    yield pending.pop(0)[1]()
                try:
                    pending.append((indices, self.dataset.start_batch(indices, self.pin_memory, **self._options())))
                except Exception as exc:  # raised after the batches before it, as a plain read would
                    error = exc
                    break
                if len(pending) > 1:
                    yield pending.pop(0)[1]()
            while pending:
                yield pending.pop(0)[1]()
        finally:
            for _, finish in pending:  # closed early or failed: the copies end before their buffers go
                try:
                    finish()
                except Exception:  # a batch nobody will see: its error is not the one to report
                    pass
        if error is not None:
            raise error

    def _read_groups(self, steps, group):
        """Yield the batch of each step, read ``group`` steps at a time, a group ahead (NOTE [grouped reads])."""
        # NOTE [grouped reads]: a batch under PARALLEL_BYTES is copied by the
        # calling thread alone, and beside its copy a step spends about as
        # long again in Python (the order, the rows, the labels, the lease,
        # the tensors): 32 px raw batches of 256 (786 KB) loaded at 0.47-0.50
        # of a plain np.take of each batch into a fresh array. So such batches
        # are read GROUP_BYTES at a time: one read of the group's indices
        # (start_batches: one take, one lease, one check), yielded as views of
        # its buffer, the next group started (its copy on the helper threads,
        # NOTE [copy on two cores] in rowcopy.py) before this one's batches
        # are yielded. Measured on a converted .h5 file of 30,000 samples at
        # 32 px, warm, batch 256, 7 interleaved rounds in one process on 2
        # cores (/tmp/p32/sweep.py), over that read: groups of 1 0.49-0.50,
        # of 2 (1.5 MiB) 0.88-0.93, of 4 (3 MiB) 0.95-1.05, of 8 0.79-0.81,
        # of 16 0.64-0.67. Only where nothing else follows the order (no
        # read-ahead hints or windows: the data fits the page cache), for
        # local raw images, or beside a read-ahead told the group's size
        # that keeps what the group reads (SequenceWindows.read_in_groups:
        # NOTE [sequence windows]); a group that fails to start (an index out of
        # range) is read batch by batch, so the error comes where it would.
        # A batch kept alive keeps its group's buffer.
        pending = None  # the last group started, not yet yielded
        try:
            while chunk := steps.take(group):
                sizes = [len(indices) for _, indices in chunk]
                options = self._options()
                if self._takes_epoch:  # one iteration's steps: one epoch
                    options = {**options, "epoch": chunk[0][0]}
                try:
                    started = self.dataset.start_batches(np.concatenate([indices for _, indices in chunk]), sizes,
                                                         self.pin_memory, **options)
                except Exception:  # e.g. an index out of range: read one by one, so the batches before it come first
                    started = None
                if pending is not None:
                    finish, pending = pending, None
                    yield from finish()
                if started is None:
                    for epoch, indices in chunk:
                        yield self._read_batch(indices, epoch)
                pending = started
            if pending is not None:
                finish, pending = pending, None
                yield from finish()
        finally:
            if pending is not None:  # closed early or failed: the copy ends before its buffer goes
                pending()

    def _read_batch(self, indices, epoch):
        """Return the batch of ``indices``; with a pipeline a HostBatch of ``epoch`` (see NOTE [device pipeline])."""
        if self.pipeline is None:
            return read_batch(self.dataset, indices, epoch, self.pin_memory, self._options())
        return self.pipeline.reader.read(self.dataset, indices, epoch, self.pin_memory, self._options())

    def _options(self):
        if not self._takes_threads or "threads" in self.options:
            return self.options
        threads = self.max_threads  # None: the decoders' default, every usable core
        if self._body.keeps_a_core_busy() and not self._body.waits_for_data():
            # NOTE [leave a core]: decoding on every core starves a training
            # loop that computes on the CPU (of CPU and of the GIL); keep one
            # core for it. A loop that mostly waits (for the GPU) leaves its
            # core to the decoders: with a 5 ms sleep per step on 2 cores,
            # 64x64 JPEG lost 1.2% of the epoch decoding on both cores
            # against 10-14% with one core kept.
            # NOTE [data-bound loop]: but a loop that waits for its batches
            # gains more from a second decoding core than it loses to it, and
            # the auto helper decodes in a process of its own, whose threads
            # take the loop's core from it by the OS alone. Measured with the
            # helper (benchmarks/results/tmp/p28/probe.py: busystep's 5 ms
            # GIL-holding step, fresh processes in turn, AMD EPYC, 2 cores):
            # 64 px JPEG kept 0.91-0.93 of the loop alone on 1 thread against
            # 0.63-0.85 on 2 (the loop waited 2% against 5%); 224 px JPEG,
            # which one core cannot decode in time, 0.14 on 1 thread against
            # 0.23-0.25 on 2 (waiting 78-85% against 53-56%). So the core is
            # kept unless the loop waits over WAITS_ABOVE of its time, and
            # kept again once it waits under WAITS_UNTIL_BELOW (overlap.py),
            # above the 4-6% that 64 px waited on 2 threads: with 0.02 a 2 ms
            # step (data-bound) before the 5 ms one left every core to the
            # helper for good (busystep kept 0.82 there against 0.89 now).
            threads = max(1, min(usable_cpus() - 1, threads or usable_cpus()))
        return self.options if threads is None else {**self.options, "threads": threads}

    def _threads(self):
        """Return the threads the next batch is decoded with (NOTE [leave a core]), or None: the reader's own."""
        return self._options().get("threads") if self._takes_threads else None

    def _helper_pays(self):
        """Whether batches should come from the auto helper process now: see NOTE [auto helper]."""
        # NOTE [auto helper]: loader threads in the training process need the
        # GIL (a JPEG decode thread once per image, a raw read a few times a
        # batch), and a step that holds it (Python and small torch calls)
        # makes each of them wait up to the switch interval; a helper process
        # reads off that GIL (NOTE [helper process] in helper.py) and costs
        # the training thread one small message per batch. Busy-step section,
        # 2 cores, quiet, 64 px raw: kept 0.90 / 0.83 / 0.95 of the step rate
        # in this process beside steps holding the GIL 2 / 5 / 20 ms, 0.94 /
        # 0.96 / 1.00 from the helper. So with helper_process="auto" batches
        # of local files move to a helper process reading on every usable
        # core (as helper_process=True), once the loop body is busy and
        # computes on its thread (LoopBody.keeps_a_core_busy, measured over
        # its streak of long bodies), and back once it does not: at once either way, mid-epoch
        # (the batches started one way are yielded, the steps not taken yet
        # go the other way). A loop that waits (on a GPU, a sleep) leaves the
        # GIL free and its core to the threads here, and a tight loop pays no
        # message: both read here. Data that outgrows the page cache moves
        # too, its read-ahead with it (see _read_ahead_in).
        # Measured in one process whose step changed from holding the GIL to
        # sleeping: staying in the helper (one thread) kept 0.50 of a 5 ms
        # sleeping step over 64 px JPEG against 0.67 read here. With one
        # core left to the loop (one helper thread on 2 cores), the defaults
        # kept 0.29-0.46 of a 5 ms GIL-holding step over 64 px JPEG where
        # helper_process=True (threads on both cores) kept 0.51-0.54; with
        # its threads on every core, 0.33 / 0.56 / 1.07 beside 2 / 5 / 20 ms
        # steps against 0.32 / 0.57 / 1.04 for helper_process=True, 64 px raw
        # unchanged (0.90 / 0.92 / 0.97), in one busystep run: the OS shares
        # the cores between the helper's threads and the loop.
        # Windows shared with the other ranks of the machine stay here: each rank reads its share of them
        # (NOTE [shared windows] in reading/sharedwindows.py).
        if getattr(self.steps.readahead, "shared", False):
            return False
        return self._make_auto_helper is not None and self._body.keeps_a_core_busy()

    def _switching(self, steps, first):
        """Yield the batch of each step, read here or by the auto helper as each pays in turn (NOTE [auto helper])."""
        steps = iter(steps)
        while True:
            tap = _Cuttable(steps)  # cut where the other way starts to pay: the steps not taken go to it
            in_helper = self._helper_pays()
            self._read_ahead_in(in_helper)
            yield from self._from_auto_helper(tap, first) if in_helper else self._here(tap, first)
            if not tap.cut:
                return
            first = None

    def _read_ahead_in(self, helper):
        """Have the read-ahead of the order run where the next steps are read: in the auto helper or here.

        NOTE [auto helper] (continued): data bigger than the page cache has a
        read-ahead that follows the order (kernel hints, a block order's
        windows read whole), and it must run in the process that reads
        (NOTE [read-ahead in the helper] in helper.py). So from the step
        where reading moves, the read-ahead of the side left ends (a
        window's memory here goes with it; the helper's ends at once) and
        the other side's starts at that step, made anew. A forked helper
        drops the pages of the windows it inherits (NOTE [windows after
        fork] in windows.py).
        """
        if not self.steps.read_in_helper(helper):
            return
        if helper:
            self.dataset.drop_windows()
        elif self.auto_helper is not None:
            self.auto_helper.drop_readahead()

    def _here(self, tap, first):
        """Return the batches of the steps of ``tap`` read in this process (inline, or ahead on a thread)."""
        batches = self._read(tap)
        return self._read_ahead(batches, first, tap) if self.prefetch_factor > 0 else batches

    def _from_auto_helper(self, tap, first=None):
        """Yield ``first`` (if read already), then the batch of each step of ``tap``, read by the auto helper."""
        if self.auto_helper is None:
            self.auto_helper = self._make_auto_helper()
        if first is not None:
            yield first
        for batch in self.auto_helper.batches(tap, ahead=max(self.prefetch_factor, 1), cursor=self.steps,
                                              threads=self._threads):
            yield batch
            if not tap.cut and not self._helper_pays():  # the steps sent are still received and yielded
                tap.cut = True

    def _read_ahead(self, batches, first, tap):
        """Yield from ``batches``, read ahead on a thread once the consumer does real work.

        NOTE [adaptive read-ahead]: handing batches over from a thread costs
        ~35% of the rate of a loop that does nothing but read (measured 0.85M
        against 1.3M img/s at 64x64: GIL hand-offs per batch), yet a training
        step that runs while the thread reads hides the read entirely. So
        batches are read inline until STREAK loop bodies in a row take longer
        than BUSY_CONSUMER_SECONDS (overlap.py); then a thread reads the rest
        of the epoch, in the same order, and later epochs from their start
        until STREAK short bodies in a row. One slow body is not enough: a
        single pause (a garbage collection) once switched a tight JPEG loop
        to the thread for good, at 53k against 85k img/s (64x64, 2 cores).
        """
        if first is None:
            batches = iter(batches)
            if not self._body.busy:
                for batch in batches:
                    yield batch
                    if self._body.busy:  # timed by self._body.timed, which wraps this generator
                        break
                else:
                    return
                if self._helper_pays():  # the batches started here end here, the steps not taken go to the helper
                    tap.cut = True
                    yield from batches
                    return
        # ``first`` was read early: the consumer was busy (see NOTE [next epoch's first batch])
        at_end = partial(self._read_next_epoch_start, tap)
        for batch in read_on_thread(batches, self.prefetch_factor, at_end, first):
            yield batch
            if not tap.cut and self._helper_pays():  # the thread reads what it started, then ends
                tap.cut = True

    def _read_next_epoch_start(self, tap):
        """On the read-ahead thread, after the last batch: read the next epoch's first batch.

        NOTE [next epoch's first batch]: the first batch of an epoch cannot be
        read ahead within that epoch, so a busy loop would wait for it every
        epoch (~3% of an 8-batch epoch of 5 ms steps). It is read while the
        loop works on the previous epoch's last batches instead, from the
        sampler's ``batches(epoch)`` of the next epoch (an EpochSampler; see
        NOTE [epoch protocol]; other samplers' epochs are read when they
        start). If the next epoch is then changed to another one
        (``set_epoch``), the batch is dropped and the epoch read anew.
        """
        if not isinstance(self.sampler, EpochSampler) or not self._body.busy or tap.cut:  # not busy: read inline
            return
        epoch = self.sampler.epoch
        indices = iter(self.steps.batches(epoch))
        try:
            first = self._read_batch(next(indices), epoch)
        except Exception:  # StopIteration or a read error: the next epoch reads (and raises) as usual
            return
        self._next_epoch = (epoch, first, indices)

    def _take_next_epoch(self):
        """Return ``(first batch or None, the epoch's remaining (epoch, batch indices))``."""
        if self._next_epoch is not None:
            epoch, first, indices = self._next_epoch
            self._next_epoch = None
            if self.sampler.epoch == epoch and self.sampler.start_step == 0:  # untouched, or set_epoch to the same
                self.sampler.set_epoch(epoch + 1)  # this epoch is read: as iterating the sampler would
                return first, ((epoch, batch) for batch in indices)
        return None, iter(self.steps)


class _Cuttable:
    """An iterator over ``steps`` that ends early once ``cut`` is set; ``steps`` goes on from there."""

    def __init__(self, steps):
        self.steps, self.cut = iter(steps), False

    def __iter__(self):
        return self

    def __next__(self):
        if self.cut:
            raise StopIteration
        return next(self.steps)

    def take(self, count):
        """Return the next ``count`` steps (fewer at the end, none once cut) in one call: 0.3 us a step less
        than ``__next__`` each."""
        return [] if self.cut else list(itertools.islice(self.steps, count))


def _read_group(dataset, steps, batch_size):
    """Return how many batches of ``steps`` (a Steps) are read as one: see NOTE [grouped reads]; a dataset with
    ``batches_per_read`` says (NOTE [grouped sequences] in sequences.py)."""
    if batch_size is None:
        return 1
    if steps.readahead is not None:  # groups only where the read-ahead keeps what they read (SequenceWindows)
        if not (hasattr(dataset, "batches_per_read") and hasattr(steps.readahead, "read_in_groups")):
            return 1
        group = min(dataset.batches_per_read(batch_size), steps.readahead.batches_per_read(batch_size))
        steps.readahead.read_in_groups(group)
        return group
    if hasattr(dataset, "batches_per_read"):
        return dataset.batches_per_read(batch_size)
    if not reads_plainly(dataset) or not dataset.copies_in_background:
        return 1
    return max(1, min(MAX_GROUP, GROUP_BYTES // dataset.max_batch_bytes(batch_size)))


def _pipelines_reads(dataset, batch_size):
    """Whether batches of ``batch_size`` of ``dataset`` are started a step early: see NOTE [pipelined reads].

    Only where the rows copy in the background (batches of PARALLEL_BYTES or more), and never past a
    subclass's own ``read_batch``. Below that a batch is copied as it is started, and starting it early
    only cost: 290-313 us a step against 354-372 us pipelined (32 px raw, 786 KB batches, /tmp/rc/split.py).
    """
    return (isinstance(dataset, PackedDataset) and type(dataset).read_batch is PackedDataset.read_batch
            and dataset.copies_in_background
            and (batch_size is None or dataset.max_batch_bytes(batch_size) >= rowcopy.PARALLEL_BYTES))


def option_names(dataset):
    """Return the names of the keyword options ``dataset.read_batch`` takes (none for a plain wrapper)."""
    return getattr(dataset, "read_options", ())
