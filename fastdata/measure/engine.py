"""Measure loading throughput: the engine behind `fastdata bench`, `fastdata tune` and benchmarks/.

NOTE [whole epochs]: a loader is built once and measured over whole epochs:
one untimed warm-up epoch (worker start-up, file opening, cold pages), then
``repeats`` timed passes, each repeating epochs until it lasts
``min_seconds``; the rate is the median pass. Every epoch must yield as many
samples as the first (and ``expected`` where given), so a loader that drops
or repeats batches fails instead of looking fast.

Only the standard library, numpy and Pillow are imported at the top (torch,
h5py and the converters on first use), so benchmark scripts importing this
stay light (see NOTE [light main] in benchmarks/sections/images.py).
"""

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

from fastdata.measure.memory import MEMORY_KEYS, MemoryProbe, worker_pids


@dataclass
class Rate:
    """Throughput of one benchmarked method: the median of timed passes.

    Attributes:
        samples_per_s: median over passes of samples consumed / wall seconds.
        pass_rates: samples/s of each timed pass, in run order.
        samples_per_pass: samples consumed by one timed pass.
        epochs_per_pass: epochs (full iterations) in one timed pass.
        warmup_seconds: wall time of the untimed warm-up epoch.
        worker_memory: with ``measure_loader(memory=True)``: ``memory_growth`` of the workers.
    """

    samples_per_s: float
    pass_rates: list = field(default_factory=list)
    samples_per_pass: int = 0
    epochs_per_pass: int = 1
    warmup_seconds: float = 0.0
    worker_memory: dict | None = None

    def to_dict(self):
        return asdict(self)


def measure_rate(run_epoch, repeats, *, min_seconds=0.2, max_seconds=None, expected=None):
    """Time ``run_epoch`` (which returns the number of samples it consumed); see NOTE [whole epochs].

    Args:
        run_epoch: callable running one full epoch; returns samples consumed.
        repeats: timed passes (at least 1).
        min_seconds: target duration of one timed pass.
        max_seconds: take no further pass once this long has gone since the
            start (the warm-up included); at least one pass is always taken.
        expected: samples one epoch must yield.

    Returns:
        Rate.

    Raises:
        RuntimeError: an epoch consumed a different number of samples (than the first, or ``expected``).
    """
    started = time.perf_counter()
    per_epoch = run_epoch()
    warmup = time.perf_counter() - started
    if expected is not None and per_epoch != expected:
        raise RuntimeError(f"an epoch gave {per_epoch} samples, expected {expected}; the loader is wrong")
    epochs = _epochs_per_pass(run_epoch, per_epoch, min_seconds, warmup)
    rates = []
    for _ in range(max(1, repeats)):
        rates.append(_timed_pass(run_epoch, epochs, per_epoch))
        if max_seconds is not None and time.perf_counter() - started >= max_seconds:
            break
    return Rate(statistics.median(rates), rates, per_epoch * epochs, epochs, warmup)


def interleaved_rates(run_epochs, rounds, min_seconds):
    """Time ``run_epochs`` (name -> epoch function) in turn, ``rounds`` times; return name -> samples/s per round.

    NOTE [interleaved rates]: this VM's speed drifts by up to a third over
    seconds (the same loader measured 75k and 110k img/s a few seconds
    apart, in one process), so two rates measured minutes apart give a
    ratio that is mostly drift. Passes of each method taken in turn, a
    fraction of a second each, see the same machine; the ratio of a round's
    rates is then the comparison. Each method is warmed up once first.
    """
    passes = {}
    for name, run_epoch in run_epochs.items():
        per_epoch = run_epoch()  # warm-up
        passes[name] = (_epochs_per_pass(run_epoch, per_epoch, min_seconds, warmup=0.0), per_epoch)
    rates = {name: [] for name in run_epochs}
    for _ in range(rounds):
        for name, run_epoch in run_epochs.items():
            rates[name].append(_timed_pass(run_epoch, *passes[name]))
    return rates


def _epochs_per_pass(run_epoch, per_epoch, min_seconds, warmup):
    """Return how many epochs make a pass of ``min_seconds``, timing a steady epoch unless the warm-up was long."""
    seconds = warmup
    if warmup < min_seconds:  # the warm-up may include start-up costs; time a steady epoch
        began = time.perf_counter()
        check_count(run_epoch(), per_epoch)
        seconds = time.perf_counter() - began
    return max(1, math.ceil(min_seconds / max(seconds, 1e-9)))


def _timed_pass(run_epoch, epochs, per_epoch):
    """Run ``epochs`` epochs; return their samples/s, checking that each pass consumed ``per_epoch`` per epoch."""
    began = time.perf_counter()
    consumed = sum(run_epoch() for _ in range(epochs))
    seconds = time.perf_counter() - began
    check_count(consumed, per_epoch * epochs)
    return consumed / seconds


def check_count(consumed, expected):
    """Raise RuntimeError unless a pass consumed exactly ``expected`` samples."""
    if consumed != expected:
        raise RuntimeError(f"a pass consumed {consumed} samples, expected {expected}; the benchmark is wrong")


def measure_loader(make_iterable, *, repeats=3, min_seconds=0.2, max_seconds=None, expected=None, memory=False):
    """Build a loader with ``make_iterable()`` and measure it over whole epochs (see NOTE [whole epochs]).

    Args:
        make_iterable: returns the loader: an iterable of batches whose first
            element is a tensor ``[B, ...]`` (a tensor batch works too).
        repeats, min_seconds, max_seconds: as for ``measure_rate``.
        expected: samples one epoch must yield.
        memory: also record how each worker process's memory grew over the
            timed passes in ``Rate.worker_memory`` (persistent workers only).

    Returns:
        Rate. The loader's persistent workers are stopped before returning.

    Example:
        >>> rate = measure_loader(lambda: make_loader(dataset, 256, shuffle=True), expected=len(dataset))
    """
    loader = make_iterable()
    probe = MemoryProbe(lambda: worker_pids(loader), MEMORY_KEYS)
    run_epoch = probe.wrap(lambda: consume(loader)) if memory else lambda: consume(loader)
    try:
        rate = measure_rate(run_epoch, repeats, min_seconds=min_seconds, max_seconds=max_seconds, expected=expected)
        if memory:
            rate.worker_memory = probe.growth()
    finally:
        close_loader(loader)
    return rate


def consume(loader, key=None):
    """Iterate one epoch as a training loop does, touching every batch; return the samples seen.

    Each batch stays alive until the next one arrives, as in ``for images, labels in loader``.
    The samples are ``batch[key]`` where ``key`` is given, else the first tensor (of a dict batch, its first
    tensor field).
    """
    count = 0
    for batch in loader:
        if key is None and isinstance(batch, dict):  # a record batch: its first tensor
            key = next(name for name, value in batch.items() if hasattr(value, "dim"))
        first = batch[key] if key is not None else batch[0] if isinstance(batch, (tuple, list)) else batch
        count += first.shape[0]  # ~0.2 us against ~0.5 for a tensor's len()
        touch(first)
    return count


def touch(tensor):
    """Read the last element of ``tensor``, as a step that uses the batch would; copy nothing.

    (``tensor.reshape(-1)`` would copy a whole channels_last JPEG batch.) A
    CPU tensor numpy can view is read through that view, its last element by
    flat index: 1.0 us against 2.4 for torch's indexing and 1.5 for the
    view's (an [8, 2049] uint16 batch; the lm section's copy limit spends
    ~10 us a batch).
    """
    if tensor.is_cpu:
        try:
            return tensor.numpy().item(-1)
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a tensor that needs grad
            pass
    return tensor[(-1,) * tensor.dim()].item()


def close_loader(loader):
    """Stop a loader's threads and persistent workers now rather than at some later garbage collection."""
    if hasattr(loader, "close"):  # fastdata's loaders: workers, helper, read-ahead
        loader.close()
        return
    from fastdata.loading.workers import close_workers  # torch is loaded already: ``loader`` is a DataLoader

    close_workers(loader)
