"""Cold cache section: first-epoch throughput with the files' pages dropped from the page cache.

Run through benchmarks/run.py (``--only coldcache``), at the largest image
size of the run (224 by default: the raw files are the largest). Before
each cold pass the row's files (the packed file, or every JPEG of the
folder) are evicted with ``posix_fadvise(DONTNEED)`` after an fsync, or
else through /proc/sys/vm/drop_caches, and mincore checks that they left
the page cache; where nothing works the rows say that their "cold" figures
are warm. A cold pass opens the dataset, builds the loader and reads one
shuffled epoch; the same loader then reads a warm epoch. Figures are
medians over --repeats cold/warm pairs, each row in a fresh process.
"""

import gc
import os
import statistics
import time

from benchmarks import inputs
from benchmarks.machine import drop_from_page_cache
from fastdata.measure.engine import consume
from fastdata.measure.tables import markdown_table


def row_specs(config):
    """Return ``(key, method, kind, option)`` rows: the packed files and the raw folder, at the largest size."""
    size = max(config["sizes"])
    files = inputs.packed_images(config["workdir"], config["num_images"], size, config["seed"])
    specs = [(f"{key} {size}px", f"fastdata {key}: make_loader defaults", "packed", path)
             for key, path in files.items()]
    specs.append((f"folder {size}px", "raw folder Dataset: Pillow decode+resize+crop, 0 workers", "folder", size))
    return specs


def measure(spec, setup):
    """Time cold and warm epochs of one row in this process; return its dict."""
    key, method, kind, option = spec
    evict = [option] if kind == "packed" else setup["paths"]
    cold, warm, drops = [], [], []
    for _ in range(setup["repeats"]):
        gc.collect()  # the previous pass's memory maps must be gone: mapped pages cannot be dropped
        drops.append(drop_from_page_cache(evict))
        cold_rate, warm_rate = _cold_then_warm(key, kind, option, setup)
        cold.append(cold_rate)
        warm.append(warm_rate)
    cold_rate, warm_rate = statistics.median(cold), statistics.median(warm)
    size, count = sum(os.path.getsize(path) for path in evict), setup["num_samples"]
    print(f"  {method} [{key}]: cold {cold_rate:,.0f}, warm {warm_rate:,.0f} samples/s", flush=True)
    return {"key": key, "method": method, "bytes": size, "cold_samples_per_s": cold_rate, "cold_rates": cold,
            "warm_samples_per_s": warm_rate, "warm_rates": warm, "cold_vs_warm": cold_rate / warm_rate,
            "cold_mb_per_s": size / (count / cold_rate) / 1e6, "drops": drops,
            "cold": all(drop["method"] is not None for drop in drops)}


def _cold_then_warm(key, kind, option, setup):
    """Open the dataset, read a (cold) epoch and a warm one; return both rates. Nothing stays mapped."""
    started = time.perf_counter()
    loader = _make_loader(kind, option, setup)
    count = consume(loader)
    cold = count / (time.perf_counter() - started)
    started = time.perf_counter()
    if consume(loader) != count or count != setup["num_samples"]:
        raise RuntimeError(f"{key}: an epoch gave {count} samples, expected {setup['num_samples']}")
    return cold, count / (time.perf_counter() - started)


def _make_loader(kind, option, setup):
    if kind == "packed":
        from fastdata import make_loader, open_dataset

        return make_loader(open_dataset(option), setup["batch_size"], shuffle=True)
    from torch.utils.data import DataLoader

    from fastdata.measure.baselines import RawFolderDataset

    dataset = RawFolderDataset(setup["paths"], setup["labels"], option)
    return DataLoader(dataset, setup["batch_size"], shuffle=True)


def table(rows):
    body = []
    for row in rows:
        note = "" if row["cold"] else "NOT cold: pages could not be dropped"
        body.append((row["method"], row["key"], f"{row['bytes'] / 1e6:,.0f}", f"{row['cold_samples_per_s']:,.0f}",
                     f"{row['warm_samples_per_s']:,.0f}", f"{row['cold_vs_warm']:.2f}",
                     f"{row['cold_mb_per_s']:,.0f}", note))
    headers = ["method", "file", "MB read", "first epoch, cold (samples/s)", "warm epoch (samples/s)", "cold / warm",
               "cold MB/s", "note"]
    return markdown_table(headers, body, "llrrrrrl")


def run(config, fresh):
    """Run the cold-cache section; return rows, how pages were dropped, and table."""
    _, paths, labels, _ = inputs.photo_folder(config["workdir"], config["num_images"], config["seed"])
    setup = {"paths": paths, "labels": labels, "num_samples": len(paths), "batch_size": config["batch_size"],
             "repeats": config["repeats"]}
    rows = [fresh.run(measure, spec, setup) for spec in row_specs(config)]
    methods = sorted({str(drop["method"]) for row in rows for drop in row["drops"]})
    notes = sorted({note for row in rows for drop in row["drops"] for note in drop["notes"]})
    return {"size": max(config["sizes"]), "drop_methods": methods, "notes": notes, "rows": rows,
            "table": table(rows)}
