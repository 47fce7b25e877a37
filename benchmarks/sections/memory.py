"""Memory section: how much each DataLoader worker grows over one epoch of a million samples.

Run through benchmarks/run.py (``--only memory``). Five datasets of the
same N samples (default 1,000,000), each read for one shuffled epoch with
batch 256 and 2 persistent workers, under fork and under spawn, each in a
fresh process:

* Python list of str: one distinct path string per sample (the paths are
  made up; items are ``(len(path), label)`` and no file is read, so the
  pass costs what holding per-sample objects costs, not decoding);
* Python list of dicts ``{"path": str, "label": int}``;
* numpy arrays: the same paths in one fixed-width str array, int64 labels;
* packed HDF5 and Arrow files through ``make_loader(num_workers=2)``: the
  2,000 (--quick 200) 32x32 photo-like JPEGs converted raw at 8x8 (192
  bytes each) by fastdata, their rows repeated to N samples (a million
  32x32 images would be 3 GB).

Each worker's memory is read from /proc/PID/smaps_rollup once every worker
has delivered a batch (the start), about 20 times during the epoch, and at
the end. See NOTE [worker memory] in fastdata/measure/memory.py for USS versus private
dirty: the bar uses private dirty growth (copied or new pages); USS growth
also counts the file pages a worker mapped while reading, which are the
page cache.
"""

import statistics
import time

from benchmarks import inputs
from fastdata.measure.memory import child_pids, process_memory, worker_pids
from fastdata.measure.tables import markdown_table

DATASETS = ("list_of_str", "list_of_dicts", "numpy_arrays", "hdf5_packed", "arrow_packed")
QUICK_DATASETS = ("list_of_dicts", "numpy_arrays", "hdf5_packed")  # --quick: one of each kind
START_METHODS = ("fork", "spawn")
NUM_WORKERS = 2
READINGS = 20
PACKED_SIZE = 8
GROWTH_MAX = 2e6  # target: packed datasets grow each worker by under 2 MB
DESCRIPTIONS = {
    "list_of_str": "Python list of str (one path per sample)",
    "list_of_dicts": "Python list of dicts {path, label}",
    "numpy_arrays": "numpy arrays (fixed-width str paths, int64 labels)",
    "hdf5_packed": f"fastdata HDF5 raw {PACKED_SIZE}x{PACKED_SIZE}, make_loader",
    "arrow_packed": f"fastdata Arrow raw {PACKED_SIZE}x{PACKED_SIZE}, make_loader",
}


def measure(spec, setup):
    """Read one epoch of one dataset under one start method in this process; return the memory readings."""
    name, method = spec
    print(f"  {DESCRIPTIONS[name]} [{method}] ...", end="", flush=True)
    started = time.perf_counter()
    loader = _make_loader(name, method, setup)
    built = time.perf_counter() - started
    readings, start, count, every = [], None, 0, max(1, len(loader) // READINGS)
    pids = None
    for index, batch in enumerate(loader):
        count += len(batch[0])
        if index == NUM_WORKERS - 1:  # every worker has delivered a batch: its start-up is over
            pids = worker_pids(loader) or child_pids()
            start = _readings(pids)
        elif pids and (index + 1) % every == 0:
            readings.append({"fraction": (index + 1) / len(loader), "workers": _readings(pids)})
    end = _readings(pids)
    seconds = time.perf_counter() - started - built
    if count != setup["num_samples"] or len(start) != NUM_WORKERS or len(end) != NUM_WORKERS:
        raise RuntimeError(f"{name}/{method}: {count} samples, {len(end)} workers; the benchmark is wrong")
    workers = [_worker_entry(a, b) for a, b in zip(start, end)]
    print(f" private dirty growth {max(w['growth']['private_dirty'] for w in workers) / 1e6:,.1f} MB", flush=True)
    return {"dataset": name, "method": DESCRIPTIONS[name], "start_method": method, "num_samples": count,
            "num_workers": NUM_WORKERS, "build_seconds": built, "epoch_seconds": seconds, "workers": workers,
            "readings": readings}


def _readings(pids):
    """Return the memory of each process of ``pids`` still running (see NOTE [worker memory])."""
    return [reading for reading in map(process_memory, pids) if reading is not None]


def _worker_entry(start, end):
    growth = {key: end[key] - start[key] for key in ("uss", "pss", "private_dirty", "rss") if key in end}
    return {"start": start, "end": end, "growth": growth}


def _make_loader(name, method, setup):
    n, batch_size = setup["num_samples"], setup["batch_size"]
    if name.endswith("_packed"):
        from fastdata import make_loader, open_dataset

        dataset = open_dataset(setup["files"][name.split("_")[0]])
        return make_loader(dataset, batch_size, shuffle=True, num_workers=NUM_WORKERS, multiprocessing_context=method)
    import numpy as np
    from torch.utils.data import DataLoader

    from fastdata.measure import baselines

    prefix = setup["path_prefix"]
    paths = [f"{prefix}/class_{i % 10}/img_{i:07d}.jpg" for i in range(n)]  # n distinct str objects
    labels = np.arange(n, dtype=np.int64) % 10
    cls = {"list_of_str": baselines.PathListDataset, "list_of_dicts": baselines.RecordListDataset,
           "numpy_arrays": baselines.PathArrayDataset}[name]
    dataset = cls(paths, labels)
    del paths
    return DataLoader(dataset, batch_size, shuffle=True, num_workers=NUM_WORKERS, persistent_workers=True,
                      multiprocessing_context=method)


def summarize(rows):
    """Return the targets: packed datasets under 2 MB per worker; list baselines show growth under fork."""
    targets = []
    for row in rows:
        growth = max(w["growth"]["private_dirty"] for w in row["workers"])
        file_pages = max(w["end"].get("pss_file", 0) for w in row["workers"])
        where = f"{row['num_samples']:,} samples, {row['start_method']}"
        if row["dataset"].endswith("_packed"):
            targets.append({"name": f"memory: {row['method']}, worker growth over an epoch ({where})",
                            "value": growth / 1e6, "threshold": GROWTH_MAX / 1e6, "at_least": False, "unit": "MB",
                            "info": f"private dirty growth, the largest worker; file pages mapped at the end: "
                                    f"{file_pages / 1e6:,.0f} MB of PSS (page cache, see NOTE [worker memory])"})
        elif row["dataset"].startswith("list") and row["start_method"] == "fork":
            targets.append({"name": f"memory check: {row['method']} shows its growth ({where})",
                            "value": growth / 1e6, "threshold": GROWTH_MAX / 1e6, "at_least": True, "unit": "MB",
                            "info": "the baseline must grow past the bar for the measurement to mean anything"})
    return targets


def table(rows):
    body = []
    for row in rows:
        workers = row["workers"]

        def mean(part, key, workers=workers):
            return statistics.mean(w[part][key] for w in workers) / 1e6

        body.append((row["method"], row["start_method"], f"{mean('start', 'uss'):,.1f}",
                     f"{mean('growth', 'private_dirty'):,.1f}", f"{mean('growth', 'uss'):,.1f}",
                     f"{mean('growth', 'pss'):,.1f}", f"{mean('end', 'pss_file'):,.1f}", f"{row['epoch_seconds']:.1f}"))
    headers = ["dataset", "start method", "worker USS at start MB", "private dirty growth MB", "USS growth MB",
               "PSS growth MB", "file pages at end (PSS_File) MB", "epoch s"]
    return markdown_table(headers, body, "llrrrrrr")


def run(config, fresh):
    """Run the memory section; return rows, targets and table."""
    n = config["memory_samples"]
    files = inputs.repeated_tiny(config["workdir"], config["tiny_images"], config["seed"], PACKED_SIZE, n)
    prefix = inputs.tiny_folder(config["workdir"], config["tiny_images"], config["seed"])
    setup = {"num_samples": n, "batch_size": config["batch_size"], "files": files, "path_prefix": prefix}
    datasets = QUICK_DATASETS if config["quick"] else DATASETS
    rows = [fresh.run(measure, (name, method), setup) for method in START_METHODS for name in datasets]
    return {"num_samples": n, "num_workers": NUM_WORKERS, "bar_mb": GROWTH_MAX / 1e6,
            "packed_sample": f"uint8 [3, {PACKED_SIZE}, {PACKED_SIZE}]",
            "files": files, "rows": rows, "targets": summarize(rows), "table": table(rows)}
