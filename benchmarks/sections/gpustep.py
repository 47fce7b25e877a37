"""Simulated GPU step: how long a training loop loses to data loading from packed files.

The loop takes a batch of 256 from ``make_loader`` (defaults: read-ahead
thread, 2 batches ahead), touches it and sleeps 5 ms, the time a GPU step
might take, while the loader reads the next batches. An epoch is 100
batches drawn from successive shuffled permutations of the file (a
25,600-sample epoch), so the read-ahead restarting at each epoch weighs as
in a real dataset, not as in a file of a few batches.

NOTE [time lost to data]: the time inside ``next()`` is not all the time
the loop loses. The loader's threads compete with the loop for the cores
and for the GIL, so the loop's own Python and torch calls can take longer
and its sleeps can wake late. So each row also times the same loop (the
same touch of a batch already in memory, the same sleeps) without a
loader; the time lost is the epoch time minus that. The target uses the
time lost; the table shows both. The touch reads one element and copies
nothing: an earlier ``int(batch.reshape(-1)[-1])`` copied every
channels_last JPEG batch whole (2 ms per 64x64 batch while decoders
were busy), which the table then blamed on loading.

A warm-up of 10 batches, then timed epochs (at least 5 where data keeps
up, --quick 2, and at least 4 x --min-seconds); fractions are sums over
the timed epochs, the loop without data is the median of 3. Each row runs
in a fresh process.
"""

import statistics
import time

from benchmarks import inputs
from benchmarks.sections import text
from fastdata.measure.engine import touch
from fastdata.measure.tables import markdown_table

STEP_SECONDS = 0.005
BATCHES_PER_EPOCH = 100
WARMUP_BATCHES = 10
TIMED_EPOCHS = 5  # where data keeps up; an epoch is ~0.5 s, the fraction's noise ~1% per epoch
WAIT_FRACTION_MAX = 0.02  # target: waiting under 2% of the epoch


def measure_row(spec, setup):
    """Run the simulated training loop over one file in this process; return its dict."""
    key, path, options = spec
    from benchmarks.samplers import EpochBatches
    from fastdata import make_loader, open_dataset

    # see NOTE [time lost to data]
    steps_only = statistics.median(_steps_only(setup["batches_per_epoch"]) for _ in range(3))
    dataset = open_dataset(path)
    sampler = EpochBatches(len(dataset), setup["batch_size"], setup["batches_per_epoch"], seed=setup["seed"])
    loader = make_loader(dataset, batch_sampler=sampler, **options)
    _epoch(loader, WARMUP_BATCHES)  # opens the file, starts the thread pools
    epochs, budget = [], 4 * setup["min_seconds"]
    while not epochs or sum(e["seconds"] for e in epochs) < budget or (
        len(epochs) < setup["epochs"] and epochs[0]["seconds"] < 2 * steps_only
    ):
        epochs.append(_epoch(loader))
    seconds, waits = sum(e["seconds"] for e in epochs), sum(e["wait"] for e in epochs)
    lost = max(0.0, seconds - len(epochs) * steps_only)
    print(f"  gpu step {key}: {lost / seconds:.2%} of the time lost to data ({waits / seconds:.2%} in next())",
          flush=True)
    return {
        "key": key,
        "path": path,
        "options": options,
        "epochs": len(epochs),
        "batches_per_epoch": setup["batches_per_epoch"],
        "seconds": seconds,
        "steps_only_seconds_per_epoch": steps_only,
        "lost_seconds": lost,
        "lost_fraction": lost / seconds,
        "next_seconds": waits,
        "next_fraction": waits / seconds,
        "first_batch_wait_ms": statistics.median(e["first_wait"] for e in epochs) * 1e3,
        "batch_size": setup["batch_size"],
        "samples_per_s": len(epochs) * setup["batches_per_epoch"] * setup["batch_size"] / seconds,
        "step_ms": STEP_SECONDS * 1e3,
    }


def _steps_only(count):
    """Return the seconds of ``count`` simulated steps on a batch already in memory (no loader)."""
    import torch

    batch = torch.zeros((256, 3, 8, 8), dtype=torch.uint8)
    started = time.perf_counter()
    for _ in range(count):
        touch(batch)  # the same touch as in _epoch
        time.sleep(STEP_SECONDS)
    return time.perf_counter() - started


def _epoch(loader, stop_after=None):
    """Run one epoch of the simulated loop (or its first batches); return its seconds and waits."""
    wait, first, count = 0.0, None, 0
    started = time.perf_counter()
    batches = iter(loader)
    while stop_after is None or count < stop_after:
        before = time.perf_counter()
        batch = next(batches, None)
        waited = time.perf_counter() - before
        if batch is None:
            break
        wait += waited
        first = waited if first is None else first
        count += 1
        touch(batch[0])  # the step reads the batch
        time.sleep(STEP_SECONDS)
    if stop_after is None and count != len(loader):
        raise RuntimeError(f"an epoch gave {count} batches, expected {len(loader)}")
    return {"seconds": time.perf_counter() - started, "wait": wait, "first_wait": first or 0.0}


def row_specs(config):
    """Return ``(key, path, make_loader options)`` for each packed file: images at every size, then text."""
    specs = []
    for size in config["sizes"]:
        files = inputs.packed_images(config["workdir"], config["num_images"], size, config["seed"])
        specs += [(f"{key} {size}px", path, {}) for key, path in files.items()]
    files = inputs.packed_reviews(config["workdir"], config["text_docs"], config["seed"], text.MAX_LENGTH)
    specs += [(f"text {fmt}", path, {}) for fmt, path in files.items()]
    return specs


def targets_of(rows):
    """Return one target per row: at most 2% of the epoch lost to data (see NOTE [time lost to data])."""
    targets = []
    for row in rows:
        steps_only = row["batch_size"] * row["batches_per_epoch"] / row["steps_only_seconds_per_epoch"]
        targets.append({
            "name": f"simulated 5 ms GPU step, {row['key']}: share of the epoch lost to data",
            "value": row["lost_fraction"], "threshold": WAIT_FRACTION_MAX, "at_least": False,
            "info": f"{row['next_fraction']:.2%} inside next(); an epoch's first batch waits "
                    f"{row['first_batch_wait_ms']:.1f} ms; the loop ran at {row['samples_per_s']:,.0f} samples/s "
                    f"(without data: {steps_only:,.0f})"})
    return targets


def table(rows):
    body = [(row["key"], f"{row['lost_fraction']:.2%}", f"{row['next_fraction']:.2%}",
             f"{row['first_batch_wait_ms']:.2f}", f"{row['seconds'] / row['epochs']:.3f}",
             f"{row['steps_only_seconds_per_epoch']:.3f}", row["epochs"]) for row in rows]
    headers = ["packed file (make_loader defaults)", "epoch lost to data", "inside next()", "first batch wait ms",
               "epoch s", "same sleeps without data s", "epochs"]
    return markdown_table(headers, body, "lrrrrrr")


def run(config, fresh):
    """Run the simulated-GPU-step section; return rows, targets and table."""
    setup = {key: config[key] for key in ("batch_size", "repeats", "min_seconds", "seed")}
    setup["batches_per_epoch"] = 20 if config["quick"] else BATCHES_PER_EPOCH
    setup["epochs"] = 2 if config["quick"] else TIMED_EPOCHS
    rows = [fresh.run(measure_row, spec, setup) for spec in row_specs(config)]
    return {"step_ms": STEP_SECONDS * 1e3, "batches_per_epoch": setup["batches_per_epoch"], "rows": rows,
            "targets": targets_of(rows), "table": table(rows)}
