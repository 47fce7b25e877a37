"""Images section: packing and loading photos with fastdata against the usual ways of feeding PyTorch.

Run through benchmarks/run.py (``--only images``), at each output size of
``--sizes`` (64 and 224), sharing one photo folder. At each size it
1. converts a synthetic ImageFolder of photo-like JPEGs of varied sizes and
   modes (made once, inputs.py) to HDF5 and Arrow, raw and jpeg storage, timed against a plain
   multiprocessing.Pool doing full Pillow decode + Resize + CenterCrop (and,
   for information, the HDF5 raw conversion called from a script that
   imports torch first);
2. measures loading throughput in samples/s (NOTE [whole epochs] in
   fastdata/measure/engine.py, each row in a fresh process, see NOTE [fresh
   process per row] in fresh.py) for a raw-folder Dataset (paths in a numpy
   array, and in a Python list), a tutorial h5py Dataset, fastdata's
   make_loader with defaults and with workers, the memory copy limits and
   the JPEG decode limits (fastdata/measure/limits.py), with the memory of
   each worker process at the end;
3. times make_loader on the jpeg files and the decode limits in turn in one
   process (NOTE [interleaved rates] in fastdata/measure/engine.py): the
   JPEG targets;
4. times full epochs of a make_loader with workers after 100 iterations
   each left after 2 batches, in turn with a fresh one's in one process
   (NOTE [abandoned iterations] in fastdata/loading/workers.py).
"""

import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from functools import partial

from benchmarks import inputs
from benchmarks.rows import measure_row, worker_mb
from fastdata import convert_imagefolder
from fastdata._cpu import usable_cpus
from fastdata.measure.engine import check_count, consume, interleaved_rates
from fastdata.measure.tables import Row, markdown_table

RAW_VS_LIMIT = 0.5  # targets
RAW_VS_FOLDER = 300.0
JPEG_VS_DECODE = 0.9
CONVERT_VS_POOL = 1.5
ABANDONED_VS_FRESH = 0.9
ABANDONED_ITERATIONS = 100  # iterations left early before the full epochs, each after ABANDON_AFTER batches
ABANDON_AFTER = 2
PAIRED_ROUNDS = 7  # rounds of interleaved passes behind the JPEG targets (--quick 2)
SLOW_KINDS = ("folder",)  # rows of a few hundred samples/s: one process is enough (and costs 10-20 s)


def run(config, fresh):
    """Convert and measure at every size of ``config["sizes"]``; return ``{"sizes": {size: results}, ...}``."""

    def runner(fn, *args):  # see NOTE [process to process] in fresh.py
        if fn is not measure_row or args[0].kind in SLOW_KINDS:
            return fresh.run(fn, *args)  # slow rows, and interleaved measurements: one process
        return fresh.run_median(config["process_repeats"], fn, *args)

    results = {}
    for size in config["sizes"]:
        print(f"-- images at {size}x{size}", flush=True)
        results[str(size)] = run_size(config, size, runner)
    return {"sizes": results, "process_repeats": config["process_repeats"]}


def run_size(config, size, runner):
    """Make the images, convert them and measure every row at ``size``; return the results."""
    started = time.perf_counter()
    settings = {"num_images": config["num_images"], "size": size, "batch_size": config["batch_size"],
                "repeats": config["repeats"], "workers": config["workers"],
                "paired_rounds": 2 if config["quick"] else PAIRED_ROUNDS, "min_pass_seconds": config["min_seconds"],
                "seed": config["seed"], "workdir": os.path.join(config["workdir"], "images"), "quick": config["quick"]}
    root, paths, labels, source = inputs.photo_folder(config["workdir"], config["num_images"], config["seed"])
    source.update(root=root, num_images=len(paths), bytes=inputs.read_all(paths))
    print(f"{len(paths)} images ({source['bytes'] / len(paths) / 1e3:.0f} kB each) in {root}; "
          f"{config['repeats']} timed passes after 1 warm-up")
    print("converting ...", flush=True)
    files, conversions = time_conversions(root, paths, config["workdir"], size, config["repeats"])
    print("throughput, each row in a fresh process:", flush=True)
    setup = {"paths": paths, "labels": labels, "files": files, "size": size, "num_samples": len(paths),
             "paired_rounds": settings["paired_rounds"], "min_seconds": config["min_seconds"],
             **{key: config[key] for key in ("batch_size", "workers", "repeats", "seed")}}
    loading = [runner(measure_row, row, setup) for row in rows(config["workers"])]
    jpeg_pairs = runner(measure_jpeg_pairs, setup)
    abandoned = runner(measure_abandoned, setup)
    targets = summarize(loading, conversions, jpeg_pairs, abandoned)
    tables = {"loading": loading_table(loading), "conversion": conversion_table(conversions, len(paths)),
              "jpeg_pairs": jpeg_pairs_text(jpeg_pairs), "abandoned": abandoned_text(abandoned)}
    return {"benchmark": "images", "config": settings, "source": source, "files": files, "conversion": conversions,
            "loading": loading, "jpeg_pairs": jpeg_pairs, "abandoned": abandoned, "targets": targets,
            "tables": tables, "run_seconds": time.perf_counter() - started}


# ---------------------------------------------------------------- conversion


def time_conversions(root, paths, workdir, size, repeats):
    """Time the Pool baseline and the fastdata conversions; return ``(files, results)``.

    Repeats are interleaved (baseline, then each conversion, then again), so
    that drift in machine speed affects every method alike.
    """
    workers = usable_cpus()
    jobs, files = {"pool_baseline": partial(_pool_baseline, paths, size, workers)}, {}
    for fmt, storage, ext in inputs.IMAGE_FILES:
        files[f"{fmt}-{storage}"] = inputs.image_file(workdir, len(paths), size, storage, ext)
        jobs[f"{fmt}-{storage}"] = partial(_convert, root, files[f"{fmt}-{storage}"], size, storage, len(paths))
    torch_first = inputs.image_file(workdir, len(paths), size, "raw-torch-first", ".h5")
    jobs["hdf5-raw-torch-first"] = partial(_convert_after_torch, root, torch_first, size)
    outputs = {**files, "hdf5-raw-torch-first": torch_first}
    times = {key: [] for key in jobs}
    for _ in range(repeats):
        for key, job in jobs.items():
            if os.path.exists(outputs.get(key, "")):
                # Untimed, like the baseline, which writes no file: replacing a 300 MB
                # file costs its deletion (0.22 s at 224x224), not converting.
                os.remove(outputs[key])
            started = time.perf_counter()
            inner = job()  # seconds timed inside a child script, or None
            times[key].append(inner if inner is not None else time.perf_counter() - started)
    baseline = statistics.median(times["pool_baseline"])
    results = {}
    for key, seconds in times.items():
        median = statistics.median(seconds)
        results[key] = {"seconds": median, "all_seconds": seconds, "samples_per_s": len(paths) / median}
        if key == "pool_baseline":
            results[key]["workers"] = workers
        else:
            results[key]["ratio_vs_pool"] = baseline / median
        if key in files:
            results[key].update(path=files[key], file_bytes=os.path.getsize(files[key]))
    return files, results


def _pool_baseline(paths, size, workers):
    from fastdata.measure.baselines import pool_decode

    pool_decode(paths, size, workers)  # the pixels are dropped, as a timed job returns None


def _convert(root, out, size, storage, expected):
    report = convert_imagefolder(root, out, size=size, storage=storage, overwrite=True, progress=False)
    if report.num_samples != expected or report.skipped:
        raise RuntimeError(f"conversion to {out} kept {report.num_samples} of {expected} images")


# NOTE [light main]: where the converter cannot fork (this process runs
# other threads), it starts its workers with forkserver, and each worker
# re-runs the main script's top-level imports as ``__mp_main__`` (seen on
# Python 3.11: the server does not preload ``__main__``). So run.py imports
# torch nowhere at the top; this script, a training script's usual shape,
# imports torch first and then converts.
_TORCH_FIRST_SCRIPT = """\
import sys
import time

import torch  # noqa: F401

from fastdata import convert_imagefolder

if __name__ == "__main__":
    started = time.perf_counter()
    convert_imagefolder(sys.argv[1], sys.argv[2], size=int(sys.argv[3]), overwrite=True, progress=False)
    print(time.perf_counter() - started)
"""


def _convert_after_torch(root, out, size):
    """Convert from a script that imports torch first; return the seconds of the conversion call."""
    script = os.path.join(os.path.dirname(out), "convert_after_torch.py")
    with open(script, "w") as f:
        f.write(_TORCH_FIRST_SCRIPT)
    done = subprocess.run([sys.executable, script, root, out, str(size)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{done.stderr}")
    return float(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- throughput rows


def rows(workers):
    """Return the Row of every throughput row (see NOTE [fresh process per row] in fresh.py)."""
    folder = "raw folder Dataset: Pillow decode+resize+crop, default collate"
    persistent = f"{workers} (persistent)"
    found = [
        Row("folder", folder, "0", _folder_epochs, {"num_workers": 0}, "folder", memory=True),
        Row("folder_workers", folder, persistent, _folder_epochs, {"num_workers": workers}, "folder", memory=True),
        # (b) the same with a Python list of paths: workers touch each path's refcount.
        Row("folder_list_workers", folder.replace("Dataset:", "Dataset, Python list of paths:"), persistent,
            _folder_epochs, {"num_workers": workers, "as_list": True}, "folder", memory=True),
        Row("tutorial_h5py", "tutorial h5py Dataset: dset[i] per item, default collate", "0", _tutorial_epochs, {},
            "tutorial", memory=True),
    ]
    for fmt, storage, _ in inputs.IMAGE_FILES:
        method, key = f"fastdata {'HDF5' if fmt == 'hdf5' else 'Arrow'} {storage}: make_loader", f"{fmt}-{storage}"
        found += [Row(key, method, "0 (defaults)", _fastdata_epochs, {"key": key, "num_workers": 0}, "fastdata",
                      memory=True),
                  Row(f"{key}_workers", method, persistent, _fastdata_epochs, {"key": key, "num_workers": workers},
                      "fastdata", memory=True)]
    copy, decode = "memcpy: np.take from memmap into", "JPEG decode tight loop: decode_jpeg (as the loader) on"
    for key, method, mode in (("copy_prealloc", f"{copy} preallocated array, mode='clip'", "clip"),
                              ("copy_fresh", f"{copy} a fresh array (previous batch alive)", None),
                              ("copy_prealloc_raise", f"{copy} preallocated array, mode='raise'", "raise")):
        found.append(Row(key, method, "1 thread", _copy_epochs, {"mode": mode}, "copy", memory=True, limit=True))
    for key, label, processes in (("decode_threads", "threads", False), ("decode_processes", "procs", True)):
        found.append(Row(key, f"{decode} {'processes' if processes else 'threads'}", f"{workers} {label}",
                         _decode_epochs, {"processes": processes}, "decode", memory=True, limit=True))
    return found


def measure_jpeg_pairs(setup):
    """Time make_loader on both jpeg files and the two decode loops in turn (see NOTE [interleaved rates]).

    Returns ``{"rates": name -> per-round rates, "ratios": fmt -> per-round
    loader / best decode loop, "ratio": fmt -> median}``.
    """
    print("  jpeg: make_loader and the decode loops in turn ...", end="", flush=True)
    with ExitStack() as stack:
        runs = {f"{fmt}-jpeg": stack.enter_context(_fastdata_epochs(setup, f"{fmt}-jpeg", 0))
                for fmt in ("hdf5", "arrow")}
        runs.update(decode_threads=stack.enter_context(_decode_epochs(setup, processes=False)),
                    decode_processes=stack.enter_context(_decode_epochs(setup, processes=True)))
        rates = interleaved_rates(runs, setup["paired_rounds"], setup["min_seconds"])
    best_decode = [max(pair) for pair in zip(rates["decode_threads"], rates["decode_processes"])]
    ratios = {fmt: [rate / limit for rate, limit in zip(rates[f"{fmt}-jpeg"], best_decode)]
              for fmt in ("hdf5", "arrow")}
    medians = {fmt: statistics.median(values) for fmt, values in ratios.items()}
    print(" " + ", ".join(f"{fmt} {ratio:.3f}x" for fmt, ratio in medians.items()), flush=True)
    return {"rounds": setup["paired_rounds"], "rates": rates, "ratios": ratios, "ratio": medians}


def measure_abandoned(setup):
    """Time full epochs of a make_loader with workers after iterations left early, in turn with a fresh loader's.

    Two loaders over the converted HDF5 raw file, ``setup["workers"]``
    persistent workers each: one is iterated ABANDONED_ITERATIONS times,
    each loop left after ABANDON_AFTER batches (NOTE [abandoned iterations]
    in fastdata/loading/workers.py), then the first full epoch of each is
    timed (the worker start included, for both) and their epochs in turn
    (see NOTE [interleaved rates]). The batch is at most a quarter of the
    file, so that a loop has batches left to abandon.

    Returns ``{"rates": {"fresh", "after"} -> per-round samples/s, "ratios"
    per round, "ratio": median, "first_epoch": samples/s of each, ...}``.
    """
    from fastdata import make_loader, open_dataset

    count = setup["num_samples"]
    batch = min(setup["batch_size"], max(1, count // (2 * ABANDON_AFTER)))
    print(f"  make_loader after {ABANDONED_ITERATIONS} iterations left after {ABANDON_AFTER} batches, and a fresh "
          "one, in turn ...", end="", flush=True)
    loaders = {name: make_loader(open_dataset(setup["files"]["hdf5-raw"]), batch, shuffle=True,
                                 num_workers=setup["workers"]) for name in ("fresh", "after")}
    try:
        started = time.perf_counter()
        for _ in range(ABANDONED_ITERATIONS):
            for step, _batch in enumerate(loaders["after"], 1):
                if step == ABANDON_AFTER:
                    break
        abandoning = (time.perf_counter() - started) / ABANDONED_ITERATIONS
        first = {name: _epoch_rate(loader, count) for name, loader in loaders.items()}
        runs = {name: partial(consume, loader) for name, loader in loaders.items()}
        rates = interleaved_rates(runs, setup["paired_rounds"], setup["min_seconds"])
    finally:
        for loader in loaders.values():
            loader.close()
    ratios = [after / fresh for after, fresh in zip(rates["after"], rates["fresh"])]
    ratio = statistics.median(ratios)
    print(f" {ratio:.3f}x", flush=True)
    return {"iterations": ABANDONED_ITERATIONS, "left_after": ABANDON_AFTER, "batch_size": batch,
            "num_workers": setup["workers"], "seconds_per_left_iteration": abandoning, "first_epoch": first,
            "rounds": setup["paired_rounds"], "rates": rates, "ratios": ratios, "ratio": ratio}


def _epoch_rate(loader, expected):
    """Time one epoch of ``loader``; return its samples/s (the epoch must cover ``expected`` samples)."""
    began = time.perf_counter()
    check_count(consume(loader), expected)
    return expected / (time.perf_counter() - began)


@contextmanager
def _folder_epochs(setup, num_workers, as_list=False):
    from torch.utils.data import DataLoader

    from fastdata.measure.baselines import RawFolderDataset, RawFolderListDataset

    cls = RawFolderListDataset if as_list else RawFolderDataset
    dataset = cls(setup["paths"], setup["labels"], setup["size"])
    yield partial(consume, DataLoader(dataset, setup["batch_size"], shuffle=True, num_workers=num_workers,
                                      persistent_workers=num_workers > 0))


@contextmanager
def _tutorial_epochs(setup):
    from torch.utils.data import DataLoader

    from fastdata.measure.baselines import TutorialH5Dataset

    dataset = TutorialH5Dataset(setup["files"]["hdf5-raw"])
    try:
        yield partial(consume, DataLoader(dataset, setup["batch_size"], shuffle=True))
    finally:
        dataset.close()


@contextmanager
def _fastdata_epochs(setup, key, num_workers):
    from fastdata import make_loader, open_dataset

    dataset = open_dataset(setup["files"][key])
    options = {"num_workers": num_workers} if num_workers else {}  # defaults unless forced
    yield partial(consume, make_loader(dataset, setup["batch_size"], shuffle=True, **options))


@contextmanager
def _copy_epochs(setup, mode, threads=1):
    """Epochs of np.take of shuffled, sorted batches from a memmap of the raw pixels (no loader)."""
    from fastdata.formats import read_packed
    from fastdata.measure.limits import copy_epochs

    columns, _ = read_packed(setup["files"]["hdf5-raw"])
    yield copy_epochs(columns.samples, setup["batch_size"], mode=mode, seed=setup["seed"], threads=threads)


@contextmanager
def _decode_epochs(setup, processes):
    """Epochs decoding every stored JPEG of the jpeg HDF5 file, on ``workers`` threads or processes."""
    from fastdata.formats import read_packed
    from fastdata.measure.limits import DecodeEpochs

    columns, _ = read_packed(setup["files"]["hdf5-jpeg"])
    with DecodeEpochs(columns, setup["workers"], processes=processes) as run_epoch:
        yield run_epoch


# ---------------------------------------------------------------- report


def summarize(rows, conversions, jpeg_pairs, abandoned):
    """Add fractions and ratios to ``rows``; return the target checks.

    The JPEG targets use the interleaved measurement (see NOTE [interleaved
    rates]); the separate rows are shown in the table.
    """
    by_key = {row["key"]: row for row in rows}
    # The limit is the faster of the two direct copies (not the mode="raise" one).
    limit_row = max((by_key["copy_prealloc"], by_key["copy_fresh"]), key=lambda row: row["samples_per_s"])
    limit, folder = limit_row["samples_per_s"], by_key["folder"]["samples_per_s"]
    limit_row["is_limit"] = True
    for row in rows:
        row["fraction_of_limit"] = row["samples_per_s"] / limit
        row["ratio_vs_folder"] = row["samples_per_s"] / folder
    targets = []
    for fmt in ("hdf5", "arrow"):
        rate = by_key[f"{fmt}-raw"]["samples_per_s"]
        targets.append(_target(f"{fmt} raw, defaults vs memcpy limit", rate / limit, RAW_VS_LIMIT))
        targets.append(_target(f"{fmt} raw, defaults vs raw folder (0 workers)", rate / folder, RAW_VS_FOLDER))
    for fmt in ("hdf5", "arrow"):
        name = f"{fmt} jpeg, defaults vs tight-loop decode (best of threads/processes), interleaved in one process"
        targets.append(_target(name, jpeg_pairs["ratio"][fmt], JPEG_VS_DECODE))
    for fmt, storage, _ in inputs.IMAGE_FILES:
        ratio = conversions[f"{fmt}-{storage}"]["ratio_vs_pool"]
        targets.append(_target(f"{fmt} {storage} conversion vs plain Pool decode+resize", ratio, CONVERT_VS_POOL))
    targets.append(summarize_abandoned(abandoned))
    return targets


def summarize_abandoned(abandoned):
    """Return the target of measure_abandoned's result: epochs after iterations left early vs a fresh loader's."""
    name = (f"hdf5 raw, {abandoned['num_workers']} workers: full epochs after {abandoned['iterations']} iterations "
            f"left after {abandoned['left_after']} batches vs a fresh loader, interleaved")
    after, fresh = (statistics.median(abandoned["rates"][key]) for key in ("after", "fresh"))
    first = abandoned["first_epoch"]
    return {**_target(name, abandoned["ratio"], ABANDONED_VS_FRESH),
            "info": f"{after:,.0f} vs {fresh:,.0f} samples/s; first epoch {first['after']:,.0f} vs "
                    f"{first['fresh']:,.0f}"}


def _target(name, value, threshold):
    passed, margin = value >= threshold, value / threshold
    return {"name": name, "value": value, "threshold": threshold, "pass": passed, "margin": margin}


def loading_table(rows):
    body = []
    for row in rows:
        method = row["method"] + (" = LIMIT" if row.get("is_limit") else "")
        rate, fraction, ratio = row["samples_per_s"], row["fraction_of_limit"], row["ratio_vs_folder"]
        body.append((method, row["workers"], f"{rate:,.0f}", f"{fraction:.3g}", f"{ratio:,.1f}x", worker_mb(row)))
    headers = ["method", "workers", "samples/s", "fraction of memcpy limit", "vs raw folder (0 workers)",
               "per-worker MB: USS (private dirty)"]
    return markdown_table(headers, body, "llrrrr")


def jpeg_pairs_text(pairs):
    """One paragraph on the interleaved JPEG measurement behind the JPEG targets."""
    rates = ", ".join(f"{name} {statistics.median(values):,.0f}" for name, values in pairs["rates"].items())
    ratios = "; ".join(f"{fmt} " + " ".join(f"{r:.2f}" for r in values) for fmt, values in pairs["ratios"].items())
    return (f"JPEG targets: make_loader (defaults) and the two decode loops timed in turn in one process, "
            f"{pairs['rounds']} rounds (see NOTE [interleaved rates] in fastdata/measure/engine.py). Median "
            f"samples/s: {rates}. Ratio to the faster decode loop, per round: {ratios}.")


def abandoned_text(abandoned):
    """One paragraph on the epochs after iterations left early, behind their target."""
    rates = ", ".join(f"{name} {statistics.median(values):,.0f}" for name, values in abandoned["rates"].items())
    first = ", ".join(f"{name} {rate:,.0f}" for name, rate in abandoned["first_epoch"].items())
    return (f"Iterations left early: make_loader (HDF5 raw, batch {abandoned['batch_size']}, "
            f"{abandoned['num_workers']} persistent workers) iterated {abandoned['iterations']} times, each loop left "
            f"after {abandoned['left_after']} batches ({abandoned['seconds_per_left_iteration'] * 1e3:,.0f} ms each: "
            f"its workers stopped, new ones started), then full epochs, timed in turn with a fresh loader's, "
            f"{abandoned['rounds']} rounds (NOTE [abandoned iterations] in fastdata/loading/workers.py). Median "
            f"samples/s: {rates}; per-round ratio after / fresh: "
            + " ".join(f"{ratio:.2f}" for ratio in abandoned["ratios"])
            + f". First full epoch, worker start included: {first}.")


def conversion_table(conversions, count):
    body = []
    for key, entry in conversions.items():
        name = f"fastdata convert_imagefolder -> {key}"
        if key == "pool_baseline":
            name = "plain multiprocessing.Pool: Pillow full decode + Resize + CenterCrop"
        elif key == "hdf5-raw-torch-first":
            name = "fastdata convert_imagefolder -> hdf5-raw, from a script that imports torch first"
        ratio = f"{entry['ratio_vs_pool']:.2f}x" if "ratio_vs_pool" in entry else "1.00x"
        body.append((name, f"{entry['seconds']:.2f}", f"{count / entry['seconds']:,.0f}", ratio))
    return markdown_table(["conversion", "seconds (median)", "images/s", "speed vs Pool"], body, "lrrr")
