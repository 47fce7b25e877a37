"""profile(): how long a training loop waits for its next batch, measured in the loop itself.

NOTE [data-bound fraction]: a step of the loop is a wait (``next()`` on the
loader, until the batch is in hand) followed by the loop body (from the
yield until the loop asks for the next batch). The data-bound fraction is
``wait / (wait + body)`` over every step except the first one's wait: that
wait also pays for ``iter()`` (worker processes starting, files opening), a
one-off cost reported apart as ``first_batch_seconds``. A loop that waits
for more than ``starving_above`` (10%) of its time is starving: a faster
input pipeline would make it faster, a faster model would not.
"""

import sys
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from fastdata.errors import OptionError
from fastdata.loading.batchloader import BatchLoader
from fastdata.loading.workers import WorkerLoader

WAIT_LABEL = "fastdata.wait"  # the record_function label of every wait in a torch.profiler trace
STARVING_ABOVE = 0.10

_END = object()


@dataclass(frozen=True)
class ProfileReport:
    """Timings of one pass over a profiled loader (see NOTE [data-bound fraction]).

    ``str()`` is a one-line verdict, e.g. ``data-bound 3.1% (waited 0.12s of
    3.90s over 150 batches; 9,800 samples/s; first batch 0.80s) -> the input
    pipeline keeps up``.

    Attributes:
        batches: batches yielded.
        samples: samples in them, or None where a batch could not be counted.
        first_batch_seconds: wait for the first batch, ``iter()`` included.
        wait_seconds: waits for every later batch.
        body_seconds: time in the loop body, over every batch.
        total_seconds: ``first_batch_seconds + wait_seconds + body_seconds``.
        data_bound_fraction: ``wait_seconds / (wait_seconds + body_seconds)``.
        batches_per_s: ``batches / (wait_seconds + body_seconds)``.
        samples_per_s: ``samples / (wait_seconds + body_seconds)``, or None.
        wait_p50_seconds: median wait for a batch after the first.
        wait_p95_seconds: 95th percentile of those waits.
        starving_above: the data-bound fraction above which the loop is starving.
        hint: what to try when it is.
        read_paths: the batches the loader's dataset read for this process so far (a batch or two ahead of
            the loop), here or in its helper process, by the way they were read (``dataset.read_paths()``:
            "windows", "stitched", "by shard", "one file"); None where the loader has workers (they count their
            own), its dataset counts none (records, token sequences) or it is not fastdata's.
        fallbacks: what was warned about the fast paths that could not apply (FastPathWarning), in this
            process; see NOTE [no silent fallbacks] in fastdata/reading/readpaths.py.
    """

    batches: int
    samples: int | None
    first_batch_seconds: float
    wait_seconds: float
    body_seconds: float
    total_seconds: float
    data_bound_fraction: float
    batches_per_s: float
    samples_per_s: float | None
    wait_p50_seconds: float
    wait_p95_seconds: float
    starving_above: float = STARVING_ABOVE
    hint: str = ""
    read_paths: dict[str, int] | None = None
    fallbacks: tuple[str, ...] = ()

    @property
    def starving(self):
        """True when the loop waited for data more than ``starving_above`` of its steady-state time."""
        return self.batches > 1 and self.data_bound_fraction > self.starving_above

    def __str__(self):
        if self.batches < 2:
            return (f"{self.batches} batch(es), first batch {self.first_batch_seconds:.2f}s: "
                    "too few batches to tell whether the input pipeline keeps up")
        rate = (f"{self.samples_per_s:,.0f} samples/s" if self.samples_per_s is not None
                else f"{self.batches_per_s:,.1f} batches/s")
        verdict = f"GPU is starving: {self.hint}" if self.starving else "the input pipeline keeps up"
        read = "".join(f"; {path} {count:,}" for path, count in (self.read_paths or {}).items() if count)
        said = f"; {len(self.fallbacks)} fast path(s) could not apply: see .fallbacks" if self.fallbacks else ""
        return (f"data-bound {self.data_bound_fraction:.1%} (waited {self.wait_seconds:.2f}s of "
                f"{self.wait_seconds + self.body_seconds:.2f}s over {self.batches:,} batches; {rate}; "
                f"first batch {self.first_batch_seconds:.2f}s{read}{said}) -> {verdict}")


def profile(loader: Iterable, *, max_batches: int | None = None, batch_size_of: Callable[[Any], int] | None = None,
            cuda_sync: bool = False, starving_above: float = STARVING_ABOVE,
            print_report: bool = False) -> "ProfiledLoader":
    """Wrap ``loader`` to measure how long the training loop waits for its batches.

    Iterating the wrapper yields exactly the loader's batches. Each wait is
    timed and labelled ``"fastdata.wait"`` with
    ``torch.profiler.record_function``, so it shows in a torch.profiler trace;
    the loop body is the time between yields. Each pass (epoch) starts a new
    measurement; ``report()`` describes the latest one, also during it or
    after a ``break``.

    Args:
        loader: any iterable of batches: a DataLoader, make_loader(), a generator.
        max_batches: stop after this many batches (the loader is not asked for
            one more); default: the whole loader.
        batch_size_of: ``f(batch) -> int`` samples in a batch; default: the
            length of a tensor batch, or of the first element of a tuple,
            list or dict batch.
        cuda_sync: call ``torch.cuda.synchronize()`` before the body timer
            stops, so CUDA work the body queued counts as body and not as
            wait. Use it when the body never synchronizes (no ``.item()``):
            otherwise kernels still running while the loop waits make the
            wait look like starvation although the GPU is busy. The sync
            stalls the CPU at each step, so the loop may run slightly slower.
            Without CUDA it does nothing.
        starving_above: data-bound fraction above which the report says the
            loop is starving (0 < starving_above < 1).
        print_report: print the one-line report to stderr when a pass ends
            (exhausted, ``max_batches`` reached, or a ``break``).

    Returns:
        a ProfiledLoader: iterable, with ``len`` and ``report()``.

    Raises:
        TypeError: ``loader`` is not iterable or ``batch_size_of`` not callable.
        ValueError: a bad ``max_batches`` or ``starving_above``.

    Example:
        >>> loader = fastdata.profile(make_loader(HDF5Dataset("train.h5"), batch_size=256), print_report=True)
        >>> for images, labels in loader:
        ...     train_step(images, labels)
        data-bound 3.1% (waited 0.12s of 3.90s over 150 batches; 9,800 samples/s; first batch 0.80s) -> ...
        >>> loader.report().data_bound_fraction
        0.031
    """
    return ProfiledLoader(loader, max_batches=max_batches, batch_size_of=batch_size_of, cuda_sync=cuda_sync,
                          starving_above=starving_above, print_report=print_report)


class ProfiledLoader:
    """Iterable over a loader's batches that times the waits for them; made by ``profile()``."""

    def __init__(self, loader, *, max_batches=None, batch_size_of=None, cuda_sync=False,
                 starving_above=STARVING_ABOVE, print_report=False):
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"loader should be an iterable of batches, got {type(loader).__name__}")
        if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
            raise OptionError(f"max_batches should be a positive integer or None, got max_batches={max_batches!r}")
        if batch_size_of is not None and not callable(batch_size_of):
            raise TypeError(f"batch_size_of should be a function batch -> int, got {type(batch_size_of).__name__}")
        if not isinstance(starving_above, (int, float)) or not 0 < starving_above < 1:
            raise OptionError(f"starving_above should be a fraction between 0 and 1, got {starving_above!r}")
        self.loader = loader
        self.max_batches = max_batches
        self.batch_size_of = batch_size_of or _default_batch_size
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.starving_above = float(starving_above)
        self.print_report = print_report
        self._meter = _Meter()

    def __len__(self):
        n = len(self.loader)
        return n if self.max_batches is None else min(n, self.max_batches)

    def __iter__(self):
        self._meter = _Meter()
        return self._steps(self._meter)

    def __repr__(self):
        return f"<ProfiledLoader of {type(self.loader).__name__}: {self._meter.batches} batches timed>"

    def _steps(self, meter):
        """Yield the loader's batches, timing each wait and each loop body into ``meter``."""
        batches = None
        try:
            while self.max_batches is None or meter.batches < self.max_batches:
                start = time.perf_counter()
                with record_function(WAIT_LABEL):
                    if batches is None:
                        batches = iter(self.loader)  # worker start-up: part of the first wait
                    batch = next(batches, _END)
                if batch is _END:
                    return
                meter.add_wait(start, time.perf_counter(), self._count(batch))
                yield batch
                if self.cuda_sync:
                    torch.cuda.synchronize()
                meter.end_body(time.perf_counter())
        finally:
            # After a break (or an error in the body) the generator is closed here: the body ends now.
            meter.end_body(time.perf_counter())
            if self.print_report:
                print(self.report(), file=sys.stderr)

    def _count(self, batch):
        size = self.batch_size_of(batch)
        return None if size is None else int(size)

    def report(self) -> ProfileReport:
        """Return a ProfileReport of the latest pass; a body still running counts up to now."""
        meter = self._meter
        body = meter.body_seconds
        if meter.body_start is not None:
            body += time.perf_counter() - meter.body_start
        waits = np.frombuffer(meter.waits, dtype=np.float64)
        first, later = (float(waits[0]), waits[1:]) if len(waits) else (0.0, waits)
        wait = float(later.sum())
        steady = wait + body
        p50, p95 = np.percentile(later, [50, 95]).tolist() if len(later) else (0.0, 0.0)
        return ProfileReport(
            batches=meter.batches, samples=meter.samples, first_batch_seconds=first, wait_seconds=wait,
            body_seconds=body, total_seconds=first + steady,
            data_bound_fraction=_ratio(wait, steady), batches_per_s=_ratio(meter.batches, steady),
            samples_per_s=None if meter.samples is None else _ratio(meter.samples, steady),
            wait_p50_seconds=p50, wait_p95_seconds=p95, starving_above=self.starving_above,
            hint=_hint_for(self.loader), read_paths=_read_paths(self.loader),
            fallbacks=_fallbacks(self.loader),
        )


class _Meter:
    """Running sums of one pass: every wait (8 bytes each), summed bodies, counted samples."""

    def __init__(self):
        self.waits = array("d")
        self.body_seconds = 0.0
        self.body_start = None  # perf_counter() at the yield of a batch whose body is running
        self.batches = 0
        self.samples = 0

    def add_wait(self, start, stop, samples):
        self.waits.append(stop - start)
        self.batches += 1
        self.samples = None if self.samples is None or samples is None else self.samples + samples
        self.body_start = stop

    def end_body(self, stop):
        if self.body_start is not None:
            self.body_seconds += stop - self.body_start
            self.body_start = None


def _ratio(part, whole):
    return part / whole if whole > 0 else 0.0


def _default_batch_size(batch):
    """Samples in ``batch``: the leading size of a tensor, or of the first element of a tuple, list or dict."""
    column = batch
    if isinstance(batch, Mapping):
        column = next(iter(batch.values()), None)
    elif isinstance(batch, (tuple, list)) and batch:
        column = batch[0]
    shape = getattr(column, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    try:
        return len(column)
    except TypeError:
        return None


def _read_paths(loader):
    """Return the batches ``loader``'s dataset read for this process by each path, or None (workers, a dataset
    that counts none, others)."""
    dataset = loader.packed_dataset if isinstance(loader, BatchLoader) else None
    return dataset.read_paths() if hasattr(dataset, "read_paths") else None


def _fallbacks(loader):
    """Return the fast-path warnings of ``loader``'s dataset in this process."""
    dataset = loader.packed_dataset if isinstance(loader, (BatchLoader, WorkerLoader)) else None
    return tuple(dataset.fallbacks().values()) if hasattr(dataset, "fallbacks") else ()


def _hint_for(loader):
    """Return what to try first when ``loader`` starves the loop."""
    if not isinstance(loader, (BatchLoader, WorkerLoader)):
        return 'pack the dataset once with "fastdata convert" and read it with make_loader, or raise num_workers'
    if _decodes_images(loader.packed_dataset):
        return "image decoding is the cost: raise num_workers, or convert with --storage raw"
    return "raise prefetch_factor or num_workers in make_loader, or move per-batch transforms onto the GPU"


def _decodes_images(dataset):
    """Whether ``dataset``'s batches decode images (JPEG or PNG storage; a record file's image fields read)."""
    if hasattr(dataset, "schema"):  # a RecordDataset
        return any(dataset.schema[name].type == "image" and dataset.schema[name].storage != "raw"
                   for name in dataset.fields)
    return getattr(dataset, "storage", None) in ("jpeg", "png")
