"""Shards section: converting an ImageNet-like folder into shard folders, resuming one, and loading from one.

Run through benchmarks/run.py (``--only shards``). The source is an
ImageFolder of 1000 classes of varied photos (sizes around 500x375, mostly
hard links to 3000 distinct JPEGs, see NOTE [linked photos] in
fastdata/measure/synthetic.py), of ``shard_images`` (200,000; --quick 300)
images, and a second one of ``shard_compare`` (10,000; --quick 200) images
for the comparisons. Every conversion runs in its own subprocess, watched
from this one (NOTE [watched from outside] in fastdata/measure/conversion.py):
the output folder's disk use and the process tree's RSS, every 50 ms.

1. The big source to 64 px raw shards (default shard size, 2 processes), and
   the small one with the same settings: peak RSS at both sizes.
2. The small source to 64 px raw and 224 px jpeg shards, shards of about a
   32nd of the raw pixels (so that both processes have work to the end):
   a plain multiprocessing.Pool doing the same decode+resize (and, for
   jpeg storage, the same JPEG encode) and keeping nothing, timed in
   alternating rounds with fastdata's 2 local processes, unwatched (NOTE
   [paired conversions]); then, watched, fastdata with 1 and 2 local
   processes and on a Dask LocalCluster(n_workers=2, threads_per_worker=1)
   given as ``executor``; the folders must be byte-identical.
3. ``fastdata convert`` of the small source killed (SIGKILL, its process
   group) once half its shards are written, then ``--resume``, against a
   full run.
4. Loading: the 64 px raw shard folder and a single file of the same images
   through make_loader (defaults), against the memcpy limit (one thread),
   timed in turn in one process (the targets are medians of per-round
   ratios); beside them, the same copy in halves on 2 threads, which the
   loader's copy may use (NOTE [copy on two cores] in
   fastdata/reading/rowcopy.py).
5. Sample sizes: one .h5 file of raw samples at each of 32, 64, 128 and
   224 px (3, 12, 48 and 147 KiB a sample): 64 px the file of 4., 128 and
   224 px converted from the small source, 32 px from a third source of
   ``SIZES_SOURCE`` times its images (500 distinct photos), so that an
   epoch outgrows the 36 MiB L3 cache. On each, make_loader (defaults)
   against a plain batched memmap read (np.take into a fresh array) and the
   memcpy limit, timed in turn as in 4; targets LOAD_VS_READ and
   LOAD_VS_COPY (NOTE [copy on two cores] in fastdata/reading/rowcopy.py).
6. Peers: LitData's ``optimize`` on the same decode+resize (Mosaic
   Streaming's MDSWriter: a row saying why it is not measured).
"""

import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys

from benchmarks.sections import images
from fastdata import convert_imagefolder
from fastdata.converters.shards import DEFAULT_SHARD_BYTES
from fastdata.measure.machine import installed_version
from fastdata.measure.tables import Row, markdown_table

SEED_DISTINCT, CLASSES = 3000, 1000
RAW, JPEG = (64, "raw"), (224, "jpeg")
JPEG_QUALITY = inspect.signature(convert_imagefolder).parameters["quality"].default  # what the conversions use
WORKERS = 2
COMPARE_SHARDS = 32  # the comparisons' shard size: a 32nd of the small source's 64 px raw pixels
# Targets over the Pool doing the same work. Raw 64 px: as the images section's conversions (JPEG draft
# decoding at 1/4 scale is most of the gain). Jpeg 224 px: no draft scale reaches 224 from ~500x375 (NOTE
# [fast DCT scales] in fastdata/codecs/images.py), so the work is the Pool's and the target is that the engine
# (writing, checksums, statistics, the driver) costs at most a tenth. Until 2026-11-23 that row compared
# against a Pool that did not encode, under the raw row's 1.5x.
CONVERT_VS_POOL = {"raw": 1.5, "jpeg": 0.9}
CONVERT_ROUNDS = 3  # paired rounds of the Pool and fastdata per storage (--quick 1): NOTE [paired conversions]
DISK_SLACK_SHARDS = WORKERS  # peak disk at most final + one shard per worker (the "written straight")
RESUME_VS_FULL = 0.6  # "about half" the time of a full run, after a kill at half-way
KILL_TRIES = 3
LOAD_VS_LIMIT = 0.8
LIMIT_KEYS = ("copy_prealloc", "copy_fresh")  # the memcpy limit: the faster one-thread copy
LITDATA_MISSING = ("not installed: scripts/setup.sh installs it without its requirements (torchvision, whose PyPI "
                   "build does not load against the CPU torch pinned here; see pyproject.toml)")
LOAD_VS_FILE = 0.9  # "within noise" of the single file
LOAD_ROUNDS = 7  # interleaved rounds of the loading rows per process (--quick 2)
RSS_GROWTH = 1.25  # peak RSS at shard_images over shard_compare inputs
ENGINES = {"raw": (("local", 1), ("local", WORKERS), ("dask", WORKERS)),
           "jpeg": (("local", 1), ("local", WORKERS), ("dask", WORKERS), ("dask-no-trim", WORKERS))}
SAMPLE_SIZES = (32, 64, 128, 224)  # px of the sample-size rows: 3, 12, 48 and 147 KiB a sample
SIZES_SOURCE, SIZES_DISTINCT = 3, 500  # the 32 px file's source: 3x shard_compare images, of 500 distinct photos
SIZE_ROUNDS = 4  # interleaved rounds of the sample-size rows per process (--quick 2)
LOAD_VS_READ, LOAD_VS_COPY = 1.2, 0.9  # make_loader over a batched memmap read, and over the memcpy limit
BIG, SMALL, SINGLE = "64-raw-64MiB-big", "64-raw-64MiB-small", "64-raw-one-file"  # the first three conversions

CONVERT_SCRIPT = """\
import json, sys, time
from fastdata import convert_imagefolder

args = json.loads(sys.argv[1])
executor, cluster, cluster_seconds = None, None, None
if args["engine"].startswith("dask"):
    import dask
    from dask.distributed import Client, LocalCluster
    if args["engine"] == "dask-no-trim":  # see NOTE [dask malloc trim]
        environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
        environ.pop("MALLOC_TRIM_THRESHOLD_", None)
        dask.config.set({"distributed.nanny.pre-spawn-environ": environ})
    started = time.perf_counter()
    cluster = LocalCluster(n_workers=args["workers"], threads_per_worker=1, processes=True, dashboard_address=None)
    executor = Client(cluster)
    cluster_seconds = time.perf_counter() - started
started = time.perf_counter()
report = convert_imagefolder(args["src"], args["out"], size=args["size"], storage=args["storage"],
                             shard_size=args["shard_size"], workers=args["workers"], executor=executor,
                             overwrite=True, progress=False)
seconds = time.perf_counter() - started
if cluster is not None:
    executor.close()
    cluster.close()
print(json.dumps({"seconds": seconds, "num_samples": report.num_samples, "skipped": len(report.skipped),
                  "cluster_seconds": cluster_seconds}))
"""

POOL_SCRIPT = """\
import json, os, sys, time
from fastdata.converters import find_images
from fastdata.measure.conversion import pool_decode_count

args = json.loads(sys.argv[1])
_, relpaths, _ = find_images(args["src"])
paths = [os.path.join(args["src"], path) for path in relpaths]
quality = args["quality"] if args["storage"] == "jpeg" else None
started = time.perf_counter()
count = pool_decode_count(paths, args["size"], args["workers"], quality)
print(json.dumps({"seconds": time.perf_counter() - started, "num_samples": count}))
"""

LITDATA_SCRIPT = """\
import json, os, sys, time
from fastdata.converters import find_images
from fastdata.measure.baselines import load_resized

def sample(item):
    path, label, size = item
    return {"image": load_resized(path, size), "label": label}

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    from litdata import optimize
    _, paths, labels = find_images(args["src"])
    items = [(os.path.join(args["src"], p), int(l), args["size"]) for p, l in zip(paths, labels)]
    started = time.perf_counter()
    optimize(fn=sample, inputs=items, output_dir=args["out"], chunk_bytes=args["shard_size"],
             num_workers=args["workers"], mode="overwrite")
    print(json.dumps({"seconds": time.perf_counter() - started, "num_samples": len(items)}))
"""
MOSAIC_NOTE = ("not timed: installing mosaicml-streaming 0.13.0 here would replace numpy 2.4.6 with 2.1.3 and "
               "tokenizers 0.23.3 with 0.22.2 (pip --dry-run with the project's constraints)")


def run(config, fresh):
    """Run the shards section; return its rows, targets and text."""
    workdir = os.path.join(config["workdir"], "shards")
    os.makedirs(os.path.join(workdir, "out"), exist_ok=True)
    big = source(workdir, config["shard_images"], config["seed"])
    small = source(workdir, config["shard_compare"], config["seed"])
    shard_bytes = max(64 << 10, small["num_images"] * 3 * RAW[0] ** 2 // COMPARE_SHARDS)
    conversions = [convert(big, workdir, RAW, None, "local", WORKERS, BIG),
                   convert(small, workdir, RAW, None, "local", WORKERS, SMALL),
                   convert(small, workdir, RAW, None, "local", WORKERS, SINGLE)]
    pairs = {}
    for size, storage in (RAW, JPEG):
        pairs[storage] = paired_rounds(small, workdir, (size, storage), shard_bytes, 1 if config["quick"] else
                                       CONVERT_ROUNDS)
        conversions.append(pool_row(small, size, storage, pairs[storage]))
        for engine, workers in ENGINES[storage]:
            if engine.startswith("dask") and installed_version("distributed") is None:
                conversions.append({"key": f"{size}-{storage}-dask-{workers}", "size": size, "storage": storage,
                                    "engine": engine, "workers": workers, "num_images": small["num_images"],
                                    "skipped": "not installed: pip install 'fastdata[dask]'"})
                continue
            conversions.append(convert(small, workdir, (size, storage), shard_bytes, engine, workers))
    check_identical(conversions)
    resume = resume_run(small, workdir, shard_bytes)
    outputs = {row["key"]: row.get("out") for row in conversions}
    loading = loading_rows(config, fresh, small, outputs[SINGLE], outputs[f"{RAW[0]}-raw-local-{WORKERS}"])
    sizes = sample_size_rows(config, fresh, workdir, small, outputs[SINGLE])
    peers = [litdata_row(small, workdir, shard_bytes),
             {"key": "mosaic", "tool": "Mosaic Streaming MDSWriter", "skipped": MOSAIC_NOTE}]
    results = {"source": big, "compare_source": small, "shard_bytes": shard_bytes, "workers": WORKERS,
               "conversions": conversions, "pairs": pairs, "resume": resume, "loading": loading, "sample_sizes": sizes,
               "peers": peers}
    results["targets"] = summarize(results)
    results["text"] = text(results)
    return results


# NOTE [dask malloc trim]: Dask's nanny starts its workers with
# MALLOC_TRIM_THRESHOLD_=65536 (distributed.nanny.pre-spawn-environ), so
# glibc hands freed memory back to the kernel past 64 KB and faults it in
# again for the next image. Converting 2000 images to 224 px jpeg shards
# (0.73 MiB) on LocalCluster(2 workers, 1 thread each) took 27.6-29.6 s with
# it and 7.4-11.9 s without it (the local pool: 12.8 s), on this 2-core
# machine beside other jobs; at 64 px raw no difference showed. The 224 px
# rows measure both: Dask as it comes, and with that variable left out.


# ---------------------------------------------------------------- the source


def source(workdir, num_images, seed):
    """Return the facts of the ImageNet-like folder of ``num_images`` in ``workdir``, made unless cached."""
    from benchmarks import inputs

    params, root, seconds = inputs.imagenet_like(workdir, num_images, min(CLASSES, num_images),
                                                 min(SEED_DISTINCT, num_images), seed)
    return {**params, "root": root, "generate_seconds": seconds, **photo_sizes(root)}


def photo_sizes(root):
    """Return the mean width and height and the bytes of the photos under ``root`` (linked files counted each time)."""
    from PIL import Image

    widths, heights, sizes, seen = [], [], [], {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".jpg"):
                stat = os.stat(os.path.join(folder, name))
                if stat.st_ino not in seen:
                    with Image.open(os.path.join(folder, name)) as img:
                        seen[stat.st_ino] = img.size
                width, height = seen[stat.st_ino]
                widths.append(width), heights.append(height), sizes.append(stat.st_size)
    return {"mean_width": statistics.fmean(widths), "mean_height": statistics.fmean(heights),
            "source_bytes": sum(sizes), "distinct_files": len(seen)}


# ---------------------------------------------------------------- conversions


def convert(src, workdir, what, shard_bytes, engine, workers, key=None):
    """Convert ``src`` in a watched subprocess to a shard folder (one file: key "...one-file"); return its row."""
    from fastdata.formats.shards import read_index
    from fastdata.measure.conversion import folder_usage, run_watched

    size, storage = what
    key = key or f"{size}-{storage}-{engine}-{workers}"
    folder = os.path.join(workdir, "out", f"{src['num_images']}-{key}")
    shutil.rmtree(folder, ignore_errors=True)
    one_file = key.endswith("one-file")
    out = os.path.join(folder, "data.h5") if one_file else folder
    os.makedirs(os.path.dirname(out), exist_ok=True)
    args = {"src": src["root"], "out": out, "size": size, "storage": storage, "shard_size": shard_bytes,
            "engine": engine, "workers": workers}
    print(f"  {key}: {src['num_images']} images ...", end="", flush=True)
    watched = run_watched([sys.executable, "-c", CONVERT_SCRIPT, json.dumps(args)], folder)
    if watched.returncode != 0:
        raise RuntimeError(f"converting {src['root']} to {out} failed:\n{watched.stderr[-3000:]}")
    done = watched.json()
    index = None if one_file else read_index(out)
    final_bytes, final_disk = folder_usage(folder)
    row = {"key": key, "out": out, "size": size, "storage": storage, "engine": engine, "workers": workers,
           "num_images": src["num_images"], "num_samples": done["num_samples"], "skipped_images": done["skipped"],
           "shard_size": shard_bytes, "num_shards": index.num_shards if index else 1,
           "shard_bytes": int(sum(index.sizes)) if index else os.path.getsize(out),
           "checksums": list(index.checksums) if index else None, "seconds": done["seconds"],
           "wall_seconds": watched.seconds,
           "cluster_seconds": done["cluster_seconds"], "images_per_s": done["num_samples"] / done["seconds"],
           "final_bytes": final_bytes, "final_disk": final_disk, **watched.peaks.to_dict()}
    row["peak_disk_ratio"] = row["disk"] / final_disk
    print(f" {row['images_per_s']:,.0f} img/s, {row['num_shards']} shards, peak disk {row['peak_disk_ratio']:.2f}x "
          f"final, RSS driver {row['driver_rss'] / 1e6:,.0f} MB, worker {row['worker_rss'] / 1e6:,.0f} MB", flush=True)
    return row


def paired_rounds(src, workdir, what, shard_bytes, rounds):
    """Time the plain Pool and fastdata (2 local processes, unwatched) converting ``src`` in turn, ``rounds`` times.

    NOTE [paired conversions]: this VM's speed drifts over minutes (NOTE
    [interleaved rates] in fastdata/measure/engine.py), and a watched
    conversion shares the 2 cores with the watcher's sampling every 50 ms.
    In the run of 2026-11-23 16:41 the 224 px jpeg conversion, watched and
    minutes from its Pool row, measured 363 against 459 img/s (0.79); the
    same two, back to back and unwatched two hours later, 435 against 467
    (0.93; 10,000 images, /tmp script). So the targets compare the two in
    rounds, the order alternating, each run in its own process (fastdata:
    the convert_imagefolder call's seconds, as the watched rows), and take the
    median of the rounds' ratios; the watched rows give disk and memory.

    Returns:
        ``{"pool": [img/s], "ours": [img/s], "ratios": [ours / pool], "seconds": {"pool": [s], "ours": [s]},
        "num_samples": {"pool": [n], "ours": [n]}}``, a value per round.
    """
    size, storage = what
    out = os.path.join(workdir, "out", f"{src['num_images']}-{size}-{storage}-paired")
    args = {"src": src["root"], "out": out, "size": size, "storage": storage, "shard_size": shard_bytes,
            "engine": "local", "workers": WORKERS, "quality": JPEG_QUALITY}
    rates, seconds, counts = {"pool": [], "ours": []}, {"pool": [], "ours": []}, {"pool": [], "ours": []}
    for turn in range(rounds):
        for who in ("pool", "ours") if turn % 2 == 0 else ("ours", "pool"):
            print(f"  round {turn + 1}/{rounds}, {'Pool ' + _pool_work(storage) if who == 'pool' else 'fastdata'} "
                  f"at {size}: {src['num_images']} images ...", end="", flush=True)
            if who == "pool":
                done = _run_json([sys.executable, "-c", POOL_SCRIPT, json.dumps(args)])
            else:
                shutil.rmtree(out, ignore_errors=True)
                done = _run_json([sys.executable, "-c", CONVERT_SCRIPT, json.dumps(args)])
            rates[who].append(done["num_samples"] / done["seconds"])
            seconds[who].append(done["seconds"])
            counts[who].append(done["num_samples"])
            print(f" {rates[who][-1]:,.0f} img/s", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return {**rates, "ratios": [ours / pool for ours, pool in zip(rates["ours"], rates["pool"])], "seconds": seconds,
            "num_samples": counts}


def _run_json(command):
    """Run ``command``; return the JSON of its last line of output."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]}... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pool_row(src, size, storage, pair):
    """Return the table row of the plain Pool from its paired rounds: the median round (by seconds)."""
    seconds = statistics.median_low(pair["seconds"]["pool"])
    count = pair["num_samples"]["pool"][pair["seconds"]["pool"].index(seconds)]
    return {"key": f"{size}-{storage}-pool", "size": size, "storage": storage, "engine": "pool", "workers": WORKERS,
            "num_images": src["num_images"], "num_samples": count, "seconds": seconds, "images_per_s": count / seconds}


def _pool_work(storage):
    return "decode+resize+encode" if storage == "jpeg" else "decode+resize"


def check_identical(rows):
    """Record, for each (size, storage), whether every engine and process count wrote the same shards."""
    for what in (RAW, JPEG):
        written = [r for r in rows if (r["size"], r["storage"]) == what and r.get("checksums") and r["shard_size"]]
        same = all(r["checksums"] == written[0]["checksums"] for r in written)
        for row in written:
            row["identical"] = same


# ---------------------------------------------------------------- resume


def fastdata_command():
    """Return the argv that starts the ``fastdata`` command of this Python."""
    script = os.path.join(os.path.dirname(sys.executable), "fastdata")
    return [script] if os.path.exists(script) else [sys.executable, "-c", "from fastdata.cli import main; main()"]


def resume_run(src, workdir, shard_bytes):
    """Time ``fastdata convert`` in full, then killed at half its shards and resumed; return the figures."""
    from fastdata.formats.shards import CONTAINER_EXTENSIONS, read_index
    from fastdata.measure.conversion import count_shards, run_watched

    out = os.path.join(workdir, "out", f"{src['num_images']}-resume")
    command = [*fastdata_command(), "convert", "imagefolder", src["root"], out, "--size", str(RAW[0]), "--storage",
               RAW[1], "--shard-size", str(shard_bytes), "--workers", str(WORKERS), "--quiet"]
    print(f"  fastdata convert, killed at half-way, --resume: {src['num_images']} images ...", end="", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    full = _checked(run_watched(command, out), "a full run")
    expected = read_index(out).checksums
    shards = len(expected)
    half, extension = max(1, shards // 2), CONTAINER_EXTENSIONS["hdf5"]
    # A small run can finish between two readings, or write its last shard before the kill lands (the
    # sampling thread starved on a busy machine: a CI run of 2026-11-29 killed one with 20 of 20 written).
    for _ in range(KILL_TRIES):
        shutil.rmtree(out, ignore_errors=True)
        killed = run_watched(command, out, kill_when=lambda root: count_shards(root, extension) >= half)
        kept = count_shards(out, extension)
        if killed.killed and kept < shards:
            break
    else:
        raise RuntimeError(f"the run to be killed at {half} of {shards} shards finished first {KILL_TRIES} times")
    resumed = _checked(run_watched([*command, "--resume"], out), "the resumed run")
    checksums_equal = list(read_index(out).checksums) == list(expected)
    ratio = resumed.seconds / full.seconds
    print(f" full {full.seconds:.1f} s, killed with {kept} of {shards} shards after {killed.seconds:.1f} s, "
          f"resume {resumed.seconds:.1f} s ({ratio:.2f} of full)", flush=True)
    return {"num_images": src["num_images"], "num_shards": shards, "shard_size": shard_bytes, "kill_at": half,
            "shards_at_kill": kept, "full_seconds": full.seconds, "killed_after_seconds": killed.seconds,
            "resume_seconds": resumed.seconds, "resume_vs_full": ratio, "same_as_full_run": checksums_equal,
            "command": " ".join(command[-12:])}


def _checked(watched, what):
    if watched.returncode != 0:
        raise RuntimeError(f"{what} of fastdata convert failed ({watched.returncode}):\n{watched.stderr[-3000:]}")
    return watched


# ---------------------------------------------------------------- loading


def loading_rows(config, fresh, src, single, folder):
    """Measure make_loader on the shard ``folder`` and on the ``single`` file of the same images; the memcpy limits.

    The four rows are timed in turn, ``LOAD_ROUNDS`` times, in each of
    ``process_repeats`` fresh processes (NOTE [interleaved rates] in
    fastdata/measure/engine.py; NOTE [process to process] in fresh.py): a
    row's rate is the median over every round of every process, and each
    round also gives the ratios the targets compare (``round_ratios``).
    """
    setup = {"files": {"hdf5-raw": single, "shards-raw": folder}, "num_samples": src["num_images"],
             "rounds": 2 if config["quick"] else LOAD_ROUNDS,
             **{key: config[key] for key in ("batch_size", "min_seconds", "seed")}}
    runs = [fresh.run(measure_loading, setup) for _ in range(max(1, config["process_repeats"]))]
    rows = []
    for position, row in enumerate(runs[0]):
        rates = [rate for run in runs for rate in run[position]["rates"]]
        rows.append({**row, "rates": rates, "samples_per_s": statistics.median(rates)})
    return rows


def measure_loading(setup):
    """Time every loading row in turn in this process (see loading_rows); return the rows with their rates."""
    from contextlib import ExitStack

    from fastdata.measure.engine import interleaved_rates

    plan = loading_plan()
    with ExitStack() as stack:
        runs = {row.key: stack.enter_context(row.build(setup, **row.options)) for row in plan}
        per_epoch = {key: run_epoch() for key, run_epoch in runs.items()}  # samples an epoch (and a warm-up)
        rates = interleaved_rates(runs, setup["rounds"], setup["min_seconds"])
    return [{"key": row.key, "method": row.method, "workers": row.workers, "rates": rates[row.key],
             "samples_per_pass": per_epoch[row.key]} for row in plan]


def round_ratios(rows, key, limit_keys):
    """Return per round: row ``key``'s rate over the best rate of ``limit_keys`` that round."""
    rates = {row["key"]: row["rates"] for row in rows}
    return [rate / max(limits) for rate, *limits in zip(rates[key], *(rates[k] for k in limit_keys))]


def loading_plan():
    """Return the Rows of the loading table: the single file, the shard folder, the two memcpy limits."""
    copy = "memcpy: np.take from the single file's memmap into"
    return [
        Row("single_file", f"fastdata HDF5 raw {RAW[0]} px, one file: make_loader", "0 (defaults)",
            images._fastdata_epochs, {"key": "hdf5-raw", "num_workers": 0}, "fastdata"),
        Row("shard_folder", f"fastdata HDF5 raw {RAW[0]} px, shard folder: make_loader", "0 (defaults)",
            images._fastdata_epochs, {"key": "shards-raw", "num_workers": 0}, "fastdata"),
        Row("copy_prealloc", f"{copy} a preallocated array, mode='clip'", "1 thread", images._copy_epochs,
            {"mode": "clip"}, "copy", limit=True),
        Row("copy_fresh", f"{copy} a fresh array (previous batch alive)", "1 thread", images._copy_epochs,
            {"mode": None}, "copy", limit=True),
        Row("copy_two_threads", f"{copy} a preallocated array, halves on 2 threads at once (not the limit)",
            "2 threads", images._copy_epochs, {"mode": "clip", "threads": 2}, "copy"),
    ]


def sample_size_rows(config, fresh, workdir, small, single):
    """Measure make_loader, a batched memmap read and the memcpy limit on a raw .h5 file at each of SAMPLE_SIZES.

    The three rows of a size are timed in turn, ``SIZE_ROUNDS`` times, in
    each of ``process_repeats`` fresh processes (as loading_rows); returns a
    row per size with each row's rates and the per-round ratios the targets
    compare.
    """
    from benchmarks import inputs

    count = SIZES_SOURCE * small["num_images"]
    params, root, _ = inputs.imagenet_like(workdir, count, min(CLASSES, count), min(SIZES_DISTINCT, count),
                                              config["seed"])
    files = {}
    for size in SAMPLE_SIZES:
        src = {**params, "root": root} if size == SAMPLE_SIZES[0] else small
        files[size] = single if size == RAW[0] else convert(src, workdir, (size, "raw"), None, "local", WORKERS,
                                                            f"{size}-raw-one-file")["out"]
    setup = {"files": files, "rounds": 2 if config["quick"] else SIZE_ROUNDS,
             **{key: config[key] for key in ("batch_size", "min_seconds", "seed")}}
    runs = [fresh.run(measure_sizes, setup) for _ in range(max(1, config["process_repeats"]))]
    rows = []
    for size, path in files.items():
        rates = {key: [rate for run in runs for rate in run[size][key]] for key in runs[0][size]}
        rows.append({"size": size, "path": path, "num_samples": _samples(path), "sample_bytes": 3 * size * size,
                     "rates": rates, "samples_per_s": {key: statistics.median(r) for key, r in rates.items()},
                     "vs_read": [a / b for a, b in zip(rates["loader"], rates["read"])],
                     "vs_copy": [a / b for a, b in zip(rates["loader"], rates["copy"])]})
    return rows


def measure_sizes(setup):
    """Time the rows of each sample size in turn in this process (see sample_size_rows); return size -> key -> rates."""
    from contextlib import ExitStack

    from fastdata.measure.engine import interleaved_rates

    rates = {}
    for size, path in setup["files"].items():
        case = {**setup, "files": {"hdf5-raw": path}}
        with ExitStack() as stack:
            runs = {"loader": stack.enter_context(images._fastdata_epochs(case, "hdf5-raw", 0)),
                    "read": stack.enter_context(images._copy_epochs(case, None)),
                    "copy": stack.enter_context(images._copy_epochs(case, "clip"))}
            rates[size] = interleaved_rates(runs, setup["rounds"], setup["min_seconds"])
    return rates


def _samples(path):
    from fastdata.formats import read_packed

    columns, _ = read_packed(path)
    return len(columns.samples)


# ---------------------------------------------------------------- peers


def litdata_row(src, workdir, shard_bytes):
    """Time LitData's ``optimize`` on the same decode+resize to 64 px in a watched subprocess, or say why not."""
    from fastdata.measure.conversion import folder_usage, run_watched

    row = {"key": "litdata", "tool": "LitData optimize", "size": RAW[0], "num_images": src["num_images"],
           "workers": WORKERS, "shard_size": shard_bytes, "version": installed_version("litdata")}
    if row["version"] is None:
        return {**row, "skipped": LITDATA_MISSING}
    out = os.path.join(workdir, "out", f"{src['num_images']}-litdata")
    shutil.rmtree(out, ignore_errors=True)
    args = {"src": src["root"], "out": out, "size": RAW[0], "shard_size": shard_bytes, "workers": WORKERS}
    print(f"  LitData optimize: {src['num_images']} images ...", end="", flush=True)
    script = os.path.join(workdir, "litdata_optimize.py")  # a file: LitData spawns, which re-imports __main__
    with open(script, "w") as f:
        f.write(LITDATA_SCRIPT)
    watched = run_watched([sys.executable, script, json.dumps(args)], out)  # TQDM_DISABLE breaks its bar
    stored = _litdata_samples(out)
    if watched.returncode != 0 or stored != src["num_images"]:  # a row of the table, not the section's end
        print(" failed", flush=True)
        return {**row, "skipped": f"failed ({watched.returncode}, {stored} samples written): "
                                  f"{watched.stderr.strip().splitlines()[-1:]}"}
    done = watched.json()
    final_bytes, final_disk = folder_usage(out)
    row.update(seconds=done["seconds"], wall_seconds=watched.seconds, num_samples=done["num_samples"],
               images_per_s=done["num_samples"] / done["seconds"], final_bytes=final_bytes, final_disk=final_disk,
               **watched.peaks.to_dict())
    row["peak_disk_ratio"] = row["disk"] / final_disk
    print(f" {row['images_per_s']:,.0f} img/s", flush=True)
    return row


def _litdata_samples(out):
    """Return the samples LitData's index in ``out`` lists (0 without one)."""
    try:
        with open(os.path.join(out, "index.json")) as f:
            return sum(chunk["chunk_size"] for chunk in json.load(f)["chunks"])
    except (OSError, ValueError, KeyError):
        return 0


# ---------------------------------------------------------------- report


def summarize(results):
    """Return the section's targets, each a ratio of two figures of this run."""
    rows = {row["key"]: row for row in results["conversions"]}
    targets = []
    for size, storage in (RAW, JPEG):
        pair = results["pairs"][storage]
        targets.append(_target(f"shards {size}px {storage}, {WORKERS} processes vs plain Pool {_pool_work(storage)}",
                               statistics.median(pair["ratios"]), CONVERT_VS_POOL[storage],
                               f"median of {len(pair['ratios'])} paired rounds; medians "
                               f"{statistics.median(pair['ours']):,.0f} vs {statistics.median(pair['pool']):,.0f} "
                               "img/s"))
    for row in results["conversions"]:
        if "disk" in row and row["key"] != SINGLE:
            slack = row["final_disk"] + DISK_SLACK_SHARDS * (row["shard_size"] or DEFAULT_SHARD_BYTES)
            targets.append(_target(f"shards {row['key']} ({row['num_images']:,} images): peak disk / final size",
                                   row["peak_disk_ratio"], slack / row["final_disk"],
                                   f"{row['disk'] / 1e6:,.1f} MB at peak, {row['final_disk'] / 1e6:,.1f} MB final; "
                                   f"bar: final + {DISK_SLACK_SHARDS} shards", at_least=False))
    big, small = rows[BIG], rows[SMALL]
    for part in ("driver_rss", "worker_rss"):
        if not big[part] or not small[part]:  # one shard or less: converted in the driver, no workers
            continue
        targets.append(_target(f"shards: peak {part.replace('_rss', '')} RSS at {big['num_images']:,} vs "
                               f"{small['num_images']:,} inputs", big[part] / small[part], RSS_GROWTH,
                               f"{big[part] / 1e6:,.0f} vs {small[part] / 1e6:,.0f} MB", at_least=False))
    resume = results["resume"]
    targets.append(_target("shards: --resume after SIGKILL at half the shards vs a full run",
                           resume["resume_vs_full"], RESUME_VS_FULL,
                           f"{resume['resume_seconds']:.1f} vs {resume['full_seconds']:.1f} s", at_least=False))
    loading = {row["key"]: row for row in results["loading"]}
    limit = max(loading[key]["samples_per_s"] for key in LIMIT_KEYS)
    folder, single = loading["shard_folder"]["samples_per_s"], loading["single_file"]["samples_per_s"]
    rounds = f"median of {len(loading['shard_folder']['rates'])} interleaved rounds"
    two = loading.get("copy_two_threads")
    both_cores = f"; {folder / two['samples_per_s']:.2f} of a copy on 2 threads" if two else ""
    targets.append(_target(f"shard folder raw {RAW[0]}px, make_loader defaults vs memcpy limit",
                           statistics.median(round_ratios(results["loading"], "shard_folder", LIMIT_KEYS)),
                           LOAD_VS_LIMIT, f"{rounds}; medians {folder:,.0f} vs {limit:,.0f} samples/s{both_cores}"))
    targets.append(_target(f"shard folder raw {RAW[0]}px vs one file, make_loader defaults",
                           statistics.median(round_ratios(results["loading"], "shard_folder", ("single_file",))),
                           LOAD_VS_FILE, f"{rounds}; medians {folder:,.0f} vs {single:,.0f} samples/s"))
    for row in results["sample_sizes"]:
        medians, name = row["samples_per_s"], f"raw {row['size']}px one file, make_loader defaults"
        rounds = f"median of {len(row['vs_read'])} interleaved rounds; medians {medians['loader']:,.0f} vs"
        targets.append(_target(f"{name} vs batched memmap read", statistics.median(row["vs_read"]), LOAD_VS_READ,
                               f"{rounds} {medians['read']:,.0f} samples/s"))
        targets.append(_target(f"{name} vs memcpy limit", statistics.median(row["vs_copy"]), LOAD_VS_COPY,
                               f"{rounds} {medians['copy']:,.0f} samples/s"))
    return targets


def _target(name, value, threshold, info, at_least=True):
    return {"name": name, "value": value, "threshold": threshold, "at_least": at_least, "info": info}


def text(results):
    """Return the section's Markdown."""
    src, small = results["source"], results["compare_source"]
    return "\n".join([
        f"## Shards: ImageNet-like folders of {src['num_images']:,} and {small['num_images']:,} varied JPEGs "
        f"(mean {src['mean_width']:.0f}x{src['mean_height']:.0f}, {src['distinct_files']:,} distinct files "
        "hard-linked)", "", conversion_table(results["conversions"]), "",
        f"Shard size: the default (64 MiB) for the first two rows; the third writes one .h5 file (staged, as "
        f"before shards); {results['shard_bytes'] / 2**20:.2f} MiB (a 32nd of the 64 px raw pixels) for the "
        "others, so that a shuffled batch of the loading rows touches about as many shards as one of a 64 MiB "
        "folder of 200,000 images (37 shards). img/s: images over the seconds of the convert_imagefolder call in "
        "its own process (a Pool row: its start-up included, the median of the paired rounds that the targets "
        "compare, see NOTE [paired conversions] in benchmarks/sections/shards.py). Peak disk: the output "
        "folder's allocated blocks, "
        "hidden partial shards included, sampled every 50 ms. RSS: the converting process (driver) and its "
        "largest descendant (worker; under Dask the nannies and workers). dask-no-trim: Dask with "
        "MALLOC_TRIM_THRESHOLD_ left out of its workers' environment (see NOTE [dask malloc trim] in "
        "benchmarks/sections/shards.py).", "",
        resume_text(results["resume"]), "", loading_table(results["loading"]), "",
        sizes_table(results["sample_sizes"]), "",
        peers_table(results["peers"]),
    ])


def conversion_table(rows):
    body = []
    for row in rows:
        watched = "disk" in row
        if "skipped" in row:
            body.append((row["key"], f"{row['num_images']:,}", row["engine"], row["workers"], row["skipped"],
                         *["-"] * 6))
            continue
        body.append((row["key"], f"{row['num_images']:,}", row["engine"], row["workers"],
                     f"{row['images_per_s']:,.0f}", str(row.get("num_shards", "-")),
                     f"{row['peak_disk_ratio']:.3f}" if watched else "-",
                     f"{row['final_disk'] / 1e6:,.1f}" if watched else "-",
                     f"{row['driver_rss'] / 1e6:,.0f}" if watched else "-",
                     f"{row['worker_rss'] / 1e6:,.0f}" if watched else "-",
                     {True: "yes", False: "NO"}.get(row.get("identical"), "-")))
    headers = ["conversion", "images", "engine", "processes", "img/s", "shards", "peak disk / final", "final MB",
               "driver RSS MB", "worker RSS MB", "byte-identical"]
    return markdown_table(headers, body, "lrllrrrrrrl")


def resume_text(resume):
    return (f"Resume: `fastdata convert ... {resume['command']}` of {resume['num_images']:,} images "
            f"({resume['num_shards']} shards) took {resume['full_seconds']:.1f} s; killed with SIGKILL once "
            f"{resume['kill_at']} shards were written ({resume['shards_at_kill']} on disk, after "
            f"{resume['killed_after_seconds']:.1f} s), `--resume` took {resume['resume_seconds']:.1f} s "
            f"({resume['resume_vs_full']:.2f} of the full run); shards equal to the full run's: "
            f"{'yes' if resume['same_as_full_run'] else 'NO'}.")


def loading_table(rows):
    limit = max(row["samples_per_s"] for row in rows if row["key"] in LIMIT_KEYS)
    body = [(row["method"], row["workers"], f"{row['samples_per_s']:,.0f}", f"{row['samples_per_s'] / limit:.3f}")
            for row in rows]
    return markdown_table(["loading", "workers", "samples/s", "fraction of memcpy limit"], body, "llrr")


def sizes_table(rows):
    body = [(f"{row['size']} px", f"{row['sample_bytes'] / 1024:,.0f}", f"{row['num_samples']:,}",
             *(f"{row['samples_per_s'][key]:,.0f}" for key in ("loader", "read", "copy")),
             f"{statistics.median(row['vs_read']):.2f}", f"{statistics.median(row['vs_copy']):.2f}") for row in rows]
    headers = ["raw, one .h5 file", "KiB a sample", "samples", "make_loader samples/s", "batched memmap read",
               "memcpy limit", "loader / read", "loader / limit"]
    return markdown_table(headers, body, "lrrrrrrr") + (
        "\n\nBatched memmap read: np.take of each shuffled, sorted batch from the file's memmap into a fresh array "
        "(the previous batch alive); memcpy limit: the same into one preallocated array, mode='clip', one thread. "
        "Ratios: medians of per-round ratios (the targets).")


def peers_table(rows):
    body = []
    for row in rows:
        if "skipped" in row:
            body.append((row["tool"], "-", "-", "-", row["skipped"]))
        else:
            body.append((row["tool"], f"{row['num_images']:,}", f"{row['images_per_s']:,.0f}",
                         f"{row['peak_disk_ratio']:.3f}", f"version {row['version']}, {row['workers']} workers, "
                         f"chunks of {row['shard_size'] / 2**20:.2f} MiB"))
    return markdown_table(["other tool, 64 px raw", "images", "img/s", "peak disk / final", "note"], body, "lrrrl")
