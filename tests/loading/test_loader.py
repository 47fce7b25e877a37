"""make_loader, BatchLoader and BatchIndexSampler: every sample once per epoch, reproducible, flat memory."""

import gc
import os
import threading
import time
import warnings
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    FORMATS,
    MB,
    NUM_CLASSES,
    PER_CLASS,
    ProbeMixin,
    growth_per_worker,
    memory_short_of,
    start_methods,
    write_random_png,
)
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from fastdata import ArrowDataset, HDF5Dataset, convert_imagefolder, make_loader, open_dataset
from fastdata.errors import FastPathWarning, OptionError
from fastdata.loading.batchloader import BatchLoader
from fastdata.loading.samplers import BatchIndexSampler, BucketBatchSampler
from fastdata.loading.state import Steps
from fastdata.loading.workers import worker_pids
from fastdata.reading import rowcopy
from fastdata.reading.readahead import ReadAhead
from fastdata.reading.shuffles import block_settings
from fastdata.reading.windows import WindowAhead

NUM_SAMPLES = NUM_CLASSES * PER_CLASS
BIG_PER_CLASS = 600  # 2400 samples: enough batches for memory growth to show
BIG_SIZE = 32
BIG_BATCH = 32


# ---------------------------------------------------------------- worker-side probes (module level: spawn pickles them)


class ProbeHDF5(ProbeMixin, HDF5Dataset):
    pass


class ProbeArrow(ProbeMixin, ArrowDataset):
    pass


PROBES = {"hdf5": ProbeHDF5, "arrow": ProbeArrow}


class CachingProbe(ProbeHDF5):
    """Control: keeps a per-sample bytes object for every sample it reads (grows in any start method)."""

    def __init__(self, path):
        super().__init__(path)
        self._cache = []

    def read_batch(self, indices, *args, **kwargs):
        batch = super().read_batch(indices, *args, **kwargs)
        self._cache.extend(image.numpy().tobytes() * 10 for image in batch[0])  # ~30 kB per sample
        return batch


class CopyOnWriteProbe(ProbeHDF5):
    """Control: per-sample Python objects built in the parent; reading them in a forked
    worker bumps their refcounts and so copies their pages (what fastdata avoids)."""

    def __init__(self, path):
        super().__init__(path)
        self._blobs = [tuple(bytes(4000) for _ in range(6)) for _ in range(len(self))]

    def read_batch(self, indices, *args, **kwargs):
        touched = [blob for index in indices for blob in self._blobs[index]]
        assert len(touched) == 6 * len(indices)
        return super().read_batch(indices, *args, **kwargs)


def fail_on_the_third_call(dataset):
    dataset.calls = getattr(dataset, "calls", 0) + 1
    if dataset.calls == 3:
        raise RuntimeError("disk on fire")


class FailingDataset(HDF5Dataset):
    """Raises on the third batch it reads."""

    def read_batch(self, indices, *args, **kwargs):
        fail_on_the_third_call(self)
        return super().read_batch(indices, *args, **kwargs)


class FailingToStartDataset(HDF5Dataset):
    """Fails to start its third batch (the loader starts a batch one step before it yields it)."""

    def start_batch(self, indices, *args, **kwargs):
        fail_on_the_third_call(self)
        return super().start_batch(indices, *args, **kwargs)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def big_files(tmp_path_factory):
    """``get(fmt, storage) -> path``: 4 classes x 600 random 16x12 PNGs, stored at 32x32."""
    root = tmp_path_factory.mktemp("big") / "images"
    rng = np.random.default_rng(0)
    for label in range(NUM_CLASSES):
        (root / f"class_{label}").mkdir(parents=True)
        for index in range(BIG_PER_CLASS):
            write_random_png(root / f"class_{label}" / f"{index:04d}.png", rng, size=(16, 12))
    cache = {}

    def get(fmt, storage):
        if (fmt, storage) not in cache:
            out = root.parent / f"big-{storage}{FORMATS[fmt]}"
            convert_imagefolder(root, out, size=BIG_SIZE, storage=storage, workers=2, progress=False)
            cache[fmt, storage] = out
        return cache[fmt, storage]

    return get


def index_of_images(dataset):
    """Map each stored image's bytes to its index (all images of these folders differ)."""
    images, _ = dataset.read_batch(np.arange(len(dataset)))
    lookup = {image.numpy().tobytes(): index for index, image in enumerate(images)}
    assert len(lookup) == len(dataset), "test data should hold distinct images"
    return lookup


def batch_indices(lookup, images):
    return [lookup[image.numpy().tobytes()] for image in images]


def run_epochs(loader, epochs=2):
    """Iterate ``loader``; return per epoch a list of ``(images, labels, probe or None)`` batches."""
    return [[(batch[0], batch[1], batch[2] if len(batch) > 2 else None) for batch in loader] for _ in range(epochs)]


def shutdown(loader):
    loader.close()  # stop persistent workers now rather than at some later garbage collection
    del loader
    gc.collect()


# ---------------------------------------------------------------- loading with worker processes

WORKER_RUNS = [
    ("fork", "hdf5", "raw"),
    ("fork", "arrow", "jpeg"),
    ("spawn", "arrow", "raw"),
    ("spawn", "hdf5", "jpeg"),
    ("forkserver", "hdf5", "raw"),
]


@pytest.fixture(scope="module", params=[  # as support.start_methods: fork in the edit loop, the others slow
    pytest.param(run, id="-".join(run), marks=() if run[0] == "fork" else pytest.mark.slow) for run in WORKER_RUNS])
def worker_run(request, big_files):
    """Two shuffled epochs through make_loader(num_workers=2) with persistent workers."""
    start_method, fmt, storage = request.param
    path = big_files(fmt, storage)
    dataset = PROBES[fmt](path)
    loader = make_loader(
        dataset, BIG_BATCH, shuffle=True, seed=7, num_workers=2, multiprocessing_context=start_method
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        epochs = run_epochs(loader)
    info = {
        "start_method": start_method,
        "storage": storage,
        "loader": loader,
        "epochs": epochs,
        "lookup": index_of_images(open_dataset(path)),
        "labels": open_dataset(path).labels.copy(),
        "len": len(loader),
        "pin_memory": loader.pin_memory,
    }
    yield info
    shutdown(loader)


def test_workers_visit_every_sample_once_per_epoch(worker_run):
    num_samples = len(worker_run["labels"])
    for epoch in worker_run["epochs"]:
        seen = []
        for images, labels, _ in epoch:
            indices = batch_indices(worker_run["lookup"], images)
            assert labels.tolist() == worker_run["labels"][indices].tolist()
            assert indices == sorted(indices)  # a batch is read (and returned) in file order
            seen += indices
        assert sorted(seen) == list(range(num_samples))


def test_workers_batches_follow_the_seeded_sampler(worker_run):
    num_samples = len(worker_run["labels"])
    sampler = BatchIndexSampler(num_samples, BIG_BATCH, shuffle="uniform", seed=7)
    for epoch in worker_run["epochs"]:
        got = [batch_indices(worker_run["lookup"], images) for images, _, _ in epoch]
        assert got == [batch.tolist() for batch in sampler]
    first, second = ([batch_indices(worker_run["lookup"], b[0]) for b in e] for e in worker_run["epochs"])
    assert first != second


def test_workers_batches_have_the_right_types_and_len(worker_run):
    batches = worker_run["epochs"][0]
    assert worker_run["len"] == len(batches) == -(-len(worker_run["labels"]) // BIG_BATCH)
    images, labels, _ = batches[0]
    assert images.dtype == torch.uint8 and tuple(images.shape) == (BIG_BATCH, 3, BIG_SIZE, BIG_SIZE)
    assert labels.dtype == torch.int64 and tuple(labels.shape) == (BIG_BATCH,)


def test_workers_batches_keep_the_in_process_layout(worker_run):
    # JPEG batches are channels_last (see NOTE [channels last]) and cross processes as such
    images = worker_run["epochs"][1][0][0]
    layout = torch.channels_last if worker_run["storage"] == "jpeg" else torch.contiguous_format
    assert images.is_contiguous(memory_format=layout)


def test_pin_memory_defaults_to_false_without_cuda(worker_run):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is the default")
    assert worker_run["pin_memory"] is False


def test_persistent_workers_are_the_same_processes_in_both_epochs(worker_run):
    pids = [{int(probe[0]) for _, _, probe in epoch} for epoch in worker_run["epochs"]]
    assert len(pids[0]) == 2 and pids[0] == pids[1]
    assert os.getpid() not in pids[0]


def test_worker_memory_stays_flat(worker_run):
    growth = growth_per_worker([batch for epoch in worker_run["epochs"] for batch in epoch])
    assert len(growth) == 2
    for pid, (anon, private) in growth.items():
        assert anon < 8 * MB, f"worker {pid}: RssAnon grew by {anon} kB over two epochs"
        assert private < 8 * MB, f"worker {pid}: Private_Dirty grew by {private} kB (copy-on-write?)"


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
@pytest.mark.slow
def test_memory_probe_sees_a_growing_worker(big_files, start_method):
    # Control for the test above: the same probe does report growth when a worker keeps data.
    loader = make_loader(
        CachingProbe(big_files("hdf5", "raw")), BIG_BATCH, num_workers=2, multiprocessing_context=start_method
    )
    growth = growth_per_worker(run_epochs(loader, epochs=1)[0])
    shutdown(loader)
    assert len(growth) == 2
    # A forked worker's new objects may land in heap its parent freed (already resident, so RssAnon stays put:
    # 120 kB in two full-suite runs after tests that freed large batches); they are then its private dirty pages.
    for anon, dirty in growth.values():
        assert max(anon, dirty) > 8 * MB


@pytest.mark.slow
def test_memory_probe_sees_copy_on_write_in_forked_workers(big_files):
    # Control: Python objects per sample, made before the fork, are copied page by
    # page as workers touch them. RssAnon cannot see that; Private_Dirty does.
    loader = make_loader(
        CopyOnWriteProbe(big_files("hdf5", "raw")), BIG_BATCH, num_workers=2, multiprocessing_context="fork"
    )
    growth = growth_per_worker(run_epochs(loader, epochs=1)[0])
    shutdown(loader)
    assert len(growth) == 2
    for _, private in growth.values():
        assert private > 8 * MB


# ---------------------------------------------------------------- in-process loader (num_workers=0)


@pytest.fixture
def small(packed):
    return open_dataset(packed)


def test_no_workers_gives_a_batch_loader(small):
    loader = make_loader(small, 5)
    assert isinstance(loader, BatchLoader)
    assert loader.batch_size == 5 and loader.dataset is small
    assert not loader.pin_memory or torch.cuda.is_available()


def test_batch_loader_visits_every_sample_once_in_order(small):
    lookup = index_of_images(small)
    loader = make_loader(small, 5)
    batches = list(loader)
    assert len(loader) == len(batches) == 5
    assert [len(labels) for _, labels in batches] == [5, 5, 5, 5, 4]
    indices = [i for images, _ in batches for i in batch_indices(lookup, images)]
    assert indices == list(range(NUM_SAMPLES))
    assert torch.cat([labels for _, labels in batches]).tolist() == small.labels.tolist()


@pytest.mark.parametrize("prefetch_factor", [0, 1, 3])
def test_batch_loader_equals_read_batch(small, prefetch_factor):
    loader = make_loader(small, 7, shuffle=True, seed=3, prefetch_factor=prefetch_factor)
    sampler = BatchIndexSampler(NUM_SAMPLES, 7, shuffle="uniform", seed=3)
    for (images, labels), indices in zip(loader, sampler, strict=True):
        expected_images, expected_labels = small.read_batch(indices)
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)


def test_shuffle_is_reproducible_and_epochs_differ(small):
    lookup = index_of_images(small)

    def epochs(seed):
        loader = make_loader(small, 4, shuffle=True, seed=seed)
        return [[batch_indices(lookup, images) for images, _ in loader] for _ in range(3)]

    first, again, other = epochs(0), epochs(0), epochs(1)
    assert first == again
    assert first != other
    assert first[0] != first[1] != first[2]
    for epoch in first:
        assert sorted(i for batch in epoch for i in batch) == list(range(NUM_SAMPLES))
        assert all(batch == sorted(batch) for batch in epoch)


def test_drop_last(small):
    loader = make_loader(small, 5, drop_last=True, shuffle=True)
    batches = list(loader)
    assert len(loader) == len(batches) == 4
    assert all(len(labels) == 5 for _, labels in batches)
    assert len(make_loader(small, 6, drop_last=True)) == 4
    assert len(make_loader(small, 25, drop_last=True)) == 0 == len(list(make_loader(small, 25, drop_last=True)))


def test_no_warning_and_no_pinning_without_cuda(small):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = make_loader(small, 8)
        images, _ = next(iter(loader))
    assert loader.pin_memory is False and not images.is_pinned()


def test_errors_in_reading_reach_the_training_loop(packed_files):
    loader = make_loader(FailingDataset(packed_files("hdf5", "raw")), 4)
    got = []
    with pytest.raises(RuntimeError, match="disk on fire"):
        for images, _ in loader:
            got.append(images)
    assert len(got) == 2
    assert not any(t.name == "fastdata-read-ahead" for t in threading.enumerate())


def test_an_error_starting_a_batch_comes_after_the_batches_before_it(packed_files, monkeypatch):
    monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", 0)
    dataset = FailingToStartDataset(packed_files("hdf5", "raw"))
    got = []
    with pytest.raises(RuntimeError, match="disk on fire"):
        for images, _ in make_loader(dataset, 4):
            got.append(images)
    assert [len(images) for images in got] == [4, 4]
    assert torch.equal(torch.cat(got), dataset.read_batch(np.arange(8))[0])


def test_stopping_early_stops_the_read_ahead_thread(small):
    iterator = iter(make_loader(small, 2, prefetch_factor=2))
    next(iterator)
    iterator.close()
    assert not any(t.name == "fastdata-read-ahead" for t in threading.enumerate())


# NOTE [noise-proof timing]: the loader counts a loop body over 0.5 ms as busy;
# on this shared 2-core VM a tight body now and then takes longer (a scheduler
# hiccup), and three in a row flipped the adaptive-reading tests about 1 run
# in 6. The tests raise the threshold to 10 ms and make busy bodies 30 ms: the
# same logic, far from the noise. A spinning body's share of CPU time fell
# under 0.5 on the loaded machine (its core shared), so a body that computes
# counts from a share of 0.2 here (test_decoding_leaves_a_core_only_to_a_loop_
# that_computes failed so once in a plain run beside other tests).
BUSY_THRESHOLD = 0.01
STEP = 0.03  # a busy loop body, in seconds


@pytest.fixture(autouse=True)
def noise_proof_threshold(monkeypatch):
    monkeypatch.setattr("fastdata.loading.overlap.BUSY_CONSUMER_SECONDS", BUSY_THRESHOLD)
    monkeypatch.setattr("fastdata.loading.overlap.COMPUTES_ABOVE", 0.2)
    monkeypatch.setattr("fastdata.loading.overlap.COMPUTES_UNTIL_BELOW", 0.1)


def busy_loop(iterable, seconds=STEP):
    """Iterate like a training loop whose step takes ``seconds``; return batches and thread names seen."""
    batches, names = [], set()
    for batch in iterable:
        batches.append(batch)
        time.sleep(seconds)
        names |= {t.name for t in threading.enumerate()}
    return batches, names


def test_tight_loop_reads_inline(small):
    # see NOTE [adaptive read-ahead]
    names = set()
    for _ in make_loader(small, 3):
        names |= {t.name for t in threading.enumerate()}
    assert "fastdata-read-ahead" not in names


def test_one_slow_body_does_not_start_the_thread(small):
    # see NOTE [adaptive read-ahead]: a single pause (a garbage collection) is not a busy loop
    names = set()
    for step, _ in enumerate(make_loader(small, 2)):
        time.sleep(STEP if step == 1 else 0)
        names |= {t.name for t in threading.enumerate()}
    assert step >= 4 and "fastdata-read-ahead" not in names


def test_a_loop_that_turns_tight_reads_inline_again(small):
    loader = make_loader(small, 2, shuffle=True, seed=3)
    inline = make_loader(small, 2, shuffle=True, seed=3, prefetch_factor=0)
    busy_loop(loader)
    list(inline)
    assert [labels.tolist() for _, labels in loader] == [labels.tolist() for _, labels in inline]  # tight again
    names = set()
    for _ in loader:
        names |= {t.name for t in threading.enumerate()}
    assert "fastdata-read-ahead" not in names


def test_busy_loop_hands_reading_to_a_thread_in_order(small):
    loader = make_loader(small, 3, shuffle=True, seed=5)
    inline = make_loader(small, 3, shuffle=True, seed=5, prefetch_factor=0)
    for _ in range(2):  # the second epoch reads ahead from its first batch
        batches, names = busy_loop(loader)
        assert "fastdata-read-ahead" in names
        expected = list(inline)
        assert len(batches) == len(expected)
        assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(batches, expected))
    assert not any(t.name == "fastdata-read-ahead" for t in threading.enumerate())


@pytest.mark.slow
def test_busy_loop_with_set_epoch_matches_inline_reading(small):
    # see NOTE [next epoch's first batch]: a first batch read early is dropped when the epoch changes
    loader = make_loader(small, 3, shuffle=True, seed=5)
    inline = make_loader(small, 3, shuffle=True, seed=5, prefetch_factor=0)
    for epoch in (0, 1, 1, 7, 8):
        loader.sampler.set_epoch(epoch)
        inline.sampler.set_epoch(epoch)
        batches, _ = busy_loop(loader)
        expected = list(inline)
        assert [labels.tolist() for _, labels in batches] == [labels.tolist() for _, labels in expected]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(batches, expected))


def test_errors_on_the_read_ahead_thread_reach_the_training_loop(packed_files):
    with pytest.raises(RuntimeError, match="disk on fire"):
        busy_loop(make_loader(FailingDataset(packed_files("hdf5", "raw")), 4))
    assert not any(t.name == "fastdata-read-ahead" for t in threading.enumerate())


def test_stopping_a_busy_loop_early_stops_the_thread(small):
    iterator = iter(make_loader(small, 2, prefetch_factor=2))
    for _ in range(4):  # three slow bodies in a row switch to the thread
        next(iterator)
        time.sleep(STEP)
    assert any(t.name == "fastdata-read-ahead" for t in threading.enumerate())
    iterator.close()
    assert not any(t.name == "fastdata-read-ahead" for t in threading.enumerate())


class ThreadsRecordingDataset(HDF5Dataset):
    """Records the decode threads each batch read was given (None: the decoder's default, all cores)."""

    def __init__(self, path):
        super().__init__(path)
        self.threads = []

    def read_batch(self, indices, *args, **kwargs):
        self.threads.append(kwargs.get("threads"))
        return super().read_batch(indices, *args, **kwargs)


def spin(seconds):
    """Compute on this thread for ``seconds`` (a step that trains on the CPU)."""
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


@pytest.mark.parametrize("step, leaves_a_core", [(time.sleep, False), (spin, True)])
@pytest.mark.slow
def test_decoding_leaves_a_core_only_to_a_loop_that_computes(packed_files, monkeypatch, step, leaves_a_core):
    # see NOTE [leave a core]: a loop waiting (as for a GPU) gets no core kept for it
    monkeypatch.setattr("fastdata.loading.batchloader.usable_cpus", lambda: 4)
    dataset = ThreadsRecordingDataset(packed_files("hdf5", "jpeg"))
    loader = make_loader(dataset, 2)
    for _ in range(3):
        for _ in loader:
            step(STEP)
    later_epochs = dataset.threads[len(loader) :]
    assert later_epochs and set(later_epochs) == ({3} if leaves_a_core else {None})


class SlowReadsDataset(ThreadsRecordingDataset):
    """Reads each batch in at least ``seconds``: a loop over it waits for its batches (NOTE [data-bound loop])."""

    def __init__(self, path, seconds):
        super().__init__(path)
        self.seconds = seconds

    def read_batch(self, indices, *args, **kwargs):
        time.sleep(self.seconds)
        return super().read_batch(indices, *args, **kwargs)


@pytest.mark.slow
def test_a_loop_that_computes_but_waits_for_its_batches_gets_every_core_back(packed_files, monkeypatch):
    # see NOTE [data-bound loop]: the loop waits ~2/3 of its time, so the core NOTE [leave a core] kept is given back
    monkeypatch.setattr("fastdata.loading.batchloader.usable_cpus", lambda: 4)
    dataset = SlowReadsDataset(packed_files("hdf5", "jpeg"), 2 * STEP)
    loader = make_loader(dataset, 2, helper_process=False)
    for _ in range(2):
        for _ in loader:
            spin(STEP)
    later = dataset.threads[len(loader) :]
    assert later and later[-1] is None and 3 not in later[-len(loader) // 2 :]


class ThreadsLoggingDataset(HDF5Dataset):
    """Appends the decode threads each batch read was given to the file ``log``: reads in a helper process too."""

    def __init__(self, path, log):
        super().__init__(path)
        self.log = os.fspath(log)

    def read_batch(self, indices, *args, **kwargs):
        with open(self.log, "a") as f:
            f.write(f"{kwargs.get('threads')}\n")
        return super().read_batch(indices, *args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("step, threads", [(time.sleep, 4), (spin, 3)])
def test_the_helper_process_leaves_a_core_to_a_loop_that_computes(packed_files, tmp_path, monkeypatch, step,
                                                                  threads):
    # NOTE [data-bound loop]: the helper's threads would take the loop's core from it by the OS alone
    monkeypatch.setattr("fastdata.loading.batchloader.usable_cpus", lambda: 4)
    monkeypatch.setattr("fastdata.loading.loader.usable_cpus", lambda: 4)
    log = tmp_path / "threads.log"
    dataset = ThreadsLoggingDataset(packed_files("hdf5", "jpeg"), log)
    with make_loader(dataset, 2, helper_process=True, multiprocessing_context="fork") as loader:
        for _ in range(3):
            for _ in loader:
                step(STEP)
    read = log.read_text().split()
    assert len(read) == 3 * len(loader) and set(read[len(loader) :]) == {str(threads)}


@pytest.mark.slow
def test_threads_given_are_what_every_batch_is_read_with(packed_files, monkeypatch):
    monkeypatch.setattr("fastdata.loading.batchloader.usable_cpus", lambda: 4)
    dataset = ThreadsRecordingDataset(packed_files("hdf5", "jpeg"))
    loader = make_loader(dataset, 2, threads=2)
    for _ in range(3):
        for _ in loader:
            spin(STEP)  # a loop that computes: not overridden by NOTE [leave a core]
    assert set(dataset.threads) == {2}


def test_one_worker_with_threads_is_a_helper_process_that_decodes_on_them(packed_files):
    dataset = open_dataset(packed_files("arrow", "jpeg"))
    expected = list(make_loader(dataset, 8, shuffle=True, seed=4))
    tasks = {}
    for threads in (1, 3):
        loader = make_loader(dataset, 8, shuffle=True, seed=4, num_workers=1, threads=threads,
                             multiprocessing_context="fork")
        batches = list(loader)
        assert len(batches) == len(expected) and all(
            torch.equal(a, b) for got, want in zip(batches, expected) for a, b in zip(got, want))
        (pid,) = worker_pids(loader)
        tasks[threads] = len(os.listdir(f"/proc/{pid}/task"))  # the decoding threads live in the worker
        loader.close()
    assert tasks[3] >= tasks[1] + 2


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"threads": 0}, ValueError, "threads should be a positive integer or None, got threads=0"),
        ({"threads": True}, ValueError, "threads should be a positive integer"),
        ({"batch_size": 0}, ValueError, "batch_size should be a positive integer"),
        ({"batch_size": 2.5}, ValueError, "batch_size"),
        ({"num_workers": -1}, ValueError, "num_workers should be a non-negative integer"),
        ({"prefetch_factor": -1}, ValueError, "prefetch_factor"),
    ],
)
def test_make_loader_rejects_bad_options(small, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_loader(small, **kwargs)


def test_threads_are_for_images(packed_text):
    with pytest.raises(ValueError, match="threads applies to image datasets, got a 'text' dataset"):
        make_loader(open_dataset(packed_text("hdf5")), 4, threads=2)


def test_make_loader_needs_a_fastdata_dataset():
    with pytest.raises(TypeError, match="read_batch"):
        make_loader([1, 2, 3], 2)


@pytest.mark.parametrize("drop_last, sizes", [(False, [10, 10, 4]), (True, [10, 10])])
def test_workers_loader_holds_a_torch_dataloader_without_being_one(packed_files, drop_last, sizes):
    dataset = open_dataset(packed_files("arrow", "raw"))
    loader = make_loader(dataset, 10, num_workers=1, drop_last=drop_last, multiprocessing_context="fork")
    assert not isinstance(loader, DataLoader)  # trainers pass it through (NOTE [trainers] in workers.py)
    assert (loader.num_workers, loader.prefetch_factor) == (1, 2)
    assert len(loader) == len(sizes) and loader.pin_memory is False
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == sizes
    assert torch.equal(torch.cat([images for images, _ in batches]), dataset.read_batch(np.arange(sum(sizes)))[0])
    shutdown(loader)


def test_close_stops_the_persistent_workers_and_a_later_epoch_starts_new_ones(packed_files):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    loader = make_loader(dataset, 10, num_workers=1, multiprocessing_context="fork")
    first = [labels for _, labels in loader]
    (pid,) = worker_pids(loader)
    loader.close()
    assert worker_pids(loader) == [] and not os.path.exists(f"/proc/{pid}")
    assert [labels.tolist() for _, labels in loader] == [labels.tolist() for labels in first]
    assert worker_pids(loader) not in ([], [pid])
    shutdown(loader)


# ---------------------------------------------------------------- batch_sampler: any iterable of index batches


class Batches:
    """An iterable of index batches with neither ``len`` nor ``batch_size`` (iterated anew each epoch)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


BATCHES = [[0, 1], [2, 3, 4], [7], [20, 23]]
SAMPLERS = {
    "list of lists": lambda: BATCHES,
    "tuple of arrays": lambda: tuple(np.array(b) for b in BATCHES),
    "torch BatchSampler": lambda: BatchSampler(SequentialSampler(range(NUM_SAMPLES)), 7, drop_last=False),
    "plain iterable": lambda: Batches(BATCHES),
}


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("kind", SAMPLERS)
def test_batch_sampler_may_be_any_iterable_of_index_batches(packed_files, kind, num_workers):
    dataset = open_dataset(packed_files("hdf5", "raw"))
    expected = [np.asarray(b).tolist() for b in SAMPLERS[kind]()]
    loader = make_loader(dataset, batch_sampler=SAMPLERS[kind](), num_workers=num_workers,
                         multiprocessing_context="fork")
    for _ in range(2):  # a later epoch iterates the sampler anew
        batches, _ = busy_loop(loader)  # busy: reading moves to the thread
        assert len(batches) == len(expected)
        for (images, labels), indices in zip(batches, expected, strict=True):
            expected_images, expected_labels = dataset.read_batch(indices)
            assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    if num_workers:
        shutdown(loader)


@pytest.mark.parametrize("sampler", [5, "0123", b"01", {0: [1]}, np.arange(4), [0, 1, 2], [[[0, 1]]]])
def test_batch_sampler_that_is_not_index_batches_is_a_type_error(small, sampler):
    with pytest.raises(TypeError, match="batch_sampler should"):
        make_loader(small, batch_sampler=sampler)


@pytest.mark.parametrize("option", [{"shuffle": True}, {"drop_last": True}, {"remainder": "pad"}, {"rank": 0},
                                    {"world_size": 1}, {"block_size": 8}, {"window": 4}])
def test_batch_sampler_replaces_the_order_options(small, option):
    with pytest.raises(ValueError, match=f"batch_sampler replaces shuffle, drop_last, .*got {next(iter(option))}$"):
        make_loader(small, batch_sampler=BATCHES, **option)


# ---------------------------------------------------------------- BatchIndexSampler


def test_sampler_without_shuffle_is_arange_in_batches():
    batches = list(BatchIndexSampler(10, 4))
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(b.dtype == np.int64 for b in batches)


def test_sampler_set_epoch_replays_an_epoch():
    sampler = BatchIndexSampler(50, 8, shuffle="uniform", seed=1)
    first = [b.tolist() for b in sampler]
    second = [b.tolist() for b in sampler]
    sampler.set_epoch(0)
    assert [b.tolist() for b in sampler] == first != second


def test_sampler_batches_of_an_epoch_change_nothing_and_iterating_advances():
    # see NOTE [epoch protocol]
    sampler = BatchIndexSampler(50, 8, shuffle="uniform", seed=1)
    third = [b.tolist() for b in sampler.batches(3)]
    assert [b.tolist() for b in sampler.batches(3)] == third and sampler.epoch == 0
    iterator = iter(sampler)
    assert sampler.epoch == 0  # not before the first batch is asked for (torch calls iter() twice)
    assert [b.tolist() for b in iterator] == [b.tolist() for b in sampler.batches(0)] and sampler.epoch == 1


@pytest.mark.parametrize(
    "num_samples, batch_size, drop_last, expected",
    [(10, 4, False, 3), (10, 4, True, 2), (8, 4, True, 2), (0, 4, False, 0), (3, 4, True, 0)],
)
def test_sampler_len(num_samples, batch_size, drop_last, expected):
    sampler = BatchIndexSampler(num_samples, batch_size, shuffle="uniform", drop_last=drop_last)
    assert len(sampler) == len(list(sampler)) == expected


# ---------------------------------------------------------------- ranks: one global order for any world size

sampler_settings = st.fixed_dictionaries({
    "num_samples": st.integers(0, 700), "batch_size": st.integers(1, 40), "world_size": st.sampled_from([1, 2, 3, 4]),
    "shuffle": st.sampled_from(["none", "uniform", "block"]), "remainder": st.sampled_from(["pad", "drop", None]),
    "seed": st.integers(0, 2**31), "block_size": st.integers(1, 16), "window": st.integers(1, 8),
})


def rank_samplers(settings_):
    settings_ = dict(settings_)
    world_size = settings_.pop("world_size")
    return [BatchIndexSampler(**settings_, rank=rank, world_size=world_size) for rank in range(world_size)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_=sampler_settings, epoch=st.integers(0, 50))
def test_rank_samplers_read_the_order_of_their_global_batch_in_chunks(settings_, epoch):
    samplers = rank_samplers(settings_)
    order = samplers[0].order
    assert order.global_batch == settings_["batch_size"] * settings_["world_size"]
    for sampler in samplers:  # the chunked path against one order.batch call per step
        batches = list(sampler.batches(epoch))
        assert len(batches) == len(sampler) == order.num_steps
        expected = [order.batch(epoch, step, sampler.rank, sampler.world_size) for step in range(order.num_steps)]
        assert all(b.dtype == np.int64 and np.array_equal(b, e) for b, e in zip(batches, expected, strict=True))
        full = batches if sampler.remainder != "partial" else batches[:-1]  # pad, drop: every batch full
        assert all(len(b) == sampler.batch_size for b in full)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_=sampler_settings, epoch=st.integers(0, 50))
def test_the_union_of_the_ranks_is_the_global_batch_of_one_rank(settings_, epoch):
    samplers = rank_samplers(settings_)
    alone = BatchIndexSampler(settings_["num_samples"], samplers[0].global_batch, shuffle=settings_["shuffle"],
                              seed=settings_["seed"], remainder=samplers[0].remainder,
                              block_size=settings_["block_size"], window=settings_["window"])
    shares = [list(sampler.batches(epoch)) for sampler in samplers]
    for step, batch in enumerate(alone.batches(epoch)):
        assert np.array_equal(np.sort(np.concatenate([share[step] for share in shares])), batch)
    covered = np.unique(np.concatenate([b for share in shares for b in share] or [np.zeros(0, np.int64)]))
    if samplers[0].remainder == "pad":  # every sample once, plus the wrapped samples of the padded last batch
        assert np.array_equal(covered, np.arange(settings_["num_samples"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settings_=sampler_settings, epoch=st.integers(0, 50), data=st.data())
def test_a_sampler_started_at_a_step_yields_the_rest_of_the_epoch(settings_, epoch, data):
    sampler = rank_samplers(settings_)[-1]
    whole = list(sampler.batches(epoch))
    step = data.draw(st.integers(0, len(whole)))
    sampler.resume(epoch, step)
    assert [b.tolist() for b in sampler] == [b.tolist() for b in whole[step:]]
    assert (sampler.epoch, sampler.start_step) == (epoch + 1, 0)
    assert [b.tolist() for b in sampler] == [b.tolist() for b in sampler.batches(epoch + 1)]


def test_set_epoch_keeps_a_resumed_step_of_its_own_epoch_only():
    sampler = BatchIndexSampler(100, 10, shuffle="uniform")
    sampler.resume(3, 4)
    sampler.set_epoch(3)  # a trainer's set_epoch(epoch) after loading a state
    assert sampler.start_step == 4
    sampler.set_epoch(5)
    assert sampler.start_step == 0 and len(list(sampler)) == 10


def test_remainder_defaults_partial_for_one_rank_and_pad_for_more():
    assert BatchIndexSampler(10, 4).remainder == "partial"
    assert BatchIndexSampler(10, 4, drop_last=True, world_size=2).remainder == "drop"
    padded = [BatchIndexSampler(10, 4, rank=rank, world_size=2) for rank in range(2)]
    assert [p.remainder for p in padded] == ["pad", "pad"]
    assert [[b.tolist() for b in p] for p in padded] == [[[0, 1, 2, 3], [0, 1, 8, 9]], [[4, 5, 6, 7], [2, 3, 4, 5]]]


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 2, "world_size": 2}, r"rank should be an integer in \[0, world_size=2\), got rank=2"),
    ({"rank": -1, "world_size": 2}, "got rank=-1"),
    ({"rank": 1.0, "world_size": 2}, "got rank=1.0"),
    ({"rank": 0, "world_size": 0}, "world_size should be a positive integer"),
    ({"drop_last": True, "remainder": "pad"}, "drop_last=True asks for remainder='drop', got remainder='pad'"),
    ({"remainder": "partial", "world_size": 3}, "last batch of 10 samples that 3 ranks cannot share evenly"),
    ({"shuffle": "sorted"}, "shuffle should be one of"),
    ({"shuffle": "block"}, "shuffle='block' needs block_size and window"),
    ({"shuffle": True}, "True means the order that suits the dataset, which make_loader"),
    ({"shuffle": "auto"}, "BatchIndexSampler takes shuffle='uniform' or 'block'"),
    ({"seed": -1}, "seed should be a non-negative integer"),
])
def test_sampler_rejects_bad_rank_and_order_options(kwargs, match):
    with pytest.raises(OptionError, match=match):
        BatchIndexSampler(100, 10, **kwargs)


class RecordingReadAhead:
    """Records the step cursor's calls, as a ReadsAhead (fastdata.reading.readahead) receives them."""

    def __init__(self, sampler):
        self.order, self.calls = sampler.order, []

    def start(self, epoch, step):
        self.calls.append(("start", epoch, step))

    def advance(self, step):
        self.calls.append(("advance", step))

    def close(self):
        self.calls.append(("close",))


def test_the_step_cursor_tells_its_read_ahead_where_each_epoch_starts_and_each_batch():
    sampler = BatchIndexSampler(100, 10, shuffle="uniform", rank=1, world_size=2)
    steps = Steps(sampler, RecordingReadAhead)
    recording = steps.readahead
    iterator = iter(steps)
    assert recording.calls == []  # nothing before the first batch is asked for
    assert [epoch for epoch, _ in iterator] == [0] * 5
    list(sampler.batches(1))  # a walk of the sampler alone moves nothing: it is a pure order
    list(sampler)
    sampler.resume(4, 3)
    assert [epoch for epoch, _ in steps] == [4, 4]
    steps.close()
    assert recording.calls == [("start", 0, 0), *[("advance", s) for s in range(5)],
                               ("start", 4, 3), ("advance", 3), ("advance", 4), ("close",)]
    assert steps.follow() is recording  # the same order: the same read-ahead, started again by the next epoch


# ---------------------------------------------------------------- make_loader's ranks


def test_rank_loaders_read_one_global_batch_between_them(small):
    lookup = index_of_images(small)
    alone = make_loader(small, 6, shuffle="uniform", seed=4, remainder="pad")
    loaders = [make_loader(small, 2, shuffle="uniform", seed=4, rank=rank, world_size=3, prefetch_factor=0)
               for rank in range(3)]
    assert len(alone) == 4 and [len(loader) for loader in loaders] == [4, 4, 4]
    for _ in range(2):  # epochs 0 and 1
        shares = [[batch_indices(lookup, images) for images, _ in loader] for loader in loaders]
        for step, (images, _) in enumerate(alone):
            assert sorted(i for share in shares for i in share[step]) == batch_indices(lookup, images)


def test_make_loader_pads_for_ranks_and_validates_them(small):
    assert make_loader(small, 5, rank=1, world_size=2).sampler.remainder == "pad"  # 24 samples, 10 a step
    assert [len(make_loader(small, 5, rank=1, world_size=2, **kw)) for kw in ({}, {"drop_last": True})] == [3, 2]
    with pytest.raises(OptionError, match="rank should be an integer"):
        make_loader(small, 5, rank=2, world_size=2)
    with pytest.raises(OptionError, match="rank should be an integer"):
        make_loader(small, 5, rank=1)  # no process group: world_size 1
    with pytest.raises(OptionError, match="cannot share evenly"):
        make_loader(small, 2, rank=0, world_size=5, remainder="partial")  # 4 left for 5
    with pytest.raises(OptionError, match="shuffle should be True, False or one of"):
        make_loader(small, 5, shuffle="random")


@pytest.mark.integration
def test_make_loader_takes_rank_and_world_size_from_an_initialized_process_group(small, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        loader = make_loader(small, 4, shuffle=True)
        assert (loader.sampler.rank, loader.sampler.world_size) == (0, 1)
        assert make_loader(small, 4, rank=1, world_size=2).sampler.rank == 1  # explicit values win
    finally:
        dist.destroy_process_group()


def test_shuffle_true_reads_in_blocks_with_hints_where_the_dataset_cannot_stay_cached(small, monkeypatch):
    # see NOTE [auto shuffle] and NOTE [hints past the cache]: shuffles.choose_shuffle decides on available memory
    cached = make_loader(small, 4, shuffle=True)
    assert cached.sampler.shuffle == "uniform" and cached.steps.readahead is None
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(small.nbytes), "test"))
    windowed = small.storage in ("raw", "jpeg")  # NOTE [window reads], NOTE [ragged windows]
    with pytest.warns(FastPathWarning, match=r"would hold .* NOTE \[window room\]") if windowed else nullcontext():
        loader = make_loader(small, 4, shuffle=True)  # its default windows hold the samples twice: no room for them
    assert loader.sampler.shuffle == "block"
    assert (loader.sampler.order.block_size, loader.sampler.order.window) == block_settings(small)
    assert isinstance(loader.steps.readahead, ReadAhead) and loader.steps.readahead.order is loader.sampler.order
    assert sorted(i for batch in loader.steps.batches(0) for i in batch.tolist()) == list(range(NUM_SAMPLES))
    # one process reading alone: image rows are read in windows whole (NOTE [window reads]) where they fit, others
    # get hints
    loader = make_loader(small, 4, shuffle=True, block_size=2, window=3)
    assert isinstance(loader.steps.readahead, WindowAhead if windowed else ReadAhead)
    assert sorted(i for batch in loader.steps.batches(0) for i in batch.tolist()) == list(range(NUM_SAMPLES))
    assert isinstance(make_loader(small, 4, shuffle="uniform").steps.readahead, ReadAhead)


def test_block_shuffle_takes_default_settings_from_the_dataset(small):
    loader = make_loader(small, 4, shuffle="block", window=3)
    assert (loader.sampler.order.block_size, loader.sampler.order.window) == (block_settings(small)[0], 3)


# ---------------------------------------------------------------- BucketBatchSampler under ranks


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_samples=st.integers(0, 400), batch_size=st.integers(1, 12), world_size=st.sampled_from([2, 3, 4]),
       pool_batches=st.integers(1, 6), seed=st.integers(0, 2**20), shuffle=st.booleans(), drop_last=st.booleans(),
       epoch=st.integers(0, 20))
def test_bucket_ranks_share_the_global_batches_of_one_rank(num_samples, batch_size, world_size, pool_batches, seed,
                                                           shuffle, drop_last, epoch):
    lengths = np.random.default_rng(seed).integers(1, 500, num_samples)
    options = {"pool_batches": pool_batches, "seed": seed, "shuffle": shuffle, "drop_last": drop_last}
    ranks = [BucketBatchSampler(lengths, batch_size, rank=rank, world_size=world_size, **options)
             for rank in range(world_size)]
    alone = BucketBatchSampler(lengths, batch_size * world_size, **options).batches(epoch)
    shares = [sampler.batches(epoch) for sampler in ranks]
    assert {len(share) for share in shares} == {len(ranks[0])} == {len(alone)}
    assert all(len(batch) == batch_size and (np.diff(batch) >= 0).all() for share in shares for batch in share)
    steps = [np.sort(np.concatenate(batches)) for batches in zip(*shares, strict=True)]
    for step, (batch, expected) in enumerate(zip(steps, alone, strict=True)):
        if len(expected) < len(batch):  # the short global batch: kept short by one rank, padded for more
            assert np.isin(expected, batch).all()
        else:
            assert np.array_equal(batch, expected), step
    seen = np.unique(np.concatenate(steps or [np.zeros(0, np.int64)]))
    expected_seen = num_samples // (batch_size * world_size) * batch_size * world_size if drop_last else num_samples
    assert len(seen) == expected_seen  # drop: every full global batch once; pad: every sample


def test_a_padded_bucket_batch_takes_the_pools_next_longest_samples():
    lengths = np.arange(10)  # one pool, sorted: the last global batch of 4 holds samples 8, 9
    ranks = [BucketBatchSampler(lengths, 2, rank=rank, world_size=2, shuffle=False) for rank in range(2)]
    assert [[b.tolist() for b in r] for r in ranks] == [[[0, 1], [4, 5], [6, 7]], [[2, 3], [6, 7], [8, 9]]]


def test_bucket_padding_of_a_rank_compares_its_own_samples():
    lengths = np.random.default_rng(0).lognormal(np.log(200), 0.7, 1003).astype(np.int64) + 1
    alone = BucketBatchSampler(lengths, 16, seed=3).padding()
    for rank in range(2):  # a rank's batches hold half the samples: its cells are not half a random epoch's
        report = BucketBatchSampler(lengths, 16, rank=rank, world_size=2, seed=3).padding()
        assert report["random"] == pytest.approx(alone["random"], abs=0.02)
        assert report["saved"] == pytest.approx(alone["saved"], abs=0.05)


@pytest.mark.slow
def test_max_cpu_caps_the_threads_of_every_way_of_reading(packed_files, monkeypatch):
    # 4 usable cores, max_cpu=0.5: 2 cores for loading, whether the loop waits or computes, here or in the helper
    monkeypatch.setattr("fastdata.loading.batchloader.usable_cpus", lambda: 4)
    monkeypatch.setattr("fastdata.loading.loader.usable_cpus", lambda: 4)
    for step, expected in ((time.sleep, 2), (spin, 2)):
        dataset = ThreadsRecordingDataset(packed_files("hdf5", "jpeg"))
        loader = make_loader(dataset, 2, max_cpu=0.5, helper_process=False)
        for _ in range(2):
            for _ in loader:
                step(STEP)
        assert set(dataset.threads) == {expected}
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    with make_loader(dataset, 2, max_cpu=0.5, helper_process=True) as loader:
        assert loader.helper.options["threads"] == 2
    with make_loader(dataset, 2, max_cpu=0.3, helper_process=True) as loader:
        assert loader.helper.options["threads"] == 1  # at least one core


@pytest.mark.slow
def test_max_cpu_shares_one_core_with_a_loop_that_computes(packed_files, monkeypatch):
    monkeypatch.setattr("fastdata.loading.batchloader.usable_cpus", lambda: 4)
    monkeypatch.setattr("fastdata.loading.loader.usable_cpus", lambda: 4)
    dataset = ThreadsRecordingDataset(packed_files("hdf5", "jpeg"))
    loader = make_loader(dataset, 2, max_cpu=1.0, helper_process=False)
    for _ in range(3):
        for _ in loader:
            spin(STEP)
    assert set(dataset.threads[len(loader):]) == {3}  # all 4 allowed, one left to the loop (NOTE [leave a core])


@pytest.mark.parametrize("options, message", [
    ({"max_cpu": 0}, "max_cpu should be a share of the usable cores, 0 < max_cpu <= 1"),
    ({"max_cpu": 1.5}, "max_cpu should be a share"),
    ({"max_cpu": True}, "max_cpu should be a share"),
    ({"max_cpu": 0.5, "threads": 3}, r"threads=3 would keep 3 cores busy, more than max_cpu=0.5 allows \(2 of 4\)"),
    ({"max_cpu": 0.5, "num_workers": 3}, "num_workers=3 would keep 3 cores busy"),
    ({"max_cpu": 0.5, "num_workers": 2, "threads": 2}, "num_workers=2 and threads=2 would keep 4 cores busy"),
])
def test_max_cpu_refuses_what_it_cannot_allow(packed_files, monkeypatch, options, message):
    monkeypatch.setattr("fastdata.loading.loader.usable_cpus", lambda: 4)
    with pytest.raises(OptionError, match=message):
        make_loader(open_dataset(packed_files("hdf5", "jpeg")), 2, **options)
