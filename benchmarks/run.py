"""Run the whole benchmark suite: make the data, convert it, measure, and write JSON, Markdown and plots.

Run from the repository root:

    python benchmarks/run.py                      # everything; ~10-15 min on 2 cores
    python benchmarks/run.py --quick              # tiny sizes, 1 pass: a smoke test (~90 s)
    python benchmarks/run.py --only text,memory   # some sections
    python benchmarks/run.py --wait-quiet 600     # first wait for an idle machine

Sections, one module each in benchmarks/sections/ (each figure the median
of timed passes after a warm-up pass, each row in a fresh process, see
NOTE [zygote] in fresh.py):

* images: raw-folder Dataset (numpy array and Python list of paths), tutorial
  h5py, HDF5/Arrow raw/jpeg through make_loader, memcpy and decode limits,
  conversions; at output sizes 64 and 224;
* gpustep: a simulated GPU step (sleep 5 ms per batch of 256) over packed
  files with make_loader defaults: the share of time spent waiting for data;
* text: raw .txt files tokenized per item versus packed files;
* peers: Hugging Face ``datasets``, WebDataset and the tutorial h5py pattern
  on the same preprocessed samples (rows skipped when missing);
* sweeps: num_workers, batch_size, prefetch_factor, pin_memory;
* memory: per-worker memory over an epoch of a million samples, fork and spawn;
* coldcache: first epochs with the files dropped from the page cache;
* shards: an ImageNet-like folder (200,000 images) converted to shard folders
  (Pool baseline, 1 vs 2 processes, Dask, peak disk and RSS, --resume after
  a kill), loaded from one, and LitData's optimize on the same input.
* scale: 64 px raw and 224 px jpeg datasets bigger than the page cache of
  a memory cgroup (sequential limit, uniform and block shuffles), DDP on
  CPU (gloo, 1-4 ranks), resume and order at 10^7 and 10^8 samples.
* augment: batched augmentation (fastdata.loading.augment) against the same
  recipe per sample and against none, CIFAR and ImageNet recipes, on CPU;
* fusedcrop: JPEG random-resized-crop decoded at a DCT scale against
  decoding in full, then cropping;
* training: the example ResNet's training loop (examples/train_resnet.py)
  from a raw image folder against packed raw and jpeg files: img/s and
  data-wait.
* streaming: 64 px raw and 224 px jpeg shard folders read from a local S3
  server (moto) through a throttling proxy (20 and 50 ms, 100 MB/s) against
  the same folders read locally: epochs 1 and 2, the first batch, cache limits.
* gpu: the CUDA checks of scripts/gpu-check.sh (skipped without a CUDA device).
* busystep: a training step that holds the GIL (2, 5, 20 ms) or sleeps,
  alone and beside each loader (fastdata's modes, torch DataLoader, SPDL,
  torchdata.nodes): the step rate kept, data wait, CPU per 1,000 images.
* records: dict batches of image + caption pairs (64 px raw, 64 and 224 px
  jpeg) and a detection-like set (0-50 boxes) written by fastdata.write,
  against the same records through Hugging Face datasets and WebDataset;
  their conversion against datasets.map(num_proc=2) and a plain Pool.
* lm: 2048-token sequences of a 100,000-document corpus (concat, tokens_only,
  best_fit, a mix) against nanoGPT, Hugging Face group_texts, LitData and the
  copy; the conversion against datasets.map(num_proc=2).
* lmscale: the same over a ~1 GB corpus (made once, cached), warm and from
  disk in a memory cgroup smaller than it.

Writes ``results.json``, ``results.md`` and ``*.png`` into --out-dir
(default benchmarks/results; with --quick benchmarks/results/tmp/quick).
Every target is a ratio of two figures measured in this run.
"""

import argparse
import os
import sys
import time
import traceback

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
if __name__ in ("__main__", "__mp_main__"):  # run as a script, which puts benchmarks/ first on sys.path
    # Import the suite as benchmarks.*, from the repository: none of its modules shadows another.
    sys.path[:] = [REPO, *(path for path in sys.path if os.path.abspath(path or ".") != BENCHMARKS)]
RESULTS = os.path.join(REPO, "benchmarks", "results")
SECTIONS = ("images", "gpustep", "text", "peers", "sweeps", "memory", "coldcache", "shards", "scale", "augment",
            "fusedcrop", "training", "streaming", "gpu", "busystep", "records", "lm", "lmscale")
FULL = {"num_images": 2000, "sizes": "64,224", "repeats": 3, "process_repeats": 3, "min_seconds": 0.25,
        "text_docs": 10000, "memory_samples": 1_000_000, "tiny_images": 2000, "shard_images": 200_000,
        "shard_compare": 10_000, "stream_images": 6000}
QUICK = {"num_images": 200, "sizes": "64,224", "repeats": 1, "process_repeats": 1, "min_seconds": 0.05,
         "text_docs": 600, "memory_samples": 20_000, "tiny_images": 200, "shard_images": 300, "shard_compare": 200,
         "stream_images": 200}


def parse_args(argv=None):
    """Parse the command line; --quick changes the defaults only."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 1 timed pass per figure")
    parser.add_argument("--only", help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    parser.add_argument("--num-images", type=int, help="photos in the image folder (default 2000; --quick 200)")
    parser.add_argument("--sizes", help="output sizes of the image section, e.g. 64,224 (default 64,224)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per batch (default 256)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the 'workers' rows (default 2)")
    parser.add_argument("--repeats", type=int, help="timed passes per figure after a warm-up (default 3; --quick 1)")
    parser.add_argument("--process-repeats", type=int,
                        help="fresh processes per fast image/text row, median kept (default 3; --quick 1)")
    parser.add_argument("--min-seconds", type=float, help="shortest timed pass in seconds (default 0.25)")
    parser.add_argument("--text-docs", type=int, help="reviews in the text corpus (default 10000; --quick 600)")
    parser.add_argument("--memory-samples", type=int, help="samples of the memory section (default 1000000)")
    parser.add_argument("--shard-images", type=int, help="images of the shards section's big source (default 200000)")
    parser.add_argument("--shard-compare", type=int,
                        help="images of the shards section's comparisons, resume and loading (default 10000)")
    parser.add_argument("--stream-images", type=int,
                        help="images of the streaming section's shard folders (default 6000; --quick 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the shuffles")
    parser.add_argument("--workdir", default=os.path.join(RESULTS, "tmp"), help="cache of data and packed files")
    parser.add_argument("--out-dir", help="where results.json, results.md and the plots go")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    parser.add_argument("--wait-quiet", type=float, default=0,
                        help="first wait up to this many seconds for other processes to go idle")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.sizes = [int(size) for size in str(args.sizes).split(",") if size.strip()]
    args.sections = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    if args.out_dir is None:
        args.out_dir = os.path.join(RESULTS, "tmp", "quick") if args.quick else RESULTS
    for name in ("num_images", "batch_size", "workers", "repeats", "process_repeats", "text_docs", "memory_samples",
                 "shard_images", "shard_compare", "stream_images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, got {getattr(args, name)}")
    return args


def config_of(args):
    """Return the plain dict every section gets (it travels to the measuring processes)."""
    keys = ("quick", "num_images", "sizes", "batch_size", "workers", "repeats", "process_repeats", "min_seconds",
            "text_docs", "memory_samples", "tiny_images", "shard_images", "shard_compare", "stream_images", "seed",
            "workdir")
    config = {key: getattr(args, key) for key in keys}
    config["workdir"] = os.path.abspath(config["workdir"])
    return config


def run_section(name, config, fresh):
    """Run one section; return its results, or ``{"error": traceback}`` when it failed."""
    import importlib

    module = importlib.import_module(f"benchmarks.sections.{name}")
    print(f"\n=== {name} ===", flush=True)
    started = time.perf_counter()
    try:
        results = module.run(config, fresh)
    except Exception:
        print(f"section {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return {"error": traceback.format_exc(), "seconds": time.perf_counter() - started}
    results["seconds"] = time.perf_counter() - started
    print(f"=== {name} done in {results['seconds']:.0f}s ===", flush=True)
    return results


def main(argv=None):
    args = parse_args(argv)
    from benchmarks import report
    from benchmarks.fresh import FreshProcesses
    from benchmarks.machine import busy_percent, wait_until_quiet, warn_if_busy

    busy_before = wait_until_quiet(args.wait_quiet) if args.wait_quiet > 0 else busy_percent()
    warn_if_busy(busy_before, "before the run")
    started = time.perf_counter()
    config = config_of(args)
    os.makedirs(config["workdir"], exist_ok=True)
    sections = {}
    with FreshProcesses() as fresh:
        machine = report.describe_machine(fresh, busy_before)
        for name in args.sections:
            sections[name] = run_section(name, config, fresh)
    busy_after = busy_percent()
    results = report.assemble(config, machine, sections, time.perf_counter() - started, busy_after)
    paths = report.write(results, args.out_dir, plots=not args.no_plots)
    print("\n" + results["markdown"])
    warn_if_busy(busy_after, "after the run")
    print(f"\nwrote {', '.join(paths)} (run took {results['run_seconds']:.0f}s)")
    failed = [name for name, section in sections.items() if "error" in section]
    if failed:
        print(f"sections that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
