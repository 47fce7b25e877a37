"""Benchmark image packing and loading: fastdata against the usual ways of feeding PyTorch.

Run from the repository root:

    python benchmarks/images.py            # 2,000 images; ~70 s on 2 cores (+20 s to make the images once)
    python benchmarks/images.py --quick    # 200 images, 1 pass; a smoke test under a minute

benchmarks/run.py runs this at output sizes 64 and 224 (through ``run``)
together with the text, memory, sweep, other-tool and cold-cache sections.

In one run it
1. writes a synthetic ImageFolder of photo-like 500x375 JPEGs into
   --workdir (reused by later runs with the same parameters);
2. converts it to HDF5 and Arrow, raw and jpeg storage, timed against a plain
   multiprocessing.Pool doing full Pillow decode + Resize + CenterCrop (and,
   for information, the HDF5 raw conversion called from a script that imports
   torch first);
3. measures loading throughput in samples/s (median of --repeats timed
   passes after one warm-up epoch, each row in a fresh process) for a
   raw-folder Dataset (paths in a numpy array, and in a Python list), a
   tutorial h5py Dataset, fastdata's make_loader with defaults and with
   workers, a memory copy limit and a JPEG decode limit, with the memory of
   each worker process at the end (see NOTE [worker memory] in _system.py);
4. prints Markdown tables and PASS/FAIL for each target, and writes every
   number with a machine description to --out (JSON).

NOTE [light main]: where the converter cannot fork (this process runs
other threads), it starts its workers with forkserver, and each worker
re-runs this file's top-level imports as ``__mp_main__`` (seen on Python
3.11: the server does not preload ``__main__``). So torch is imported only
where a row needs it; the "imports torch first" row measures a conversion
called from a script that imports torch at the top.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial

import _baselines
import h5py
import numpy as np
from _system import WorkerMemoryProbe
from _timing import (
    busy_percent,
    interleaved_rates,
    machine_info,
    markdown_table,
    measure_rate,
    run_isolated,
    wait_until_quiet,
)

from fastdata import convert_imagefolder
from fastdata._cpu import usable_cpus
from fastdata.measure.synthetic import make_imagefolder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
PHOTO_SIZE = (500, 375)  # width, height of the synthetic source photos
PHOTO_QUALITY = 90
FILES = (("hdf5", "raw", ".h5"), ("hdf5", "jpeg", ".h5"), ("arrow", "raw", ".arrow"), ("arrow", "jpeg", ".arrow"))
RAW_VS_LIMIT = 0.5  # targets
RAW_VS_FOLDER = 300.0
JPEG_VS_DECODE = 0.9
CONVERT_VS_POOL = 1.5


def parse_args(argv=None):
    """Parse the command line; --quick changes the defaults only."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-images", type=int, help="images in the synthetic folder (default 2000; --quick 200)")
    parser.add_argument("--size", type=int, default=64, help="stored image side in pixels (default 64)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per batch (default 256)")
    parser.add_argument("--repeats", type=int, help="timed passes per figure, after one warm-up (default 3; --quick 1)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the 'workers' rows (default 2)")
    parser.add_argument("--paired-rounds", type=int,
                        help="rounds of interleaved passes behind the JPEG targets (default 7; --quick 2)")
    parser.add_argument(
        "--min-pass-seconds", type=float, help="repeat epochs until a pass lasts this long (default 0.25; --quick 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic images and the shuffles")
    parser.add_argument("--out", help="JSON results file (default benchmarks/results/images.json; --quick: in tmp/)")
    parser.add_argument(
        "--workdir", default=os.path.join(RESULTS, "tmp", "images"), help="cache for images and packed files"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 200 images, 1 pass")
    parser.add_argument(
        "--wait-quiet", type=float, default=0, help="first wait up to this many seconds for other processes to go idle"
    )
    args = parser.parse_args(argv)
    quick = {"num_images": 200, "repeats": 1, "paired_rounds": 2, "min_pass_seconds": 0.05}
    default = {"num_images": 2000, "repeats": 3, "paired_rounds": 7, "min_pass_seconds": 0.25}
    for name, value in (quick if args.quick else default).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = os.path.join(RESULTS, *(("tmp", "images-quick.json") if args.quick else ("images.json",)))
    for name in ("num_images", "size", "batch_size", "repeats", "paired_rounds", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, got {getattr(args, name)}")
    return args


# ---------------------------------------------------------------- source images


def prepare_imagefolder(workdir, num_images, seed):
    """Return ``(root, info)`` of a synthetic ImageFolder, generated unless cached in ``workdir``."""
    num_classes = min(10, max(4, num_images // 250))
    per_class = max(1, round(num_images / num_classes))
    params = {
        "generator": "fastdata.measure.synthetic.make_imagefolder",
        "num_classes": num_classes,
        "per_class": per_class,
        "size": list(PHOTO_SIZE),
        "quality": PHOTO_QUALITY,
        "seed": seed,
    }
    root = os.path.join(workdir, f"imagefolder-{num_classes}x{per_class}-seed{seed}")
    marker = os.path.join(root, ".params.json")  # written last: its presence means complete
    if _read_json(marker) == params and len(list_images(root)[0]) == num_classes * per_class:
        return root, {**params, "cached": True, "generate_seconds": None}
    shutil.rmtree(root, ignore_errors=True)
    print(f"generating {num_classes * per_class} images in {root} (cached for later runs) ...", flush=True)
    started = time.perf_counter()
    make_imagefolder(root, num_classes, per_class, PHOTO_SIZE, seed, PHOTO_QUALITY)
    seconds = time.perf_counter() - started
    with open(marker, "w") as f:
        json.dump(params, f)
    return root, {**params, "cached": False, "generate_seconds": seconds}


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def list_images(root):
    """Return ``(paths, labels int64 [N])``: sorted class folders, sorted files."""
    if not os.path.isdir(root):
        return [], np.empty(0, np.int64)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(root, name)) if f.endswith(".jpg"))
        paths += [os.path.join(root, name, f) for f in files]
        labels += [label] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def read_all(paths):
    """Read every file once so that all methods start from a warm page cache; return bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


# ---------------------------------------------------------------- conversion


def time_conversions(root, paths, workdir, size, repeats):
    """Time the Pool baseline and the fastdata conversions; return ``(files, results)``.

    Repeats are interleaved (baseline, then each conversion, then again), so
    that drift in machine speed affects every method alike.
    """
    workers = usable_cpus()
    jobs, files = {"pool_baseline": partial(_pool_baseline, paths, size, workers)}, {}
    for fmt, storage, ext in FILES:
        files[f"{fmt}-{storage}"] = os.path.join(workdir, f"{len(paths)}-images-{size}px-{storage}{ext}")
        jobs[f"{fmt}-{storage}"] = partial(_convert, root, files[f"{fmt}-{storage}"], size, storage, len(paths))
    torch_first = os.path.join(workdir, f"{len(paths)}-images-{size}px-raw-torch-first.h5")
    jobs["hdf5-raw-torch-first"] = partial(_convert_after_torch, root, torch_first, size, workdir)
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
    _baselines.pool_decode(paths, size, workers)  # the pixels are dropped, as a timed job returns None


def _convert(root, out, size, storage, expected):
    report = convert_imagefolder(root, out, size=size, storage=storage, overwrite=True, progress=False)
    if report.num_samples != expected or report.skipped:
        raise RuntimeError(f"conversion to {out} kept {report.num_samples} of {expected} images")


# A training script's usual shape: torch first, then the conversion. Its
# converter workers re-run this file's imports (forkserver re-imports __main__).
_TORCH_FIRST_SCRIPT = """\
import sys
import time

import torch  # noqa: F401

from fastdata import convert_imagefolder
from fastdata._cpu import usable_cpus

if __name__ == "__main__":
    started = time.perf_counter()
    convert_imagefolder(sys.argv[1], sys.argv[2], size=int(sys.argv[3]), overwrite=True, progress=False)
    print(time.perf_counter() - started)
"""


def _convert_after_torch(root, out, size, workdir):
    """Convert from a script that imports torch first; return the seconds of the conversion call."""
    script = os.path.join(workdir, "convert_after_torch.py")
    with open(script, "w") as f:
        f.write(_TORCH_FIRST_SCRIPT)
    done = subprocess.run([sys.executable, script, root, out, str(size)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{done.stderr}")
    return float(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- throughput rows

# NOTE [fresh process per row]: every row is measured in a newly spawned
# process, as a training script would run it. Fresh batch arrays of a few MB
# are served by glibc malloc either from reused heap memory or from new pages
# (a minor page fault per 4 KB), depending on what the process allocated and
# freed before; in one process shared by all rows, a row's rate depended on
# the rows run before it.


def row_specs(workers):
    """Return ``(key, method, workers label, kind, options)`` for every throughput row."""
    folder = "raw folder Dataset: Pillow decode+resize+crop, default collate"
    specs = [
        ("folder", folder, "0", "folder", {"num_workers": 0}),
        ("folder_workers", folder, f"{workers} (persistent)", "folder", {"num_workers": workers}),
        # (b) the same with a Python list of paths: workers touch each path's refcount.
        ("folder_list_workers", folder.replace("Dataset:", "Dataset, Python list of paths:"),
         f"{workers} (persistent)", "folder", {"num_workers": workers, "as_list": True}),
        ("tutorial_h5py", "tutorial h5py Dataset: dset[i] per item, default collate", "0", "tutorial", {}),
    ]
    for fmt, storage, _ in FILES:
        method = f"fastdata {'HDF5' if fmt == 'hdf5' else 'Arrow'} {storage}: make_loader"
        options = {"key": f"{fmt}-{storage}"}
        specs.append((f"{fmt}-{storage}", method, "0 (defaults)", "fastdata", {**options, "num_workers": 0}))
        forced = {**options, "num_workers": workers}
        specs.append((f"{fmt}-{storage}_workers", method, f"{workers} (persistent)", "fastdata", forced))
    copy, decode = "memcpy: np.take from memmap into", "JPEG decode tight loop: decode_jpeg (as the loader) on"
    specs += [
        ("copy_prealloc", f"{copy} preallocated array, mode='clip'", "1 thread", "copy", {"mode": "clip"}),
        ("copy_fresh", f"{copy} a fresh array (previous batch alive)", "1 thread", "copy", {"mode": None}),
        ("copy_prealloc_raise", f"{copy} preallocated array, mode='raise'", "1 thread", "copy", {"mode": "raise"}),
        ("decode_threads", f"{decode} threads", f"{workers} threads", "decode", {"processes": False}),
        ("decode_processes", f"{decode} processes", f"{workers} procs", "decode", {"processes": True}),
    ]
    return specs


def measure_row(spec, setup):
    """Measure one row (in its own process, see NOTE [fresh process per row]); return its dict."""
    key, method, workers_label, kind, options = spec
    print(f"  {method} [{workers_label}] ...", end="", flush=True)
    probe = WorkerMemoryProbe()  # worker processes' memory after the warm-up and at the end
    with _EPOCH_BUILDERS[kind](setup, **options) as run_epoch:
        rate = measure_rate(probe.wrap(run_epoch), setup["repeats"], min_seconds=setup["min_seconds"])
        memory = probe.report()
    if rate.samples_per_pass != rate.epochs_per_pass * len(setup["paths"]):  # every sample, every epoch
        raise RuntimeError(f"{key}: an epoch gave {rate.samples_per_pass // rate.epochs_per_pass} samples")
    print(f" {rate.samples_per_s:,.0f} samples/s", flush=True)
    return {"key": key, "method": method, "workers": workers_label, **rate.to_dict(), "memory": memory}


def measure_jpeg_pairs(setup):
    """Time make_loader on both jpeg files and the two decode loops in turn (see NOTE [interleaved rates]).

    Returns ``{"rates": name -> per-round rates, "ratios": fmt -> per-round
    loader / best decode loop, "ratio": fmt -> median}``.
    """
    print("  jpeg: make_loader and the decode loops in turn ...", end="", flush=True)
    with ExitStack() as stack:
        runs = {f"{fmt}-jpeg": stack.enter_context(_fastdata_epochs(setup, 0, f"{fmt}-jpeg")) for fmt in ("hdf5", "arrow")}
        runs.update(decode_threads=stack.enter_context(_decode_epochs(setup, processes=False)),
                    decode_processes=stack.enter_context(_decode_epochs(setup, processes=True)))
        rates = interleaved_rates(runs, setup["paired_rounds"], setup["min_seconds"])
    best_decode = [max(pair) for pair in zip(rates["decode_threads"], rates["decode_processes"])]
    ratios = {fmt: [rate / limit for rate, limit in zip(rates[f"{fmt}-jpeg"], best_decode)] for fmt in ("hdf5", "arrow")}
    medians = {fmt: statistics.median(values) for fmt, values in ratios.items()}
    print(" " + ", ".join(f"{fmt} {ratio:.3f}x" for fmt, ratio in medians.items()), flush=True)
    return {"rounds": setup["paired_rounds"], "rates": rates, "ratios": ratios, "ratio": medians}


@contextmanager
def _folder_epochs(setup, num_workers, as_list=False):
    import _datasets
    from _folder_list import RawFolderListDataset
    from torch.utils.data import DataLoader

    cls = RawFolderListDataset if as_list else _datasets.RawFolderDataset
    dataset = cls(setup["paths"], setup["labels"], setup["size"])
    loader = DataLoader(
        dataset, setup["batch_size"], shuffle=True, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    yield partial(consume, loader)


@contextmanager
def _tutorial_epochs(setup):
    import _datasets
    from torch.utils.data import DataLoader

    dataset = _datasets.TutorialH5Dataset(setup["files"]["hdf5-raw"])
    try:
        yield partial(consume, DataLoader(dataset, setup["batch_size"], shuffle=True))
    finally:
        dataset.close()


@contextmanager
def _fastdata_epochs(setup, num_workers, key):
    from fastdata import make_loader, open_dataset

    dataset = open_dataset(setup["files"][key])
    kwargs = {"num_workers": num_workers} if num_workers else {}  # defaults unless forced
    yield partial(consume, make_loader(dataset, setup["batch_size"], shuffle=True, **kwargs))


def consume(loader):
    """Iterate one epoch as a training loop does, touching a byte of every batch; return the samples seen.

    Each batch stays alive until the next one arrives, as in ``for images, labels in loader``.
    """
    count = 0
    for images, _labels in loader:
        count += len(images)
        int(images[-1, 0, 0, 0])
    return count


@contextmanager
def _copy_epochs(setup, mode):
    """Epochs of np.take of shuffled, sorted batches from a memmap of the raw pixels (no loader)."""
    pixels = _memmap_dataset(setup["files"]["hdf5-raw"], "samples")
    batches = _shuffled_batches(len(pixels), setup["batch_size"], setup["seed"])
    out = np.empty((setup["batch_size"], *pixels.shape[1:]), pixels.dtype)

    # NOTE [np.take out]: with out= and the default mode="raise", numpy takes
    # into a temporary and then copies it into out (so out is untouched on an
    # IndexError): twice the memory traffic. mode="clip" writes straight into out.
    def copy_into():
        for indices in batches:
            np.take(pixels, indices, axis=0, out=out[: len(indices)], mode=mode)
        return sum(map(len, batches))

    def copy_fresh():
        count = 0
        for indices in batches:
            images = np.take(pixels, indices, axis=0)  # alive until the next batch, as in a loader loop
            count += len(images)
        return count

    yield copy_fresh if mode is None else copy_into


@contextmanager
def _decode_epochs(setup, processes):
    """Epochs decoding every stored JPEG of the jpeg HDF5 file in memory, on all worker cores."""
    blobs, workers = _read_jpeg_bytes(setup["files"]["hdf5-jpeg"]), setup["workers"]
    ranges = _baselines.split_ranges(len(blobs), 4 * workers)
    if processes:
        with _baselines.start_decode_pool(blobs, workers) as pool:
            yield lambda: sum(pool.map(_baselines.decode_range, ranges))
    else:
        chunks = [blobs[a:b] for a, b in ranges]
        with ThreadPoolExecutor(workers) as threads:
            yield lambda: sum(threads.map(_baselines.decode_jpegs, chunks))


_EPOCH_BUILDERS = {
    "folder": _folder_epochs,
    "tutorial": _tutorial_epochs,
    "fastdata": _fastdata_epochs,
    "copy": _copy_epochs,
    "decode": _decode_epochs,
}


def _memmap_dataset(path, name):
    """Map an HDF5 dataset's bytes with numpy (it is contiguous and uncompressed)."""
    with h5py.File(path, "r") as f:
        dset = f[name]
        offset, dtype, shape = dset.id.get_offset(), dset.dtype, dset.shape
    return np.memmap(path, mode="r", dtype=dtype, offset=offset, shape=shape)


def _read_jpeg_bytes(path):
    """Return the stored JPEG of each sample of a jpeg-storage HDF5 file, as bytes."""
    with h5py.File(path, "r") as f:
        values, offsets = f["samples"][:], f["offsets"][:]
    return [values[a:b].tobytes() for a, b in zip(offsets[:-1], offsets[1:])]


def _shuffled_batches(count, batch_size, seed):
    order = np.random.default_rng(seed).permutation(count)
    return [np.sort(order[i : i + batch_size]) for i in range(0, count, batch_size)]


# ---------------------------------------------------------------- report


def summarize(rows, conversions, jpeg_pairs):
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
    for fmt, storage, _ in FILES:
        ratio = conversions[f"{fmt}-{storage}"]["ratio_vs_pool"]
        targets.append(_target(f"{fmt} {storage} conversion vs plain Pool decode+resize", ratio, CONVERT_VS_POOL))
    return targets


def _target(name, value, threshold):
    passed, margin = value >= threshold, value / threshold
    return {"name": name, "value": value, "threshold": threshold, "pass": passed, "margin": margin}


def loading_table(rows):
    body = []
    for row in rows:
        method = row["method"] + (" = LIMIT" if row.get("is_limit") else "")
        rate, fraction, ratio = row["samples_per_s"], row["fraction_of_limit"], row["ratio_vs_folder"]
        memory = worker_memory_text(row.get("memory"))
        body.append((method, row["workers"], f"{rate:,.0f}", f"{fraction:.3g}", f"{ratio:,.1f}x", memory))
    headers = ["method", "workers", "samples/s", "fraction of memcpy limit", "vs raw folder (0 workers)",
               "per-worker MB: USS (private dirty)"]
    return markdown_table(headers, body, "llrrrr")


def jpeg_pairs_text(pairs):
    """One paragraph on the interleaved JPEG measurement behind the JPEG targets."""
    rates = ", ".join(f"{name} {statistics.median(values):,.0f}" for name, values in pairs["rates"].items())
    ratios = "; ".join(f"{fmt} " + " ".join(f"{r:.2f}" for r in values) for fmt, values in pairs["ratios"].items())
    return (f"JPEG targets: make_loader (defaults) and the two decode loops timed in turn in one process, "
            f"{pairs['rounds']} rounds (see NOTE [interleaved rates] in _timing.py). Median samples/s: {rates}. "
            f"Ratio to the faster decode loop, per round: {ratios}.")


def worker_memory_text(memory):
    """Return "USS (private dirty)" in MB, averaged over worker processes, or "-" without workers."""
    workers = (memory or {}).get("per_worker") or []
    if not workers:
        return "-"
    uss = statistics.mean(w["uss"] for w in workers) / 1e6
    dirty = statistics.mean(w.get("private_dirty", 0) for w in workers) / 1e6
    return f"{uss:,.0f} ({dirty:,.0f})"


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


def targets_text(targets):
    lines = []
    for t in targets:
        verdict = "PASS" if t["pass"] else "FAIL"
        value, threshold, margin = t["value"], t["threshold"], t["margin"]
        lines.append(f"{verdict}  {t['name']}: {value:,.2f}x (target >= {threshold:g}x; {margin:.2f} of target)")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def _warn_if_busy(busy, when):
    if busy is not None and busy >= 15.0:
        print(
            f"WARNING: other processes used {busy:.0f}% of the CPUs {when}; figures will be low and "
            "noisy (see --wait-quiet)",
            file=sys.stderr,
            flush=True,
        )


def run(args, runner=run_isolated):
    """Make the images, convert them and measure every row at ``args.size``; return the results.

    Prints progress. ``runner(fn, *args)`` runs each row in a fresh process;
    run.py passes a faster one (see NOTE [zygote] in _fresh.py). The result
    holds no machine facts; ``main`` adds them.
    """
    os.makedirs(args.workdir, exist_ok=True)
    started = time.perf_counter()
    root, source = prepare_imagefolder(args.workdir, args.num_images, args.seed)
    paths, labels = list_images(root)
    source.update(root=root, num_images=len(paths), bytes=read_all(paths))
    kilobytes = source["bytes"] / len(paths) / 1e3
    print(f"{len(paths)} images ({kilobytes:.0f} kB each) in {root}; {args.repeats} timed passes after 1 warm-up")
    print("converting ...", flush=True)
    files, conversions = time_conversions(root, paths, args.workdir, args.size, args.repeats)
    print("throughput, each row in a fresh process:", flush=True)
    setup = dict(paths=paths, labels=labels, files=files, size=args.size, batch_size=args.batch_size)
    setup.update(workers=args.workers, repeats=args.repeats, min_seconds=args.min_pass_seconds, seed=args.seed)
    rows = [runner(measure_row, spec, setup) for spec in row_specs(args.workers)]
    setup["paired_rounds"] = args.paired_rounds
    jpeg_pairs = runner(measure_jpeg_pairs, setup)
    targets = summarize(rows, conversions, jpeg_pairs)
    tables = {"loading": loading_table(rows), "conversion": conversion_table(conversions, len(paths)),
              "jpeg_pairs": jpeg_pairs_text(jpeg_pairs)}
    return {
        "benchmark": "images",
        "config": dict(vars(args)),
        "source": source,
        "files": files,
        "conversion": conversions,
        "loading": rows,
        "jpeg_pairs": jpeg_pairs,
        "targets": targets,
        "tables": tables,
        "run_seconds": time.perf_counter() - started,
    }


def report_text(results):
    """Return the Markdown report of ``run``'s results: loading, conversion and targets."""
    config, count = results["config"], results["source"]["num_images"]
    size, tables = config["size"], results["tables"]
    return "\n".join([
        f"## Loading {count} images at {size}x{size}, batch {config['batch_size']}, shuffled\n",
        tables["loading"],
        f"\nsamples/s: median of {config['repeats']} passes of whole epochs (>= {config['min_pass_seconds']}s "
        "each) after a warm-up epoch, each row in a fresh process. workers > 0: persistent workers, so their "
        "start-up falls in the warm-up epoch. LIMIT: the faster of the two direct copies. Worker memory: mean "
        "over the worker processes at the end, USS and its private dirty part (see NOTE [worker memory] in "
        "_system.py).",
        "\n" + tables["jpeg_pairs"],
        f"\n## Conversion of {count} JPEGs ({PHOTO_SIZE[0]}x{PHOTO_SIZE[1]}) to {size}x{size}\n",
        tables["conversion"],
        "\n## Targets\n",
        targets_text(results["targets"]),
    ])


def main(argv=None):
    args = parse_args(argv)
    busy_before = wait_until_quiet(args.wait_quiet) if args.wait_quiet > 0 else busy_percent()
    _warn_if_busy(busy_before, "before the run")
    results = run(args)
    busy_after = busy_percent()
    print("\n" + report_text(results))
    _warn_if_busy(busy_after, "after the run")
    results["machine"] = {**machine_info(), "busy_percent_before": busy_before, "busy_percent_after": busy_after}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out} (run took {results['run_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
