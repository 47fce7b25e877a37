"""make_loader(): batches from a packed dataset, read whole and without collation.

NOTE [in-process default]: measured on a 2-core machine (5,000 images at
64x64, batch 256), sorted batch reads from a memory map ran at ~1,000,000
img/s in the main process but ~35,000 img/s through a DataLoader with 2
workers, where every batch crosses processes in a new shared-memory tensor.
So raw batches are read in the main process (inline, or by a background
thread once the training step gives it time to overlap, see NOTE [adaptive
read-ahead]), and JPEG batches are decoded by a thread pool (the decoder
releases the GIL). Worker processes are used only when
asked for with ``num_workers > 0``, and then each worker reads whole batches.

NOTE [auto workers]: ``num_workers="auto"`` takes num_workers and
prefetch_factor (unless prefetch_factor is given) from what `fastdata tune
FILE` saved beside the file, ``FILE.tune.json``. It never changes
batch_size, which changes training itself, not only its speed: tune prints
a full call to copy instead. The saved file records the tuned file's size
and modification time; where they differ (another file, re-converted or
copied) it is ignored with a warning. With no saved file, 0 workers (see
NOTE [in-process default]).
"""

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from fastdata._cpu import usable_cpus
from fastdata.errors import OptionError
from fastdata.loading.datasets import PackedDataset
from fastdata.loading.device import make_pipeline
from fastdata.loading.helper import HelperProcess
from fastdata.loading.overlap import LoopBody, read_on_thread
from fastdata.loading.recommendation import read_recommendation
from fastdata.loading.samplers import BatchIndexSampler, EpochSampler, resolve_rank
from fastdata.loading.state import Resumable, Steps
from fastdata.loading.transport import SharedSlots
from fastdata.loading.workers import WorkerLoader, worker_loader
from fastdata.reading import rowcopy
from fastdata.reading.order import SHUFFLES
from fastdata.reading.readahead import ReadAhead
from fastdata.reading.remote import ShardReadAhead, prefetch_shards, remote_block_settings
from fastdata.reading.shuffles import block_settings, choose_shuffle

GROUP_BYTES = 2 * rowcopy.PARALLEL_BYTES  # small batches are read this many bytes at a time: NOTE [grouped reads]
MAX_GROUP = 16  # batches in one read at most


def make_loader(
    dataset: PackedDataset,
    batch_size: int = 256,
    *,
    shuffle: bool | str = False,
    seed: int = 0,
    drop_last: bool = False,
    remainder: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    block_size: int | None = None,
    window: int | None = None,
    num_workers: int | str = 0,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = None,
    persistent_workers: bool = True,
    multiprocessing_context: str | None = None,
    pad_to: int | None = None,
    batch_sampler: Iterable | None = None,
    device: str | torch.device | None = None,
    augment: Callable | None = None,
    normalize: bool | tuple = False,
    dtype: torch.dtype | None = None,
    memory_format: torch.memory_format | None = None,
    threads: int | None = None,
    helper_process: bool | str = "auto",
) -> "BatchLoader | WorkerLoader":
    """Build a loader yielding ``(images uint8 [B, 3, H, W], labels int64 [B])``.

    On a text file it yields ``(tokens int64 [B, T], lengths int64 [B],
    labels int64 [B])``, tokens padded with the file's pad id. Under
    ``torch.distributed`` each rank reads its share of every global batch of
    ``batch_size * world_size`` samples, in one order for any world size and
    number of workers (see NOTE [global order] in order.py); every rank
    yields ``len(loader)`` batches, and at the first iteration the ranks
    compare their loaders and refuse to differ (see NOTE [rank agreement]
    in agreement.py). ``state_dict()`` and
    ``load_state_dict()`` checkpoint and resume mid-epoch (see NOTE [loader
    state]). With ``device``, batches come out on that device, augmented,
    normalized, in ``dtype`` and ``memory_format`` (see NOTE [device
    pipeline] in device.py).

    Args:
        dataset: an HDF5Dataset or ArrowDataset, or any object with ``len``
            and ``read_batch(indices, pin_memory, **options)``; its
            ``read_options`` names the options that takes (none if absent).
        batch_size: samples per batch of this rank.
        shuffle: False or "none": in index order; "uniform": a new seeded
            order each epoch; "block": shuffled blocks of consecutive
            samples, then samples within windows of blocks (large sorted
            reads for data bigger than the page cache; read whole into this
            process's memory where it reads alone, NOTE [window reads] in
            windows.py); True: "block" where
            the dataset cannot stay in the page cache, else "uniform" (see
            NOTE [auto shuffle] in shuffles.py; under torch.distributed,
            rank 0 chooses for all); a URL's dataset: "block", windows of
            shards that fit its cache (NOTE [remote shuffle] in remote.py).
        seed: base seed of the order and of ``augment`` (a non-negative int).
        drop_last: same as ``remainder="drop"``.
        remainder: the last, short global batch: "drop"; "pad" it by
            wrapping to the epoch's start; "partial" keeps it short, shared
            evenly by the ranks. Default: "drop" with ``drop_last``, else
            "partial" for one rank and "pad" for more.
        rank: this process's rank; default: torch.distributed's where its
            process group is initialized, else 0 until a group exists when
            the loader is next asked for its length, batches or state (see
            NOTE [late rank] in samplers.py).
        world_size: ranks sharing each global batch; default:
            torch.distributed's, else 1 (until a group exists, as ``rank``).
        block_size: samples per block of ``shuffle="block"``; default: about
            256 KiB of samples (see NOTE [block settings] in shuffles.py).
        window: blocks shuffled together by ``shuffle="block"``; default:
            1,024.
        num_workers: 0 reads in this process with a background thread (the
            fastest for packed files, see NOTE [in-process default]); more
            starts a torch DataLoader whose workers each read whole batches;
            "auto": as `fastdata tune` recommended for the dataset's file, or
            0 where it was not tuned (see NOTE [auto workers]).
        pin_memory: page-locked batches for fast GPU copies; default: only
            where CUDA is available and no ``device`` is given.
        prefetch_factor: batches read ahead (per worker with workers);
            default 2, or the tuned value with ``num_workers="auto"``.
        persistent_workers: keep worker processes between epochs.
        multiprocessing_context: start method for workers ("fork", "spawn", ...).
        pad_to: text only: pad (and cut) every batch to this many tokens;
            default: to the longest sample of each batch.
        batch_sampler: any iterable of index batches, iterated once per
            epoch: a BucketBatchSampler, a list of lists, a torch
            BatchSampler (see NOTE [epoch protocol] in samplers.py);
            replaces batch_size, shuffle, seed, drop_last, remainder, rank,
            world_size, block_size and window.
        device: None: uint8 batches on the CPU, as read; "cpu", "cuda" or a
            torch.device: every batch, labels (and text lengths) included, on
            that device, CUDA copies issued ahead from pinned buffers (the
            read is then not pinned unless ``pin_memory=True``).
        augment: with ``device``: a batched transform of
            fastdata.loading.augment, e.g. ``RandomResizedCrop(224)``, called
            with each batch's global indices, its epoch and ``seed``; a
            leading RandomResizedCrop runs in the JPEG decoder (see NOTE
            [fused crop] in device.py). Images only. One that holds a
            Normalize takes ``normalize=False`` (it would normalize twice).
        normalize: with ``device``: True: ``(x / 255 - mean) / std`` with the
            file's stored per-channel mean and std; or a ``(mean, std)`` pair
            in [0, 1] units; False: none. Images only.
        dtype: with ``device``: the images' dtype (float32, float16,
            bfloat16, ...); default float32 with ``normalize``, else as read
            (or augmented). Normalized images take a floating dtype; without
            ``normalize`` it is a cast only, 0..255, so a dtype that cannot
            hold every value 0..255 (int8, bool, float8) is refused.
        memory_format: with ``device``: e.g. ``torch.channels_last``;
            default: as read (or augmented).
        threads: images only: the threads each reading process copies or
            decodes a batch with; default: every usable core in this process
            (one left to a loop that computes, NOTE [leave a core]), 1 in
            each worker process, all usable cores in a helper process.
        helper_process: read and decode in one process of its own, with
            ``threads`` threads, into shared slots this process maps without
            a copy: off the GIL of a training step that holds it (see NOTE
            [helper process] in helper.py). Replaces ``num_workers``.
            "auto" (default, with ``num_workers=0``): reading moves there
            once the loop body is found to keep its core computing (NOTE
            [auto helper]), with a core left to that loop; False: never.

    Returns:
        an iterable with ``len``, ``batch_size``, ``dataset``, ``sampler``,
        ``pipeline`` (the DevicePipeline of ``device``, or None),
        ``state_dict`` and ``load_state_dict``: a WorkerLoader (holding a
        ``torch.utils.data.DataLoader``, see NOTE [trainers] in workers.py)
        when ``num_workers > 0``, else a BatchLoader.

    Raises:
        TypeError: ``dataset`` is not a fastdata dataset, or ``batch_sampler``
            not an iterable of index batches.
        ValueError: a bad option value; at the first iteration, an OptionError
            where the ranks' loaders differ (dataset, order settings, resume position).

    Example:
        >>> loader = make_loader(HDF5Dataset("train.h5"), batch_size=256, shuffle=True)
        >>> for images, labels in loader: ...
        >>> loader = make_loader(dataset, 256, shuffle=True, device="cuda", augment=RandomResizedCrop(224),
        ...                      normalize=True, dtype=torch.bfloat16, memory_format=torch.channels_last)
    """
    if isinstance(num_workers, str) and num_workers == "auto":
        num_workers, prefetch_factor = _tuned_settings(dataset, prefetch_factor)
    prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
    if not isinstance(num_workers, int) or num_workers < 0:
        raise OptionError(f"num_workers should be a non-negative integer or 'auto', got num_workers={num_workers!r}")
    if not isinstance(prefetch_factor, int) or prefetch_factor < 0:
        raise OptionError(f"prefetch_factor should be a non-negative integer, got {prefetch_factor!r}")
    if not hasattr(dataset, "read_batch"):
        raise TypeError(f"dataset should be a fastdata dataset with read_batch(), got {type(dataset).__name__}")
    if helper_process not in (True, False, "auto"):
        raise OptionError(f"helper_process should be True, False or 'auto', got {helper_process!r}")
    if helper_process is True and num_workers:
        raise OptionError(f"helper_process=True reads in one process of its own and replaces num_workers; got "
                          f"num_workers={num_workers!r} too: pass one of them")
    options = _read_options(dataset, pad_to, threads)
    pipeline = make_pipeline(dataset, device=device, augment=augment, normalize=normalize, dtype=dtype,
                             memory_format=memory_format, seed=seed, ahead=prefetch_factor)
    if pin_memory is None:
        pin_memory = device is None and torch.cuda.is_available()  # a pipeline pins into its own buffers
    order_options = {"shuffle": shuffle, "drop_last": drop_last, "remainder": remainder, "rank": rank,
                     "world_size": world_size, "block_size": block_size, "window": window}
    if batch_sampler is None:
        sampler = _index_sampler(dataset, batch_size, seed, **order_options, one_reader=num_workers == 0)
    else:
        sampler = _check_batch_sampler(batch_sampler, order_options)
    if num_workers == 0:
        helper = auto_helper = None
        if helper_process is True:
            helper = _helper(dataset, sampler, options, pipeline, prefetch_factor, multiprocessing_context,
                             usable_cpus())
        elif helper_process == "auto" and _reads_plainly(dataset):  # see NOTE [auto helper]
            auto_helper = partial(_helper, dataset, sampler, options, pipeline, prefetch_factor,
                                  multiprocessing_context, max(1, usable_cpus() - 1))
        return BatchLoader(dataset, sampler, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                           options=options, pipeline=pipeline, helper=helper, auto_helper=auto_helper)
    batch_bytes = _batch_bytes(dataset, sampler, options, pipeline)
    slots = None if batch_bytes is None else SharedSlots(num_workers, max(prefetch_factor, 1) + 1, batch_bytes)
    return worker_loader(dataset, sampler, slots, options, pipeline, num_workers=num_workers, pin_memory=pin_memory,
                         prefetch_factor=max(prefetch_factor, 1), persistent_workers=persistent_workers,
                         multiprocessing_context=multiprocessing_context)


def _index_sampler(dataset, batch_size, seed, *, shuffle, drop_last, remainder, rank, world_size, block_size,
                   window, one_reader=False):
    """Return the BatchIndexSampler of make_loader's options, its rank and world from torch.distributed by default.

    ``one_reader``: this process reads every batch of its rank (no workers).
    """
    group = dist.is_available() and dist.is_initialized()
    resolve_rank(rank, world_size)  # checked now
    remote = isinstance(dataset, PackedDataset) and getattr(dataset, "is_remote", False)
    fits = not isinstance(dataset, PackedDataset) or choose_shuffle(dataset)[0] == "uniform"  # the page cache
    chosen = shuffle is True or shuffle == "auto"
    shuffle = _shuffle_mode(shuffle, fits and not remote, group)
    if shuffle == "block" and None in (block_size, window):
        chosen = True
        if not isinstance(dataset, PackedDataset):
            raise OptionError(f"shuffle='block' over a {type(dataset).__name__} needs block_size and window")
        default_size, default_window = _default_block_settings(dataset, remote, group)
        block_size, window = block_size or default_size, window or default_window
    sampler = BatchIndexSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                remainder=remainder, rank=rank, world_size=world_size, block_size=block_size,
                                window=window)
    sampler.chosen_here = chosen and not group  # see NOTE [late rank] in samplers.py
    sampler.make_readahead = partial(_readahead, dataset, remote=remote, fits=fits, one_reader=one_reader)
    sampler.readahead = sampler.make_readahead(sampler)
    return sampler


def _readahead(dataset, sampler, *, remote, fits, one_reader):
    """Return the read-ahead that follows ``sampler``'s order on this rank, or None where none pays."""
    if remote and dataset.prefetch != 0:  # see NOTE [remote read-ahead] in remote.py
        ahead = prefetch_shards(dataset, sampler.order)
        return ShardReadAhead(dataset, sampler.order, sampler.rank, sampler.world_size, ahead)
    if fits:
        # NOTE [hints past the cache]: the kernel hints of a ReadAhead (NOTE
        # [read ahead] in readahead.py) cost more than they give while the
        # dataset stays in the page cache: on 5,000 cached 64 px raw samples,
        # batches of 64 in this process (best of 8 epochs, 2 shared cores),
        # 442k img/s without them against 275k with them in uniform order,
        # 361k against 146k in block order. A dataset that fits is read from
        # disk once whatever the order (the read-around pages stay cached),
        # so only one that does not fit gets them.
        return None
    # One process reading alone reads a block order's windows whole, not through the map (NOTE [window
    # reads] in windows.py); workers and ranks share their reads through the page cache.
    alone = sampler.shuffle == "block" and one_reader and sampler.world_size == 1
    windows = dataset.read_windows(sampler.order) if alone else None
    return ReadAhead(dataset, sampler.order, sampler.rank, sampler.world_size, windows=windows, fits=fits)


def _default_block_settings(dataset, remote, group):
    """Return a block shuffle's default ``(block_size, window)``; a remote dataset's are rank 0's for every rank."""
    if not remote:
        return block_settings(dataset)
    settings = list(remote_block_settings(dataset))  # from the cache limit: see NOTE [remote shuffle] in remote.py
    if group and dist.get_world_size() > 1:
        dist.broadcast_object_list(settings, src=0)
    return tuple(settings)


def _shuffle_mode(shuffle, fits, group):
    """Return the order's shuffle mode; True ("auto") is chosen on rank 0 of a process group for every rank."""
    if isinstance(shuffle, bool):
        shuffle = "auto" if shuffle else "none"
    if shuffle not in (*SHUFFLES, "auto"):
        raise OptionError(f"shuffle should be True, False or one of 'none', 'uniform', 'block', 'auto'; "
                          f"got shuffle={shuffle!r}")
    if shuffle != "auto":
        return shuffle
    shuffle = "uniform" if fits else "block"  # see NOTE [auto shuffle] in shuffles.py
    if group and dist.get_world_size() > 1:  # ranks could see other free memory: rank 0 decides for all
        chosen = [shuffle]
        dist.broadcast_object_list(chosen, src=0)
        shuffle = chosen[0]
    return shuffle


def _check_batch_sampler(sampler, order_options):
    """Return ``sampler`` if it can be an iterable of index batches; raise TypeError or ValueError if not."""
    given = [name for name, value in order_options.items() if value is not None and value is not False]
    if given:
        raise OptionError(f"batch_sampler replaces {', '.join(order_options)}; set those on the sampler, "
                          f"got {', '.join(given)}")
    if not isinstance(sampler, Iterable) or isinstance(sampler, (str, bytes, Mapping, np.ndarray, torch.Tensor)):
        raise TypeError(
            "batch_sampler should be an iterable of index batches, e.g. [[0, 1], [2, 3]], a BucketBatchSampler or "
            f"a torch BatchSampler; got {type(sampler).__name__}"
        )
    if isinstance(sampler, Sequence) and len(sampler) and np.ndim(sampler[0]) != 1:
        raise TypeError(
            "batch_sampler should hold index batches (1-D lists or arrays), e.g. [[0, 1], [2, 3]]; "
            f"its first item is {sampler[0]!r}"
        )
    return sampler


def _helper(dataset, sampler, options, pipeline, prefetch_factor, context, threads):
    """Return the HelperProcess that reads ``dataset``'s batches, decoding on ``threads`` threads unless given."""
    if "threads" in _option_names(dataset):
        options = {"threads": threads, **options}
    return HelperProcess(dataset, options, None if pipeline is None else pipeline.reader,
                         slots=max(prefetch_factor, 1) + 3,  # those ahead, the loop's, the one before
                         batch_bytes=_batch_bytes(dataset, sampler, options, pipeline) or 0, context=context)


def _reads_plainly(dataset):
    """Whether ``dataset`` is a PackedDataset of local files read as fastdata reads them (no override)."""
    return (isinstance(dataset, PackedDataset) and not dataset.is_remote
            and type(dataset).read_batch is PackedDataset.read_batch
            and type(dataset).start_batch is PackedDataset.start_batch)


def _batch_bytes(dataset, sampler, options, pipeline):
    """Return the most bytes of a batch ``sampler`` asks for, as read (by a pipeline's reader), or None if unknown."""
    largest = _largest_batch(sampler)
    if largest is None:
        return None
    if pipeline is None:
        return dataset.max_batch_bytes(largest, **options)
    return pipeline.reader.max_batch_bytes(dataset, largest, options)


def _largest_batch(sampler):
    """Return the most samples a batch of ``sampler`` holds, or None where it cannot be known before iterating."""
    if isinstance(getattr(sampler, "batch_size", None), int):  # fastdata's and torch's batch samplers
        return sampler.batch_size
    if isinstance(sampler, Sequence):
        return max((len(batch) for batch in sampler), default=0)
    return None


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
                 helper=None, auto_helper=None):
        self.dataset = self.packed_dataset = dataset
        self.helper = helper  # a HelperProcess that reads every batch, or None: read here
        self._make_auto_helper = auto_helper  # makes the HelperProcess of NOTE [auto helper], or None
        self.auto_helper = None  # that HelperProcess, once made
        self.sampler = sampler
        self.pipeline = pipeline  # a DevicePipeline, or None
        self._steps = Steps(sampler)
        self.batch_size = getattr(sampler, "batch_size", None)  # as a DataLoader's: None where unknown
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.options = options or {}  # keyword options of every read_batch
        self._takes_threads = "threads" in _option_names(dataset)  # see NOTE [leave a core]
        self._body = LoopBody()  # see NOTE [adaptive read-ahead]
        self._next_epoch = None  # see NOTE [next epoch's first batch]

    def __len__(self):
        return len(self.sampler)

    def close(self):
        """End the helper process, if any (a later iteration starts a new one); nothing else holds resources."""
        for helper in (self.helper, self.auto_helper):
            if helper is not None:
                helper.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def __iter__(self):
        position = self._begin_epoch()  # see NOTE [loader state] in state.py: taken before the sampler advances
        first, steps = self._take_next_epoch()
        if self.helper is not None:  # see NOTE [helper process] in helper.py
            batches = self.helper.batches(steps, ahead=max(self.prefetch_factor, 1))
        elif self._make_auto_helper is not None:
            batches = self._switching(steps, first)
        else:
            batches = self._here(_Cuttable(steps), first)
        if self.pipeline is not None:
            batches = self.pipeline.run(batches)
        return self._counted(self._body.timed(batches), position)

    def _read(self, steps):
        """Yield the batch of each step; see NOTE [pipelined reads] and NOTE [grouped reads]."""
        if self.pipeline is None and (group := _read_group(self.dataset, self.sampler, self.batch_size)) > 1:
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
        # local raw images; a group that fails to start (an index out of
        # range) is read batch by batch, so the error comes where it would.
        # A batch kept alive keeps its group's buffer.
        steps, pending = iter(steps), None  # the last group started, not yet yielded
        try:
            while chunk := list(itertools.islice(steps, group)):
                sizes = [len(indices) for _, indices in chunk]
                try:
                    started = self.dataset.start_batches(np.concatenate([indices for _, indices in chunk]), sizes,
                                                         self.pin_memory, **self._options())
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
            return self.dataset.read_batch(indices, self.pin_memory, **self._options())
        return self.pipeline.reader.read(self.dataset, indices, epoch, self.pin_memory, self._options())

    def _options(self):
        if self._takes_threads and "threads" not in self.options and self._body.keeps_a_core_busy():
            # NOTE [leave a core]: decoding on every core starves a training
            # loop that computes on the CPU (of CPU and of the GIL); keep one
            # core for it. A loop that mostly waits (for the GPU) leaves its
            # core to the decoders: with a 5 ms sleep per step on 2 cores,
            # 64x64 JPEG lost 1.2% of the epoch decoding on both cores
            # against 10-14% with one core kept.
            return {**self.options, "threads": max(1, usable_cpus() - 1)}
        return self.options

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
        # of local files move to a helper process reading on the cores but
        # one, once the loop body is busy and computes on its thread
        # (LoopBody.keeps_a_core_busy, measured over its streak of long
        # bodies), and back once it does not: at once either way, mid-epoch
        # (the batches started one way are yielded, the steps not taken yet
        # go the other way). A loop that waits (on a GPU, a sleep) leaves the
        # GIL free and its core to the threads here, and a tight loop pays no
        # message: both read here; so does data that outgrows the page cache,
        # whose read-ahead (hints, windows) follows the order in this process.
        # Measured in one process whose step changed from holding the GIL to
        # sleeping: staying in the helper (one thread) kept 0.50 of a 5 ms
        # sleeping step over 64 px JPEG against 0.67 read here.
        return (self._make_auto_helper is not None and getattr(self.sampler, "readahead", None) is None
                and self._body.keeps_a_core_busy())

    def _switching(self, steps, first):
        """Yield the batch of each step, read here or by the auto helper as each pays in turn (NOTE [auto helper])."""
        steps = iter(steps)
        while True:
            tap = _Cuttable(steps)  # cut where the other way starts to pay: the steps not taken go to it
            yield from self._from_auto_helper(tap, first) if self._helper_pays() else self._here(tap, first)
            if not tap.cut:
                return
            first = None

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
        for batch in self.auto_helper.batches(tap, ahead=max(self.prefetch_factor, 1)):
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
        indices = iter(self.sampler.batches(epoch))
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
        return None, iter(self._steps)


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


def _tuned_settings(dataset, prefetch_factor):
    """Return ``(num_workers, prefetch_factor)`` for ``num_workers="auto"`` (see NOTE [auto workers])."""
    path = getattr(dataset, "path", None)
    tuned = read_recommendation(path) if path is not None else None
    if tuned is None:
        return 0, prefetch_factor
    return tuned["num_workers"], tuned["prefetch_factor"] if prefetch_factor is None else prefetch_factor


def _read_group(dataset, sampler, batch_size):
    """Return how many batches of ``sampler`` are read as one: see NOTE [grouped reads]."""
    if (batch_size is None or getattr(sampler, "readahead", None) is not None or not _reads_plainly(dataset)
            or not dataset.copies_in_background):
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


def _read_options(dataset, pad_to, threads):
    """Return the keyword options ``read_batch`` gets; check them against the dataset."""
    options = {}
    for name, value, applies in (("pad_to", pad_to, "text"), ("threads", threads, "image")):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OptionError(f"{name} should be a positive integer or None, got {name}={value!r}")
        if name not in _option_names(dataset):
            raise OptionError(f"{name} applies to {applies} datasets, got a {getattr(dataset, 'kind', None)!r} "
                              "dataset")
        options[name] = value
    return options


def _option_names(dataset):
    """Return the names of the keyword options ``dataset.read_batch`` takes (none for a plain wrapper)."""
    return getattr(dataset, "read_options", ())
