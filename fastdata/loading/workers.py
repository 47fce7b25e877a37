"""make_loader's worker processes: a loader holding a torch DataLoader whose workers read whole batches."""

from contextlib import nullcontext

from torch.utils.data import DataLoader

from fastdata._processes import end_processes, held_signals, release_sigterm, start_method
from fastdata.errors import FormatError
from fastdata.loading.device import HostBatch, read_batch
from fastdata.loading.state import Resumable, Steps
from fastdata.loading.transport import SlotBatch


def worker_loader(dataset, sampler, slots, options, pipeline, readahead=None, **loader_options):
    """Return a WorkerLoader whose workers read ``sampler``'s batches of ``dataset`` whole, into ``slots`` if given.

    ``readahead``: make_loader's maker of the sampler's ReadsAhead (NOTE [one read-ahead] in state.py), or None.
    ``loader_options``: num_workers, pin_memory, prefetch_factor, persistent_workers, multiprocessing_context.
    """
    reader = None if pipeline is None else pipeline.reader
    return WorkerLoader(_WholeBatches(dataset, slots, options, reader), sampler, pipeline, readahead, **loader_options)


class WorkerLoader(Resumable):
    """Batches read by worker processes, each batch whole, through shared slots.

    See NOTE [slot transport]. Iterating yields plain tensors, like a DataLoader.
    Its ``dataset`` hands out whole batches; ``packed_dataset`` is the file's dataset.
    Resumable with ``state_dict`` and ``load_state_dict`` (see NOTE [loader state] in state.py).
    With a ``pipeline`` (a DevicePipeline) the workers read HostBatches and the
    pipeline runs here, on the batches as they arrive (see NOTE [device pipeline]).
    Not a DataLoader itself: see NOTE [trainers].
    """

    _unfinished = None  # the torch iterator of an iteration left before its end (NOTE [abandoned iterations])
    batch_sampler = None  # as a DataLoader's whose sampler yields whole batches: trainers look for it

    def __init__(self, dataset, sampler, pipeline=None, readahead=None, **loader_options):
        self.dataset, self.sampler, self.pipeline = dataset, sampler, pipeline
        self.batch_size = getattr(sampler, "batch_size", None)  # as a DataLoader's: None where unknown
        # with a pipeline (a HostBatch: see NOTE [device pipeline]), or a dataset that reads by epoch (a Mixture),
        # the workers get (epoch, indices)
        epochs = pipeline is not None or "epoch" in getattr(dataset.dataset, "read_options", ())
        self.steps = Steps(sampler, readahead, epochs=epochs)  # NOTE [one read-ahead] in state.py
        self._loader = DataLoader(dataset, batch_size=None, sampler=self.steps, collate_fn=_as_is,
                                  worker_init_fn=_start_worker, **loader_options)
        for name in ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "multiprocessing_context"):
            setattr(self, name, getattr(self._loader, name))

    @property
    def packed_dataset(self):
        """The HDF5Dataset or ArrowDataset the workers read."""
        return self.dataset.dataset

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        self._end_unfinished()
        position = self._begin_epoch()  # see NOTE [loader state]
        iterator = None
        self.steps.follow()  # bound to a process group now: its advice goes to the workers starting below
        try:
            with held_signals(start_method(self._loader.multiprocessing_context)):  # NOTE [forked SIGTERM]
                self._unfinished = iterator = iter(self._loader)  # the workers start here
            batches = self._unpacked(self._while_current(iterator))
            if self.pipeline is not None:
                batches = self.pipeline.run(batches)
            yield from self._counted(batches, position)
            if self._unfinished is not iterator:  # ended by a later iteration: its batches stopped short
                raise RuntimeError("this iteration of a loader with workers was ended when another iteration of "
                                   "it began: a loader with workers feeds one iteration at a time")
            self._unfinished = None
        finally:  # a break, an exception in the loop, or the iterator dropped
            if iterator is not None and self._unfinished is iterator:
                self._end_unfinished()

    def _while_current(self, iterator):
        """Yield ``iterator``'s batches while it is this loader's iteration (NOTE [abandoned iterations]).

        Once a later iteration has ended it, a batch torch still held belongs to
        a slot the new workers write: it is neither read nor freed.
        """
        while self._unfinished is iterator:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch

    def _end_unfinished(self):
        """Stop the workers of an iteration left before its end and free every slot (NOTE [abandoned iterations])."""
        iterator, self._unfinished = self._unfinished, None
        if iterator is None:
            return
        _stop_workers(iterator)
        if self._loader._iterator is iterator:  # persistent workers: the next iteration starts new ones
            self._loader._iterator = None
        if self.dataset.slots is not None:
            self.dataset.slots.busy.zero_()  # no worker is left to write, no batch left to read

    def _unpacked(self, batches):
        try:
            for batch in batches:
                if isinstance(batch, HostBatch):
                    yield batch._replace(tensors=_unpack(batch.tensors))
                else:
                    yield _unpack(batch)
        except RuntimeError as exc:  # see NOTE [worker bus error]
            changed = self.packed_dataset.changed_files() if _died(exc) else None
            if changed:
                raise changed_under("a DataLoader worker", changed) from exc
            raise

    def close(self):
        """Stop the worker processes now (a later epoch starts new ones)."""
        self._end_unfinished()
        close_workers(self._loader)
        self.steps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


# NOTE [trainers]: Lightning and accelerate rebuild any torch DataLoader
# they are given around a sampler of their own (Lightning's
# DistributedSamplerWrapper under DDP, accelerate's DataLoaderShard over a
# SequentialSampler), which knows nothing of fastdata's global batches:
# under Lightning each rank trained 3 of its 5 batches, then the
# checkpoint raised; under accelerate the first batch raised. Both pass
# through untouched any loader that is not a DataLoader, as they do
# Mosaic's and LitData's, and both find what they use on it: ``len``,
# ``sampler.set_epoch``, ``state_dict``/``load_state_dict`` (Lightning's
# _Stateful). So the WorkerLoader holds its DataLoader instead of being
# one, as the 0-worker BatchLoader never was one.


# NOTE [abandoned iterations]: batches a worker has read ahead wait in its
# shared slots (NOTE [slot transport] in transport.py) until the main
# process copies them out. A loop that left an epoch early (a break, an
# exception, Lightning's limit_val_batches or sanity check) never copied
# them, so their slots stayed busy, and with persistent workers the next
# iteration's workers waited 5 s per batch for a slot that never freed: a
# full epoch of a worker loader fell from 10,435 to 22 img/s after three
# loops that stopped after two batches (32 px raw, 2 workers, batch 64;
# /tmp/p26/abandon.py). Torch's own reset drops those batches without a
# word. So an iteration left early stops its workers (the next starts
# fresh ones, as a non-persistent loader does each epoch) and frees every
# slot once none is left to write: at its close (a break closes the
# generator), or when the next iteration or ``close()`` finds it open.


# NOTE [worker bus error]: a worker reads its files through memory maps,
# and a file truncated under a map kills the reader with SIGBUS on its next
# touch past the new end. A worker's own check (NOTE [shard fingerprint] in
# reading/fingerprints.py) catches the change only where it runs before that touch: a
# JPEG .h5 (1.9 MB) truncated to half 0.5-1.2 s into reading with 2 workers
# gave torch's "DataLoader worker ... killed by signal: Bus error ... out
# of shared memory" or "... exited unexpectedly" in 4 of 8 trials (a raw
# .h5 in 0 of 8: the check came first). So on such an error the files are
# looked at (one stat each) and a change is reported as the FormatError it
# is, naming the file (8 of 8 after); with no change the error is torch's.


def changed_under(reader, changed):
    """Return the FormatError for ``reader`` (a process) killed reading files that changed: ``{path: what}``."""
    return FormatError(
        f"{reader} was killed reading a file that changed under it: "
        + "; ".join(f"{path!r} {what}" for path, what in changed.items())
        + ". A packed file must not change while it is read; open it again (open_dataset) to read the new file, "
        "or put the old one back.")


def _died(exc):
    """Whether ``exc`` is torch's report of a worker that died (by a signal, or exited) rather than one that raised."""
    return "killed by signal" in str(exc) or "exited unexpectedly" in str(exc)


def _unpack(batch):
    return batch.unpack() if isinstance(batch, SlotBatch) else batch


# NOTE [torch internals]: torch has no public way to stop a DataLoader's
# persistent workers before the loader is garbage collected, nor to list
# them; the functions below are the one place fastdata reaches into a
# DataLoader's private iterator for that, so a torch change breaks only here.
#
# NOTE [bounded stop]: torch's shutdown sends each worker its end, joins it
# for 5 s, then sends SIGTERM and joins 5 s more, and returns with a worker
# that outlived both still running: a worker stuck where SIGTERM could not
# reach it was alive after close() (10.1 s) and lived on for as long as it
# was stuck (tests/loading/test_worker_ends.py). So what torch leaves alive
# is killed (end_processes): close() ended that worker in 10.4 s.


def close_workers(loader: "DataLoader | WorkerLoader") -> None:
    """Stop ``loader``'s persistent worker processes now rather than at some later garbage collection."""
    if isinstance(loader, WorkerLoader):
        loader.close()
        return
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        _stop_workers(iterator)
        loader._iterator = None


def _stop_workers(iterator):
    """Stop a DataLoader iterator's workers: torch's shutdown, then kill any it left alive (NOTE [bounded stop])."""
    if hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()  # its SIGTERM had its 5 s: no second grace
        end_processes(getattr(iterator, "_workers", []), timeout=0)


def _start_worker(worker_id):
    """A worker's first step of its own: let through a SIGTERM held since its fork (torch's handler ends it now)."""
    release_sigterm()


def worker_pids(loader: "DataLoader | WorkerLoader") -> list[int]:
    """Return the pids of ``loader``'s live persistent worker processes ([] without them)."""
    loader = loader._loader if isinstance(loader, WorkerLoader) else loader
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None) or []
    return [worker.pid for worker in workers if worker.is_alive()]


class _WholeBatches:
    """Dataset whose items are whole batches: ``self[indices] -> read_batch(indices)``."""

    def __init__(self, dataset, slots=None, options=None, reader=None):
        self.dataset = dataset
        self.slots = slots
        self.options = options or {}
        self.reader = reader  # a pipeline's HostReader: items are then (epoch, indices), read as HostBatches

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, indices):
        with nullcontext(_as_is) if self.slots is None else self.slots.packing() as pack:
            if self.reader is None and "epoch" not in getattr(self.dataset, "read_options", ()):
                return pack(self.dataset.read_batch(indices, **self.options))
            epoch, indices = indices
            if self.reader is None:
                return pack(read_batch(self.dataset, indices, epoch, options=self.options))
            batch = self.reader.read(self.dataset, indices, epoch, options=self.options)
            return batch._replace(tensors=pack(batch.tensors))


def _as_is(batch):
    return batch
