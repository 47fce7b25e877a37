"""tune_loader(): search make_loader settings for one packed file on this machine, within a time budget.

NOTE [tune search]: a coordinate search, one setting at a time, from
make_loader's defaults (batch 256, in-process, prefetch 2):
1. batch_size doubles from 64 while samples/s rises by more than 5% (up to
   1024, a quarter of the trial epoch, and what fits in memory);
2. num_workers: 0 (in-process) is always measured, then 1, 2, 4, ... up to
   ``max_workers`` while the worker-process curve rises by more than 5%,
   and only while perfect linear scaling to ``max_workers`` could still
   beat the best so far (for raw storage, in-process reading usually wins
   by far: measured, not assumed);
3. prefetch_factor in 2, 1, 4 for the chosen workers;
4. pin_memory True and False, only where CUDA is available;
5. where the result differs from the start, both are measured again back
   to back, and the result is kept only if still more than 5% faster: on a
   busy machine one noisy trial would otherwise pick settings by chance.
Each phase keeps the first setting, in preference order (smallest batch,
fewest workers, the default prefetch, pinning on CUDA), whose rate is within
5% of the best measured; so the result depends only on the measurements.
Before each trial, the median trial so far estimates its cost; when it would
end past the budget the search stops and recommends the best so far (the
first trial always runs). A trial measures whole shuffled epochs (NOTE
[whole epochs] in engine.py) over the first ``samples_per_epoch`` samples,
sized so that an epoch at the default settings takes a fraction of a trial.
"""

import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

from fastdata._cpu import usable_cpus
from fastdata.errors import OptionError
from fastdata.loading.recommendation import file_identity
from fastdata.measure.engine import measure_loader
from fastdata.measure.machine import available_memory, describe_machine

THRESHOLD = 0.05  # a setting must be this much faster to count as better
BATCH_SIZES = (64, 128, 256, 512, 1024)
PREFETCH_FACTORS = (2, 1, 4)  # in preference order: the default first
DEFAULTS = {"batch_size": 256, "num_workers": 0, "prefetch_factor": 2, "pin_memory": False}
MEMORY_SHARE = 0.25  # batches in flight may take this share of the available memory
_MIN_BATCHES_PER_EPOCH = 4
_TRIALS_PER_BUDGET = 12  # trial length: the budget over this, within _TRIAL_SECONDS
_TRIAL_SECONDS = (0.5, 10.0)


@dataclass
class TuneResult:
    """What ``tune_loader`` measured and recommends; ``to_dict()`` is the saved JSON.

    Attributes:
        file: the tuned file: ``path``, ``size``, ``mtime_ns``, ``num_samples``, ``format``, ``storage``.
        machine: ``describe_machine()`` and ``cuda``.
        trials: one dict per measured setting, in run order.
        recommended: ``batch_size``, ``num_workers``, ``prefetch_factor``, ``pin_memory``.
        budget_seconds, elapsed_seconds: the time allowed and spent.
        stopped_early: why the search stopped before its end, or None.
        search: how trials were measured (epoch size, trial length, ...).
    """

    file: dict
    machine: dict
    trials: list
    recommended: dict
    budget_seconds: float
    elapsed_seconds: float
    stopped_early: str | None = None
    search: dict = field(default_factory=dict)

    def call(self):
        """Return the recommended call, e.g. ``make_loader(dataset, batch_size=256, num_workers=0, ...)``."""
        settings = ", ".join(f"{key}={self.recommended[key]!r}" for key in DEFAULTS)
        return f"make_loader(dataset, {settings})"

    def to_dict(self):
        return {**asdict(self), "call": self.call()}

    def __str__(self):
        best = max(self.trials, key=lambda trial: trial["samples_per_s"])
        chosen = next(t for t in self.trials if all(t[key] == self.recommended[key] for key in DEFAULTS))
        pinning = self.search.get("pin_memory", "n/a (no CUDA)")
        ending = f"stopped early: {self.stopped_early}" if self.stopped_early else "search complete"
        lines = [
            f"measured {len(self.trials)} settings in {self.elapsed_seconds:.1f}s of a {self.budget_seconds:g}s "
            f"budget ({ending}); pin_memory: {pinning}",
            f"fastest trial: {best['samples_per_s']:,.0f} samples/s; recommended settings: "
            f"{chosen['samples_per_s']:,.0f} samples/s",
        ]
        if self.search.get("confirmation"):
            lines.append(f"best settings {self.search['confirmation']}")
        return "\n".join([*lines, f"recommended: {self.call()}"])


def format_trial(trial):
    """Return one line describing a measured trial."""
    rate = f"{trial['samples_per_s']:>12,.0f} samples/s ({trial['seconds']:.1f}s)"
    return f"  {trial['phase']:<15} {_settings_text(trial)}: {rate}"


def _settings_text(settings):
    return " ".join(f"{key}={settings[key]}" for key in DEFAULTS)


def tune_loader(path, *, budget=60.0, max_workers=None, batch_size=None, on_trial=None, measure=None,
                clock=time.monotonic):
    """Search num_workers, batch_size, prefetch_factor and pin_memory for ``path`` (see NOTE [tune search]).

    Args:
        path: a packed .h5 or .arrow file, or a shard folder.
        budget: seconds to spend; the search stops early to stay within it.
        max_workers: most worker processes to try; default twice the usable CPUs.
        batch_size: keep this batch size and search the other settings only.
        on_trial: called with each trial's dict as soon as it is measured.
        measure: ``measure(settings, max_seconds) -> Rate`` replacing the
            real measurement (tests); ``settings`` has the keys of DEFAULTS.
        clock: monotonic seconds (tests).

    Returns:
        TuneResult; save it with ``write_tune_json``.

    Raises:
        ValueError: ``budget`` is not positive, or ``path`` is not a .h5/.arrow file.

    Example:
        >>> result = tune_loader("train.h5", budget=60)
        >>> print(result.call())
    """
    import torch

    from fastdata.loading.datasets import open_dataset

    if not budget > 0:
        raise OptionError(f"budget should be a positive number of seconds, got budget={budget!r}")
    started = clock()
    dataset = open_dataset(path)
    cuda = torch.cuda.is_available()
    max_workers = 2 * usable_cpus() if max_workers is None else max_workers
    trial_seconds = min(max(budget / _TRIALS_PER_BUDGET, _TRIAL_SECONDS[0]), _TRIAL_SECONDS[1])
    num_samples = len(dataset) if measure is not None else _epoch_samples(dataset, trial_seconds)
    if measure is None:
        measure = _LoaderTrials(dataset, num_samples, trial_seconds)
    sizes = [b for b in BATCH_SIZES if b == BATCH_SIZES[0] or b * _MIN_BATCHES_PER_EPOCH <= num_samples]
    outcome = search(measure, budget=budget - (clock() - started), batch_sizes=None if batch_size else sizes,
                     start={**DEFAULTS, "batch_size": batch_size or DEFAULTS["batch_size"], "pin_memory": cuda},
                     max_workers=max_workers, cuda=cuda, fits=_fits_in_memory(dataset), clock=clock,
                     on_trial=on_trial)
    search_info = {"samples_per_epoch": num_samples, "trial_seconds": trial_seconds, "max_workers": max_workers,
                   "batch_sizes": sizes if not batch_size else [batch_size], "threshold": THRESHOLD,
                   "pin_memory": "measured" if cuda else "n/a (no CUDA)", "confirmation": outcome["confirmation"]}
    return TuneResult(file_identity(path, dataset), {**describe_machine(), "cuda": cuda}, outcome["trials"],
                      outcome["recommended"], budget, clock() - started, outcome["stopped_early"], search_info)


def search(measure, *, budget, start=None, batch_sizes=BATCH_SIZES, max_workers=4, cuda=False,
           fits=lambda settings: True, clock=time.monotonic, on_trial=None):
    """Run the coordinate search of NOTE [tune search] with ``measure``; deterministic given its rates.

    Args:
        measure: ``measure(settings, max_seconds)`` returning a Rate (or
            anything with ``samples_per_s``, or a number of samples/s).
        budget: seconds the search may take, by ``clock``.
        start: the first settings measured (default DEFAULTS).
        batch_sizes: batch sizes to climb through, or None to keep the start's.
        max_workers: most worker processes to try.
        cuda: whether to try pin_memory both ways.
        fits: ``fits(settings)`` is false for settings too large for memory.

    Returns:
        dict: ``trials``, ``recommended`` settings, ``stopped_early`` (why,
        or None) and ``confirmation`` (what step 5 found, or None).
    """
    run = _Trials(measure, budget, clock, on_trial)
    current = dict(start or DEFAULTS)
    if run.rate(current, "defaults") is None:
        raise RuntimeError("the first trial did not run")  # it always runs: there is no estimate yet
    if batch_sizes:
        _climb(run, current, "batch_size", [b for b in batch_sizes if fits({**current, "batch_size": b})])
        current["batch_size"] = run.pick(current, "batch_size", sorted(set(batch_sizes) | {current["batch_size"]}))
    _search_workers(run, current, max_workers, fits)
    for factor in PREFETCH_FACTORS:
        if fits({**current, "prefetch_factor": factor}):
            run.rate({**current, "prefetch_factor": factor}, "prefetch_factor")
    current["prefetch_factor"] = run.pick(current, "prefetch_factor", PREFETCH_FACTORS)
    if cuda:
        for pin in (True, False):
            run.rate({**current, "pin_memory": pin}, "pin_memory")
        current["pin_memory"] = run.pick(current, "pin_memory", (True, False))
    current, confirmation = _confirm(run, current, dict(start or DEFAULTS))
    return {"trials": run.trials, "recommended": current, "stopped_early": run.stopped, "confirmation": confirmation}


def _confirm(run, chosen, start):
    """Measure ``chosen`` and ``start`` again, back to back; return the one to recommend and what happened."""
    if chosen == start:
        return start, None
    again, baseline = run.rate(chosen, "confirm", fresh=True), run.rate(start, "confirm", fresh=True)
    if again is None or baseline is None:
        return chosen, "not confirmed (out of budget)"
    if again > baseline * (1 + THRESHOLD):
        return chosen, f"confirmed: {again:,.0f} against {baseline:,.0f} samples/s at the start settings"
    return start, (f"rejected: measured again, {_settings_text(chosen)} gave {again:,.0f} against {baseline:,.0f} "
                   "samples/s at the start settings, which are kept")


def _climb(run, current, key, values):
    """Measure ``values`` of ``key`` in order while each is more than THRESHOLD faster than the one before."""
    previous = None
    for value in values:
        rate = run.rate({**current, key: value}, key)
        if rate is None or (previous is not None and rate <= previous * (1 + THRESHOLD)):
            return
        previous = rate


def _search_workers(run, current, max_workers, fits):
    """Measure 1, 2, 4, ... workers while they rise and could still catch up; set the chosen count."""
    counts, previous, count = [], None, 1
    while count <= max_workers and fits({**current, "num_workers": count}):
        counts.append(count)
        rate = run.rate({**current, "num_workers": count}, "num_workers")
        if rate is None or (previous is not None and rate <= previous * (1 + THRESHOLD)):
            break
        best = max(r for r in run.rates_of(current, "num_workers", [0, *counts]).values())
        if rate * max_workers / count <= best:  # even linear scaling to max_workers would not beat it
            break
        previous, count = rate, count * 2
    current["num_workers"] = run.pick(current, "num_workers", [0, *counts])


class _Trials:
    """Measured rates by settings, the trial log, and the budget."""

    def __init__(self, measure, budget, clock, on_trial):
        self.measure, self.budget, self.clock, self.on_trial = measure, budget, clock, on_trial
        self.started = clock()
        self.trials, self.stopped, self._rates = [], None, {}

    def rate(self, settings, phase, fresh=False):
        """Return the samples/s of ``settings``: measured now (always if ``fresh``) or before; None past the budget."""
        key = _key(settings)
        if key in self._rates and not fresh:
            return self._rates[key]
        if self.stopped:
            return None
        elapsed = self.clock() - self.started
        if self.trials:
            estimate = statistics.median(trial["seconds"] for trial in self.trials)
            if elapsed + estimate > self.budget:
                self.stopped = (f"a {phase} trial would take ~{estimate:.1f}s more, past the {self.budget:.1f}s "
                                f"budget after {elapsed:.1f}s")
                return None
        began = self.clock()
        result = self.measure(dict(settings), max(self.budget - elapsed, 0.0))
        rate = float(getattr(result, "samples_per_s", result))
        trial = {**settings, "phase": phase, "samples_per_s": rate, "seconds": self.clock() - began}
        if hasattr(result, "pass_rates"):
            trial["pass_rates"] = list(result.pass_rates)
        self.trials.append(trial)
        self._rates.setdefault(key, rate)
        if self.on_trial is not None:
            self.on_trial(trial)
        return rate

    def rates_of(self, current, key, values):
        """Return ``{value: rate}`` of the measured settings ``current`` with ``key`` set to each of ``values``."""
        rates = {value: self._rates.get(_key({**current, key: value})) for value in values}
        return {value: rate for value, rate in rates.items() if rate is not None}

    def pick(self, current, key, preference):
        """Return the first value of ``preference`` within THRESHOLD of the best measured rate."""
        rates = self.rates_of(current, key, preference)
        best = max(rates.values())
        return next(value for value in preference if value in rates and rates[value] * (1 + THRESHOLD) >= best)


def _key(settings):
    return tuple(settings[key] for key in DEFAULTS)


class _LoaderTrials:
    """``measure(settings, max_seconds)`` for real: make_loader over shuffled epochs of the first samples."""

    def __init__(self, dataset, num_samples, trial_seconds, repeats=3):
        self.dataset, self.num_samples = dataset, num_samples
        self.trial_seconds, self.repeats = trial_seconds, repeats

    def __call__(self, settings, max_seconds):
        from fastdata.loading.loader import make_loader
        from fastdata.loading.samplers import BatchIndexSampler

        sampler = BatchIndexSampler(self.num_samples, settings["batch_size"], shuffle="uniform")
        options = {key: settings[key] for key in ("num_workers", "prefetch_factor", "pin_memory")}
        with warnings.catch_warnings():  # more workers than CPUs is tried on purpose: torch warns against it
            warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
            return measure_loader(lambda: make_loader(self.dataset, batch_sampler=sampler, **options),
                                  repeats=self.repeats, min_seconds=self.trial_seconds / (self.repeats + 2),
                                  max_seconds=min(self.trial_seconds, max_seconds), expected=self.num_samples)


def _epoch_samples(dataset, trial_seconds):
    """Return the samples of a trial epoch: one epoch at the defaults should take ~1/5 of a trial."""
    from fastdata.loading.loader import make_loader
    from fastdata.loading.samplers import BatchIndexSampler

    probe = min(len(dataset), 2048)
    loader = make_loader(dataset, batch_sampler=BatchIndexSampler(probe, DEFAULTS["batch_size"], shuffle="uniform"),
                         pin_memory=False)
    began = time.perf_counter()
    for _ in loader:
        pass
    rate = probe / max(time.perf_counter() - began, 1e-6)
    smallest = _MIN_BATCHES_PER_EPOCH * BATCH_SIZES[-1]
    return min(len(dataset), max(smallest, int(rate * trial_seconds / 5)))


def _fits_in_memory(dataset):
    """Return ``fits(settings)``: whether the batches in flight take at most MEMORY_SHARE of free memory."""
    available = available_memory()

    def fits(settings):
        batch_bytes = dataset.max_batch_bytes(settings["batch_size"])
        if available is None or batch_bytes is None:
            return True
        in_flight = max(settings["num_workers"], 1) * (settings["prefetch_factor"] + 2)
        return batch_bytes * in_flight <= MEMORY_SHARE * available

    return fits


# ---------------------------------------------------------------- the saved recommendation


def write_tune_json(result, out):
    """Write ``result.to_dict()`` to ``out`` as JSON; return ``out``."""
    from fastdata.measure.tables import write_json

    return write_json(result.to_dict(), out)
