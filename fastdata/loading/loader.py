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

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from fastdata._cpu import usable_cpus
from fastdata.errors import OptionError
from fastdata.loading.batchloader import BatchLoader, option_names, reads_plainly
from fastdata.loading.collectives import broadcast_object
from fastdata.loading.datasets import PackedDataset
from fastdata.loading.device import make_pipeline
from fastdata.loading.helper import HelperProcess, HelperReadAhead
from fastdata.loading.localranks import in_process_group
from fastdata.loading.mixture import Mixture
from fastdata.loading.recommendation import read_recommendation
from fastdata.loading.records import RecordDataset
from fastdata.loading.samplers import BatchIndexSampler, resolve_rank
from fastdata.loading.sequences import TokenSequences, token_sequences
from fastdata.loading.transport import SharedSlots
from fastdata.loading.workers import WorkerLoader, worker_loader
from fastdata.reading.order import SHUFFLES
from fastdata.reading.readahead import ReadAhead
from fastdata.reading.remote import ShardReadAhead, prefetch_shards, remote_block_settings
from fastdata.reading.sharedwindows import SharedWindowAhead
from fastdata.reading.shuffles import block_settings, choose_shuffle
from fastdata.reading.windows import WindowAhead


def make_loader(
    dataset: PackedDataset | RecordDataset,
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
    max_cpu: float | None = None,
    seq_len: int | None = None,
    packing: str = "concat",
    eod: int | str | None = None,
    tokens_only: bool = False,
) -> "BatchLoader | WorkerLoader":
    """Build a loader yielding ``(images uint8 [B, 3, H, W], labels int64 [B])``.

    On a text file it yields ``(tokens int64 [B, T], lengths int64 [B],
    labels int64 [B])``, tokens padded with the file's pad id; on a file of
    records (``fastdata.write``) dicts (see RecordDataset). Under
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
        pin_memory: page-locked batches for fast GPU copies; default: where
            CUDA is available and ``device`` is None or a CUDA device.
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
            that device, CUDA copies issued ahead from the pinned batches.
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
            [auto helper]), decoding on every usable core there; False: never.
        max_cpu: the share of this machine's usable cores that reading and
            decoding may keep busy, 0 < max_cpu <= 1 (SPDL advises about 0.4
            beside a training job): ``max(1, floor(max_cpu * cores))`` cores,
            which cap the threads in this process or the helper and the
            worker processes of ``num_workers="auto"``; ``threads`` or
            ``num_workers`` given above it are refused. Default: no cap.
        seq_len: a text dataset only: yield language-model sequences of
            this many tokens, cut at load time from its documents joined end
            to end with ``eod`` after each (``packing="concat"``, NOTE
            [concat packing] in sequences.py): dict batches of
            ``input_ids``, ``labels`` (the next tokens), ``position_ids``
            and ``cu_seqlens``; the order, ranks, workers and resume are the
            sequences'. Nothing is stored: any seq_len, no reconversion.
        packing: with ``seq_len``: "concat" (every token once an epoch) or
            "pad" (one document per row, padded; longer ones over several).
        eod: with ``seq_len``: the end-of-document id, or a token of the
            file's tokenizer (``"<|endoftext|>"``).
        tokens_only: with ``seq_len`` and ``packing="concat"``: dict batches
            of ``tokens`` alone, ``[B, seq_len + 1]`` in the stored dtype
            (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``), full rows
            only (NOTE [token rows] in sequences.py).

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
    dataset = token_sequences(dataset, seq_len, packing, eod, tokens_only)
    if isinstance(dataset, Mixture) and shuffle not in (False, "none"):
        raise OptionError(f"shuffle={shuffle!r}: a Mixture shuffles its sources itself and keeps its proportions in "
                          "every window of positions read in order (NOTE [mixture order]); leave shuffle off")
    budget = cpu_budget(max_cpu)
    if isinstance(num_workers, str) and num_workers == "auto":
        num_workers, prefetch_factor = _tuned_settings(dataset, prefetch_factor)
        num_workers = num_workers if budget is None else min(num_workers, budget)
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
    _check_budget(budget, max_cpu, num_workers, threads)
    options = _read_options(dataset, pad_to, threads)
    pipeline = make_pipeline(dataset, device=device, augment=augment, normalize=normalize, dtype=dtype,
                             memory_format=memory_format, seed=seed, ahead=prefetch_factor)
    if pin_memory is None:  # see NOTE [pinned reads] in cudacopy.py
        pin_memory = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    order_options = {"shuffle": shuffle, "drop_last": drop_last, "remainder": remainder, "rank": rank,
                     "world_size": world_size, "block_size": block_size, "window": window}
    readahead = helper_readahead = None  # see NOTE [one read-ahead] in state.py
    if batch_sampler is None:
        remote = getattr(dataset, "is_remote", False)
        fits = _fits_page_cache(dataset)
        sampler = _index_sampler(dataset, batch_size, seed, **order_options, remote=remote, fits=fits)
        readahead = partial(_readahead, dataset, remote=remote, fits=fits, one_reader=num_workers == 0,
                            in_helper=num_workers == 0 and helper_process is True)
        helper_readahead = partial(_readahead, dataset, remote=remote, fits=fits, one_reader=True, in_helper=True)
    else:
        sampler = _check_batch_sampler(batch_sampler, order_options)
    if num_workers == 0:
        helper = auto_helper = None
        if helper_process is True:
            helper = _helper(dataset, sampler, options, pipeline, prefetch_factor, multiprocessing_context,
                             budget or usable_cpus())
        elif helper_process == "auto" and reads_plainly(dataset):  # see NOTE [auto helper]
            auto_helper = partial(_helper, dataset, sampler, options, pipeline, prefetch_factor,
                                  multiprocessing_context, budget or usable_cpus())
        return BatchLoader(dataset, sampler, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                           options=options, pipeline=pipeline, helper=helper, auto_helper=auto_helper,
                           readahead=readahead, helper_readahead=helper_readahead if auto_helper else None,
                           max_threads=budget)
    batch_bytes = _batch_bytes(dataset, sampler, options, pipeline)
    slots = None if batch_bytes is None else SharedSlots(num_workers, max(prefetch_factor, 1) + 1, batch_bytes)
    return worker_loader(dataset, sampler, slots, options, pipeline, readahead, num_workers=num_workers,
                         pin_memory=pin_memory,
                         prefetch_factor=max(prefetch_factor, 1), persistent_workers=persistent_workers,
                         multiprocessing_context=multiprocessing_context)


def _fits_page_cache(dataset):
    """Whether ``dataset`` stays in the page cache (NOTE [auto shuffle] in shuffles.py): a packed file or folder, and
    the concat or pad sequences of a text one (NOTE [sequence blocks]); any other dataset is taken to."""
    if not _sized(dataset):
        return True
    if getattr(dataset, "packing", None) == "best_fit" and getattr(dataset.dataset, "is_remote", False):
        warnings.warn(f"{dataset.path!r} is at a URL, and packing='best_fit' rows take documents from every shard, "
                      "so their shards are fetched as the rows need them, none ahead (NOTE [remote sequences]); "
                      "packing='concat' or 'pad' reads rows in the block order, their shards fetched ahead",
                      UserWarning, stacklevel=3)
    fits = choose_shuffle(dataset)[0] == "uniform"
    if not fits and getattr(dataset, "packing", None) == "best_fit":
        warnings.warn(f"{dataset.path!r} does not fit in memory, and packing='best_fit' rows take documents from "
                      "the whole corpus, so every epoch reads them from disk at random (no block order); "
                      "packing='concat' or 'pad' reads rows in blocks", UserWarning, stacklevel=3)
        return True
    return fits


def _sized(dataset):
    """Whether the stored bytes of ``dataset`` are known: a packed file or folder, or the sequences of a text one."""
    return isinstance(dataset, PackedDataset) or (isinstance(dataset, TokenSequences) and dataset.nbytes is not None)


def _index_sampler(dataset, batch_size, seed, *, shuffle, drop_last, remainder, rank, world_size, block_size,
                   window, remote, fits):
    """Return the BatchIndexSampler of make_loader's options, its rank and world from torch.distributed by default.

    ``remote``: the dataset is at a URL; ``fits``: it stays in the page cache (NOTE [auto shuffle] in shuffles.py).
    """
    group = dist.is_available() and dist.is_initialized()
    resolve_rank(rank, world_size)  # checked now
    chosen = shuffle is True or shuffle == "auto"
    shuffle = _shuffle_mode(shuffle, fits and not remote, group)
    if shuffle == "block" and None in (block_size, window):
        chosen = True
        if not _sized(dataset) and not remote:
            raise OptionError(f"shuffle='block' over a local {type(dataset).__name__} needs block_size and window")
        default_size, default_window = _default_block_settings(dataset, remote, group)
        block_size, window = block_size or default_size, window or default_window
    sampler = BatchIndexSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                remainder=remainder, rank=rank, world_size=world_size, block_size=block_size,
                                window=window)
    sampler.chosen_here = chosen and not group  # see NOTE [late rank] in samplers.py
    return sampler


def _readahead(dataset, sampler, *, remote, fits, one_reader, in_helper=False):
    """Return the ReadsAhead that follows ``sampler``'s order on this rank, or None where none pays.

    ``one_reader``: this process reads every batch of its rank (no workers); ``in_helper``: a helper
    process reads them (helper_process=True), and the read-ahead runs there (NOTE [read-ahead in the
    helper] in helper.py).
    """
    if remote and dataset.prefetch != 0:  # see NOTE [remote read-ahead] in remote.py
        ahead = prefetch_shards(dataset, sampler.order)
        return ShardReadAhead(dataset, sampler.order, sampler.rank, sampler.world_size, ahead)
    if in_helper:
        if fits and not (sampler.world_size == 1 and isinstance(dataset, TokenSequences)):
            return None  # what local_readahead returns for it: no read-ahead pays
        return HelperReadAhead(sampler.order, partial(local_readahead, order=sampler.order, rank=sampler.rank,
                                                      world_size=sampler.world_size, fits=fits, one_reader=True))
    return local_readahead(dataset, order=sampler.order, rank=sampler.rank, world_size=sampler.world_size,
                           fits=fits, one_reader=one_reader, share=True)


def local_readahead(dataset, *, order, rank, world_size, fits, one_reader, share=False):
    """Return the ReadsAhead of local ``dataset`` that follows ``order`` on ``rank`` of ``world_size``, or None.

    ``fits``: the dataset stays in the page cache; ``one_reader``: this process reads every batch of its rank;
    ``share``: this is a rank of the process group (not a helper process), which may share windows with the
    other ranks of its machine (a collective; NOTE [shared windows] in reading/sharedwindows.py).
    """
    if (share and order.shuffle == "block" and isinstance(dataset, (PackedDataset, TokenSequences))
            and in_process_group(world_size) and rank == dist.get_rank()):
        shared = dataset.share_windows(order, wanted=one_reader and not fits)
        if shared is not None:  # see NOTE [shared sequence windows] in sharedsequences.py: its own ReadsAhead
            return shared if isinstance(dataset, TokenSequences) else SharedWindowAhead(shared, rank, world_size)
    alone = one_reader and world_size == 1
    if fits and alone and isinstance(dataset, TokenSequences):  # see NOTE [whole stream] in sequencewindows.py
        return dataset.hold_stream(order)
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
    # reads] in windows.py, NOTE [sequence windows] in sequencewindows.py); workers and ranks share their
    # reads through the page cache.
    alone = alone and order.shuffle == "block"
    if isinstance(dataset, TokenSequences):  # see NOTE [sequence blocks]: concat rows in windows, else hints
        windows = dataset.read_windows(order) if alone else None
        return windows or ReadAhead(dataset, order, rank, world_size, fits=fits)
    windows = dataset.read_windows(order) if alone else None
    if windows is not None:
        return WindowAhead(windows, rank, world_size)
    return ReadAhead(dataset, order, rank, world_size, fits=fits)


def _default_block_settings(dataset, remote, group):
    """Return a block shuffle's default ``(block_size, window)``; a remote dataset's are rank 0's for every rank."""
    if not remote:
        return block_settings(dataset)
    settings = tuple(remote_block_settings(dataset))  # from the cache limit: see NOTE [remote shuffle] in remote.py
    if group and dist.get_world_size() > 1:
        settings = broadcast_object(settings)
    return settings


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
        shuffle = broadcast_object(shuffle)
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
    if "threads" in option_names(dataset):
        options = {"threads": threads, **options}
    return HelperProcess(dataset, options, None if pipeline is None else pipeline.reader,
                         slots=max(prefetch_factor, 1) + 3,  # those ahead, the loop's, the one before
                         batch_bytes=_batch_bytes(dataset, sampler, options, pipeline) or 0, context=context)


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


def cpu_budget(max_cpu):
    """Return the cores ``max_cpu`` (a share of the usable ones) allows loading, or None for no cap."""
    if max_cpu is None:
        return None
    if isinstance(max_cpu, bool) or not isinstance(max_cpu, (int, float)) or not 0 < max_cpu <= 1:
        raise OptionError(f"max_cpu should be a share of the usable cores, 0 < max_cpu <= 1 (e.g. 0.4), got "
                          f"max_cpu={max_cpu!r}")
    return max(1, math.floor(max_cpu * usable_cpus()))


def _check_budget(budget, max_cpu, num_workers, threads):
    """Refuse ``num_workers`` and ``threads`` (each worker's, with workers) that keep more cores busy than
    ``budget`` allows."""
    if budget is None or not isinstance(num_workers, int) or not isinstance(threads, (int, type(None))):
        return  # bad values are refused by their own checks
    cores = num_workers * (threads or 1) if num_workers else threads or 0
    if cores > budget:
        asked = " and ".join(f"{name}={value}" for name, value in (("num_workers", num_workers), ("threads", threads))
                             if value)
        raise OptionError(f"{asked} would keep {cores} cores busy, more than max_cpu={max_cpu} allows ({budget} of "
                          f"{usable_cpus()}); ask for fewer, or pass a larger max_cpu")


def _tuned_settings(dataset, prefetch_factor):
    """Return ``(num_workers, prefetch_factor)`` for ``num_workers="auto"`` (see NOTE [auto workers])."""
    path = getattr(dataset, "path", None)
    tuned = read_recommendation(path) if path is not None else None
    if tuned is None:
        return 0, prefetch_factor
    return tuned["num_workers"], tuned["prefetch_factor"] if prefetch_factor is None else prefetch_factor


def _read_options(dataset, pad_to, threads):
    """Return the keyword options ``read_batch`` gets; check them against the dataset."""
    options = {}
    for name, value, applies in (("pad_to", pad_to, "text"), ("threads", threads, "image")):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OptionError(f"{name} should be a positive integer or None, got {name}={value!r}")
        if name not in option_names(dataset):
            raise OptionError(f"{name} applies to {applies} datasets, got a {getattr(dataset, 'kind', None)!r} "
                              "dataset")
        options[name] = value
    return options

