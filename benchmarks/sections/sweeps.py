"""Sweeps of the classic DataLoader tuning write-ups: num_workers, batch_size, prefetch_factor, pin_memory.

Run through benchmarks/run.py (``--only sweeps``), on the 64x64 files and
the photo folder. Formats: the raw-folder Dataset (Pillow decode + resize
per item, default collate, a stock DataLoader) and the packed files through
``make_loader``. Each point runs in a fresh process and reads from one
running iterator over an endless shuffled batch sampler, so a pass is a
number of batches (at least one per worker, and 1,024 samples) rather than
an epoch of a small file: with 16 workers and 8 batches per epoch, half
the workers would idle. One warm-up pass starts the workers; the figure is
the median of timed passes. pin_memory matters only with CUDA: without it
the points are recorded as not applicable.
"""

import math
from functools import partial

from benchmarks import inputs
from benchmarks.machine import cuda_device
from fastdata.measure.engine import measure_rate, touch

SIZE = 64
FORMATS = ("folder", "hdf5-raw", "arrow-raw", "hdf5-jpeg", "arrow-jpeg")
WORKERS = (0, 1, 2, 4, 8, 16)
BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024)
PREFETCH_FACTORS = (1, 2, 4, 8)
PREFETCH_FORMATS = ("folder", "hdf5-raw", "hdf5-jpeg")
QUICK = {"formats": ("folder", "hdf5-raw", "hdf5-jpeg"), "workers": (0, 2), "batch_sizes": (64, 256),
         "prefetch_factors": (1, 2)}
MIN_PASS_SAMPLES = 1024
HURT_FRACTION = 0.9  # more workers "hurt" once the rate falls below this share of the best
HELP_FRACTION = 0.95  # more workers "stop helping" from the first count within 5% of the best


def plan(config, cuda):
    """Return ``{sweep: [point, ...]}``.

    A point is a dict: format, num_workers, batch_size, prefetch_factor,
    pin_memory (and copy_to_gpu in the pin_memory sweep, CUDA only).
    """
    quick = config["quick"]
    formats = QUICK["formats"] if quick else FORMATS
    workers, batch = config["workers"], config["batch_size"]

    def point(fmt, num_workers=workers, batch_size=batch, prefetch_factor=2, pin_memory=False):
        return {"format": fmt, "num_workers": num_workers, "batch_size": batch_size,
                "prefetch_factor": prefetch_factor, "pin_memory": pin_memory}

    sweeps = {
        "num_workers": [point(f, num_workers=w) for f in formats for w in (QUICK["workers"] if quick else WORKERS)],
        "batch_size": [point(f, num_workers=w, batch_size=b) for f in formats
                       for w in ((workers,) if f == "folder" else (0, workers))
                       for b in (QUICK["batch_sizes"] if quick else BATCH_SIZES)],
        "prefetch_factor": [point(f, prefetch_factor=p) for f in PREFETCH_FORMATS if f in formats
                            for p in (QUICK["prefetch_factors"] if quick else PREFETCH_FACTORS)],
    }
    if cuda:
        sweeps["pin_memory"] = [{**point(f, num_workers=w, pin_memory=pin), "copy_to_gpu": True}
                                for f in ("folder", "hdf5-raw") for w in (0, workers) for pin in (False, True)]
    return sweeps


def _key(point):
    return tuple(sorted(point.items()))


def measure_point(point, setup):
    """Measure one sweep point in this process; return its samples/s and passes."""
    batches = _open_stream(point, setup)
    batch_size = min(point["batch_size"], setup["num_samples"])
    per_pass = max(2, point["num_workers"], math.ceil(MIN_PASS_SAMPLES / batch_size))
    to_gpu = point.get("copy_to_gpu", False)  # the pin_memory sweep copies each batch with non_blocking=True
    try:
        take = partial(_take, batches, per_pass, to_gpu)
        rate = measure_rate(take, setup["repeats"], min_seconds=setup["min_seconds"])
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    label = ", ".join(f"{k}={v}" for k, v in point.items())
    print(f"  {label}: {rate.samples_per_s:,.0f} samples/s", flush=True)
    return {**point, "batch_size_used": batch_size, "batches_per_pass_unit": per_pass, **rate.to_dict()}


def _take(batches, count, to_gpu):
    """Take ``count`` batches from a running iterator, touching each (and copying it to the GPU); return samples."""
    samples = 0
    for _ in range(count):
        images = next(batches)[0]
        if to_gpu:
            images = images.to("cuda", non_blocking=True)
        samples += len(images)
        touch(images)
    if to_gpu:
        import torch

        torch.cuda.synchronize()
    return samples


def _open_stream(point, setup):
    """Return a running iterator of ``(images, labels)`` batches for ``point``."""
    from benchmarks.samplers import StreamBatches

    num_workers, prefetch = point["num_workers"], point["prefetch_factor"]
    sampler = StreamBatches(setup["num_samples"], point["batch_size"], seed=setup["seed"])
    if point["format"] == "folder":
        from torch.utils.data import DataLoader

        from fastdata.measure.baselines import RawFolderDataset

        dataset = RawFolderDataset(setup["paths"], setup["labels"], SIZE)
        options = {"prefetch_factor": prefetch, "persistent_workers": True} if num_workers else {}
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                            pin_memory=point["pin_memory"], **options)
    else:
        from fastdata import make_loader, open_dataset

        loader = make_loader(open_dataset(setup["files"][point["format"]]), batch_sampler=sampler,
                             num_workers=num_workers, prefetch_factor=prefetch, pin_memory=point["pin_memory"])
    return iter(loader)


def summarize(sweeps):
    """Return, per format, the best num_workers and where more workers start to hurt."""
    summary = {}
    for fmt in sorted({p["format"] for p in sweeps.get("num_workers", [])}):
        series = sorted((p["num_workers"], p["samples_per_s"]) for p in sweeps["num_workers"] if p["format"] == fmt)
        best_workers, best = max(series, key=lambda item: item[1])
        enough = next(w for w, rate in series if rate >= HELP_FRACTION * best)
        hurts = next((w for w, rate in series if w > best_workers and rate < HURT_FRACTION * best), None)
        summary[fmt] = {"best_num_workers": best_workers, "best_samples_per_s": best,
                        "stops_helping_from_num_workers": enough, "hurts_from_num_workers": hurts,
                        "rate_at_most_workers": series[-1][1]}
    return summary


def run(config, fresh):
    """Run every sweep; return the points grouped by sweep, a summary and notes."""
    cuda = fresh.run(cuda_device) is not None  # asked in a fresh process: the main one stays light
    root, paths, labels, _ = inputs.photo_folder(config["workdir"], config["num_images"], config["seed"])
    files = inputs.packed_images(config["workdir"], config["num_images"], SIZE, config["seed"])
    setup = {key: config[key] for key in ("repeats", "min_seconds", "seed")}
    setup.update(paths=paths, labels=labels, files=files, num_samples=len(paths), cuda=cuda)
    sweeps, measured = plan(config, cuda), {}
    for points in sweeps.values():
        for point in points:
            if _key(point) not in measured:
                measured[_key(point)] = fresh.run(measure_point, point, setup)
    results = {name: [measured[_key(p)] for p in points] for name, points in sweeps.items()}
    notes = [] if cuda else ["pin_memory: not applicable, no CUDA device (pinned memory only speeds up "
                             "host-to-GPU copies); not measured"]
    return {"size": SIZE, "num_samples": len(paths), "cuda": cuda, "sweeps": results,
            "summary": summarize(results), "notes": notes}
