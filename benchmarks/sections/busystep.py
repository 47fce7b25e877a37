"""Busy step: how fast a training step runs beside each loader, the step holding the GIL or releasing it.

Run through benchmarks/run.py (``--only busystep``). The figure is the
step's rate, not the loader's: every loop takes a batch, touches it and runs
a step that either holds the GIL for 2, 5 or 20 ms (``hold_gil``, NOTE
[busy step]) or sleeps 5 ms (releasing it, as gpustep.py does). The photo
folder of inputs.py (varied JPEGs) is converted by fastdata's converter to
HDF5 at 64 px raw, 64 px jpeg and 224 px jpeg. Per file, each loader runs in
a fresh process (NOTE [fresh process per row] in fresh.py):

* fastdata ``make_loader`` defaults (``helper_process="auto"``: in-process
  threads, or the helper process once the loop computes, NOTE [auto
  helper] in batchloader.py);
* fastdata in process: ``helper_process=False`` (threads in this process);
* fastdata ``num_workers=2`` (--workers);
* fastdata one worker of threads: ``num_workers=1, threads=<usable cores>``;
* fastdata ``helper_process=True`` (its threads decode into shared slots
  this process maps without a copy, NOTE [helper process] in helper.py);
* torch ``DataLoader``, 2 workers, over the fastdata dataset as a plain
  map-style dataset (its ``__getitems__``, then torch's default collate);
* SPDL (``spdl.pipeline.PipelineBuilder``) and torchdata.nodes
  (``ParallelMapper``, threads), where installed: batches of indices piped
  through ``read_batch(indices, threads=1)`` on <usable cores> threads, the
  batch-level stage SPDL's docs recommend (one task per batch, decoding off
  the GIL), in input order, 2 batches buffered.

NOTE [step rate kept]: each loader's process times, in turn, round after
round and for every step: the loop alone on a batch already in memory, then
the loop fed by its loader (NOTE [interleaved rates] in
fastdata/measure/engine.py). The kept share is the loader's steps/s over the
loop alone's from the same round, so a process's own speed (NOTE [process
to process]) cancels; rows are medians of rounds. Every loader reads one
endless stream of shuffled batches (benchmarks/samplers.py StreamBatches),
so no epoch boundary restarts its read-ahead. Before each loop-alone pass
the process waits until it and its children are idle (``IDLE_SHARE``), the
loader's buffers refilled; the loader pass then runs ``UNTIMED_STEPS``
untimed steps, which drain those buffers, before the timed steps. The
timed part runs at least ``MIN_TIMED_STEPS`` steps and ``min_seconds``.

NOTE [cpu of a row]: CPU seconds per 1,000 images are the CPU time of the
measuring process, all its threads (``time.process_time``), plus the user +
system time of its live child processes (workers, the helper: psutil
``cpu_times``, in 10 ms clock ticks) over the timed steps. "all" counts
the step too, and is what the target compares; "loader" subtracts the same
number of steps of the loop alone measured just before (its CPU per step),
a difference of two noisy figures where the loader's share is small.

The ceiling (jpeg): a separate fresh process times, in turn with the loop
alone, ``read_batch(threads=1)`` over the same batches: one core's decode
rate. The spare cores' rate (usable cores - 1 beside a GIL-holding step, all
beside a sleeping one) over the loop's images/s, at most 1, is the share of
the loop's rate the data can allow.
"""

import statistics
import time

from benchmarks import inputs
from fastdata.measure.engine import touch
from fastdata.measure.machine import installed_version
from fastdata.measure.tables import markdown_table

STEPS = (("hold", 2), ("hold", 5), ("hold", 20), ("sleep", 5))  # (kind, milliseconds)
FILES = (("64px raw", 64, "raw"), ("64px jpeg", 64, "jpeg"), ("224px jpeg", 224, "jpeg"))
FASTDATA = ("fastdata defaults", "fastdata in process", "fastdata workers", "fastdata 1 worker x threads",
            "fastdata helper_process")
LOADERS = (*FASTDATA, "torch DataLoader", "SPDL", "torchdata.nodes")
PEERS = {"SPDL": "spdl", "torchdata.nodes": "torchdata"}  # loader -> the package it needs
PY_OPS = 30  # Python additions per round of hold_gil, beside 3 torch calls (NOTE [busy step])
UNTIMED_STEPS = 10  # more than any row buffers (torch: 2 workers x prefetch 2; SPDL: 2 in the sink + in flight)
MIN_TIMED_STEPS = 10  # a data-bound 224 px jpeg step is ~0.1 s on 2 cores: a pass of ~1 s
IDLE_SHARE = 0.1  # of one core: a decoding row uses 1-2 cores; idle loaders measured 0.000-0.003 here
IDLE_WINDOW = 0.1  # seconds per idle check
IDLE_WAIT_MAX = 10.0  # seconds; past it the pass starts anyway and ``busy_starts`` counts it
RAW_KEPT_MIN = 0.95  # target: 64 px raw, 5 ms GIL-holding step, make_loader defaults
CEILING_SHARE_MIN = 0.9  # target: jpeg, best fastdata mode's kept share over the ceiling


# ---------------------------------------------------------------- the step


def hold_gil(units):
    """Run ``units`` rounds of torch calls on a tiny tensor and Python additions: a step that holds the GIL.

    NOTE [busy step]: a step's Python and torch calls need the GIL
    throughout. Tiny torch kernels do not keep it: each ``add`` or ``view``
    releases the GIL for its dispatch, and a waiting thread takes it there
    (a view/add/view round with 300 Python additions, 5 ms alone, took
    14-111 ms beside a thread counting in Python; 3,000 ``add`` alone let
    it count at 0.75 of its rate beside a sleep). So each round is three
    torch calls on a 4-element tensor that keep the GIL (size, numel, dim)
    and ``PY_OPS`` Python additions. Measured on 2 idle cores, a thread
    counting in Python beside it counted at 0.00 / 0.57 / 0.49 of its rate
    beside a sleep of the same length for 2 / 5 / 20 ms steps (pure Python:
    0.00 / 0.00 / 0.44; medians of 9): the waiting thread gets the GIL at
    the 5 ms switch interval, as beside any Python. The tests check the hold
    below the switch interval. Returns the sum, so nothing is optimized away.
    """
    import torch

    tensor, total = torch.zeros(4), 0
    for _ in range(units):
        total += tensor.size(0) + tensor.numel() + tensor.dim()  # 4 + 4 + 1: calls that keep the GIL
        for j in range(PY_OPS):
            total += j
    return total


def calibrate(seconds, rounds=5):
    """Return the ``hold_gil`` units that take ``seconds`` here alone (the median of ``rounds`` timings)."""
    units = 16
    for _ in range(3):  # rescale from the measured time per unit until it settles
        per_unit = statistics.median(_timed(hold_gil, units) for _ in range(rounds)) / units
        units = max(1, round(seconds / per_unit))
    return units


def calibrate_steps(steps):
    """Return ``{step name: hold_gil units}`` for every GIL-holding step of ``steps`` (run in a fresh process)."""
    return {step_name(kind, ms): calibrate(ms / 1e3) for kind, ms in steps if kind == "hold"}


def step_name(kind, ms):
    return f"{'holds GIL' if kind == 'hold' else 'sleeps'} {ms} ms"


def make_step(kind, ms, units):
    """Return the step function: ``hold_gil(units)``, or a sleep of ``ms``."""
    if kind == "hold":
        return lambda: hold_gil(units)
    return lambda: time.sleep(ms / 1e3)


def _timed(fn, *args):
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


# ---------------------------------------------------------------- loaders


def open_loader(name, dataset, sampler, workers):
    """Return ``(iterator of batches, close)`` of loader ``name`` over ``dataset`` in ``sampler``'s order."""
    from fastdata import make_loader
    from fastdata._cpu import usable_cpus
    from fastdata.measure.engine import close_loader

    cores = usable_cpus()
    if name.startswith("fastdata"):
        options = {"fastdata defaults": {}, "fastdata in process": {"helper_process": False},
                   "fastdata workers": {"num_workers": workers},
                   "fastdata 1 worker x threads": {"num_workers": 1, "threads": cores},
                   "fastdata helper_process": {"helper_process": True}}[name]
        loader = make_loader(dataset, batch_sampler=sampler, **options)
        return iter(loader), lambda: close_loader(loader)
    if name == "torch DataLoader":
        from torch.utils.data import DataLoader

        # the fastdata dataset as a plain map-style dataset: torch calls its __getitems__, then collates
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                            persistent_workers=True, prefetch_factor=2)
        return iter(loader), lambda: close_loader(loader)

    def read(indices):
        return dataset.read_batch(indices, threads=1)

    if name == "SPDL":
        from spdl.pipeline import PipelineBuilder

        pipeline = (PipelineBuilder().add_source(sampler).pipe(read, concurrency=cores, output_order="input")
                    .add_sink(2).build(num_threads=cores))
        pipeline.start()
        return pipeline.get_iterator(), pipeline.stop
    if name == "torchdata.nodes":
        from torchdata.nodes import IterableWrapper, Loader, ParallelMapper, Prefetcher

        mapper = ParallelMapper(IterableWrapper(sampler), read, num_workers=cores, method="thread")
        return iter(Loader(Prefetcher(mapper, prefetch_factor=2))), lambda: None  # daemon threads end with it
    raise ValueError(f"unknown loader {name!r}")


# ---------------------------------------------------------------- CPU time


class ProcessTree:
    """CPU seconds (user + system) of this process and its live children; see NOTE [cpu of a row]."""

    def __init__(self):
        import psutil

        self._me = psutil.Process()
        self.refresh()

    def refresh(self):
        """Look for children again (a loader's workers start on its first batch)."""
        self._procs = [self._me, *self._me.children(recursive=True)]

    def seconds(self):
        import psutil

        total = time.process_time()  # this process at the clock's resolution; children in clock ticks
        for proc in self._procs[1:]:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def wait_idle(self):
        """Wait until the tree used under ``IDLE_SHARE`` of a core over ``IDLE_WINDOW``; return whether it did."""
        deadline = time.perf_counter() + IDLE_WAIT_MAX
        while time.perf_counter() < deadline:
            before = self.seconds()
            time.sleep(IDLE_WINDOW)
            if self.seconds() - before < IDLE_SHARE * IDLE_WINDOW:
                return True
        return False


# ---------------------------------------------------------------- passes


def loop_alone(step, batch, min_seconds, tree):
    """Run the loop on ``batch`` (already in memory) for ``min_seconds``; return ``(steps/s, CPU s per step)``."""
    count, cpu, started = 0, tree.seconds(), time.perf_counter()
    while count < MIN_TIMED_STEPS or time.perf_counter() - started < min_seconds:
        touch(batch[0])  # the same touch as the fed loop
        step()
        count += 1
    seconds = time.perf_counter() - started
    return count / seconds, (tree.seconds() - cpu) / count


def loop_fed(step, batches, min_seconds, tree):
    """Run the loop on ``batches`` (see NOTE [step rate kept]); return steps/s, wait share, CPU s, images."""
    for _ in range(UNTIMED_STEPS):
        touch(next(batches)[0])
        step()
    tree.refresh()  # a process the loader started meanwhile counts too (NOTE [auto helper] in batchloader.py)
    count, images, wait, cpu, started = 0, 0, 0.0, tree.seconds(), time.perf_counter()
    while count < MIN_TIMED_STEPS or time.perf_counter() - started < min_seconds:
        before = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - before
        touch(batch[0])
        step()
        count, images = count + 1, images + len(batch[0])
    seconds = time.perf_counter() - started
    return {"steps_per_s": count / seconds, "wait_share": wait / seconds, "cpu_seconds": tree.seconds() - cpu,
            "images": images, "steps": count}


def measure_loader(spec, setup):
    """Time loader ``spec["loader"]`` against the loop alone, every step, in turn (run in a fresh process)."""
    import torch

    from benchmarks.samplers import StreamBatches
    from fastdata import open_dataset

    torch.set_num_threads(1)  # the step's tiny ops; the loaders choose their own threads
    dataset = open_dataset(spec["path"])
    sampler = StreamBatches(len(dataset), setup["batch_size"], seed=setup["seed"])
    batches, close = open_loader(spec["loader"], dataset, sampler, setup["workers"])
    tree, steps = ProcessTree(), _steps(setup)
    try:
        batch = [t.clone() for t in next(batches)[:2]]  # the loop alone's batch, holding no loader buffer
        tree.refresh()
        samples, busy_starts = {name: [] for name in steps}, 0
        for _ in range(setup["rounds"]):
            for name, step in steps.items():
                busy_starts += not tree.wait_idle()
                alone, alone_cpu = loop_alone(step, batch, setup["min_seconds"], tree)
                fed = loop_fed(step, batches, setup["min_seconds"], tree)
                samples[name].append({**fed, "alone_steps_per_s": alone, "alone_cpu_per_step": alone_cpu,
                                      "kept": fed["steps_per_s"] / alone})
    finally:
        close()
    return {"loader": spec["loader"], "file": spec["file"], "busy_starts": busy_starts,
            "steps": {name: summarize(passes) for name, passes in samples.items()}}


def summarize(passes):
    """Return a step's figures over its rounds: median kept share and wait, CPU per 1,000 images."""
    images = sum(p["images"] for p in passes)
    cpu_all = sum(p["cpu_seconds"] for p in passes)
    cpu_loop = sum(p["alone_cpu_per_step"] * p["steps"] for p in passes)
    return {"kept": statistics.median(p["kept"] for p in passes), "kept_rounds": [p["kept"] for p in passes],
            "wait_share": statistics.median(p["wait_share"] for p in passes),
            "steps_per_s": statistics.median(p["steps_per_s"] for p in passes),
            "alone_steps_per_s": statistics.median(p["alone_steps_per_s"] for p in passes),
            "cpu_per_1k_all": 1e3 * cpu_all / images, "cpu_per_1k_loader": 1e3 * (cpu_all - cpu_loop) / images}


def measure_ceiling(spec, setup):
    """Time the loop alone and ``read_batch(threads=1)`` in turn (run in a fresh process); return the ceilings."""
    import torch

    from benchmarks.samplers import StreamBatches
    from fastdata import open_dataset
    from fastdata._cpu import usable_cpus

    torch.set_num_threads(1)
    dataset = open_dataset(spec["path"])
    stream = iter(StreamBatches(len(dataset), setup["batch_size"], seed=setup["seed"]))
    batch = dataset.read_batch(next(stream), threads=1)
    tree, steps, cores = ProcessTree(), _steps(setup), usable_cpus()
    rounds = {name: [] for name in steps}
    for _ in range(setup["rounds"]):
        for name, step in steps.items():
            alone, _ = loop_alone(step, batch, setup["min_seconds"], tree)
            decode = _decode_rate(dataset, stream, setup["min_seconds"])
            spare = cores if name.startswith("sleeps") else max(1, cores - 1)
            rounds[name].append({"alone": alone, "decode": decode,
                                 "ceiling": min(1.0, spare * decode / (alone * len(batch[0])))})
    return {"file": spec["file"], "cores": cores,
            "steps": {name: {"ceiling": statistics.median(r["ceiling"] for r in rs),
                             "alone_steps_per_s": statistics.median(r["alone"] for r in rs),
                             "decode_images_per_s": statistics.median(r["decode"] for r in rs)}
                      for name, rs in rounds.items()}}


def _decode_rate(dataset, stream, min_seconds):
    """Return the images/s of ``read_batch(threads=1)`` over batches of ``stream`` for ``min_seconds``."""
    images, started = 0, time.perf_counter()
    while not images or time.perf_counter() - started < min_seconds:
        images += len(dataset.read_batch(next(stream), threads=1)[0])
    return images / (time.perf_counter() - started)


def _steps(setup):
    """Return ``{step name: step function}`` of ``setup["steps"]``, in order."""
    return {step_name(kind, ms): make_step(kind, ms, setup["units"].get(step_name(kind, ms)))
            for kind, ms in setup["steps"]}


# ---------------------------------------------------------------- the section


def peer_missing(name):
    """Return why loader ``name`` cannot run here ("not installed: ..."), or None."""
    package = PEERS.get(name)
    if package is None or installed_version(package):
        return None
    return f"not installed: pip install -c constraints.txt {package}"


def run(config, fresh):
    """Run the busy-step section; return rows, ceilings, targets and text."""
    setup = {"batch_size": config["batch_size"], "workers": config["workers"], "seed": config["seed"],
             "min_seconds": config["min_seconds"], "rounds": config["repeats"], "steps": STEPS}
    setup["units"] = fresh.run(calibrate_steps, STEPS)
    rows, ceilings, missing = [], {}, {name: peer_missing(name) for name in LOADERS}
    for file, size, storage in FILES:
        path = inputs.packed_images(config["workdir"], config["num_images"], size, config["seed"])[f"hdf5-{storage}"]
        spec = {"file": file, "path": path}
        if storage == "jpeg":
            ceilings[file] = fresh.run(measure_ceiling, spec, setup)
        for name in LOADERS:
            if missing[name] is None:
                rows.append(fresh.run(measure_loader, {**spec, "loader": name}, setup))
                print(f"  busy step {file}, {name}: kept " + ", ".join(
                    f"{step} {s['kept']:.2f}" for step, s in rows[-1]["steps"].items()), flush=True)
    versions = {package: installed_version(package) for package in ("torch", *PEERS.values())}
    result = {"steps": [step_name(kind, ms) for kind, ms in STEPS], "rows": rows, "ceilings": ceilings,
              "missing": {name: why for name, why in missing.items() if why}, "units": setup["units"],
              "batch_size": setup["batch_size"], "versions": versions, "num_images": config["num_images"]}
    result["targets"] = targets_of(result)
    result["text"] = text(result)
    return result


# ---------------------------------------------------------------- targets and text


def targets_of(result):
    """Return the issue's bars as targets: raw kept share, jpeg against the ceiling and torch, CPU against SPDL."""
    figures = {(row["file"], row["loader"]): row["steps"] for row in result["rows"]}
    targets = []
    raw = figures.get(("64px raw", "fastdata defaults"), {}).get(step_name("hold", 5))
    if raw:
        targets.append({"name": "busy step 64px raw, GIL held 5 ms: make_loader defaults' step rate kept",
                        "value": raw["kept"], "threshold": RAW_KEPT_MIN,
                        "info": f"{raw['steps_per_s']:,.0f} vs {raw['alone_steps_per_s']:,.0f} steps/s alone"})
    for file, ceiling in result["ceilings"].items():
        for step, bound in ceiling["steps"].items():
            mode, best = _best_fastdata(figures, file, step)
            if best is None:
                continue
            targets.append({"name": f"busy step {file}, {step}: best fastdata mode's kept share / the ceiling",
                            "value": best["kept"] / bound["ceiling"], "threshold": CEILING_SHARE_MIN,
                            "info": f"{mode} {best['kept']:.2f}; ceiling {bound['ceiling']:.2f} "
                                    f"({bound['decode_images_per_s']:,.0f} img/s on 1 core)"})
            torch_row = figures.get((file, "torch DataLoader"), {}).get(step)
            if torch_row:
                targets.append({"name": f"busy step {file}, {step}: best fastdata mode / torch DataLoader (kept)",
                                "value": best["kept"] / torch_row["kept"], "threshold": 1.0,
                                "info": f"{mode} {best['kept']:.2f} vs {torch_row['kept']:.2f}"})
    for file, _, _ in FILES:
        step = step_name("hold", 5)
        spdl = figures.get((file, "SPDL"), {}).get(step)
        mode, best = _best_fastdata(figures, file, step)
        if spdl and best:
            targets.append({"name": f"busy step {file}, {step}: best fastdata mode's CPU / SPDL's (all, per image)",
                            "value": best["cpu_per_1k_all"] / spdl["cpu_per_1k_all"], "threshold": 1.0,
                            "at_least": False,
                            "info": f"{mode} {best['cpu_per_1k_all']:.3f} vs SPDL {spdl['cpu_per_1k_all']:.3f} CPU s "
                                    f"per 1,000 images (loader's share: {best['cpu_per_1k_loader']:.3f} vs "
                                    f"{spdl['cpu_per_1k_loader']:.3f})"})
    return targets


def _best_fastdata(figures, file, step):
    """Return ``(loader name, its figures)`` of the fastdata mode keeping most of the step rate, or (None, None)."""
    modes = [(name, figures.get((file, name), {}).get(step)) for name in FASTDATA]
    modes = [mode for mode in modes if mode[1] is not None]
    return max(modes, key=lambda mode: mode[1]["kept"]) if modes else (None, None)


def table(result, file):
    """Return the Markdown table of ``file``: the loop alone, the ceiling, then one line per loader and step."""
    body = []
    ceiling = result["ceilings"].get(file)
    for step in result["steps"]:
        alone = [row["steps"][step]["alone_steps_per_s"] for row in result["rows"] if row["file"] == file]
        if alone:
            body.append((step, "loop alone (batch in memory)", "1.00", "-", f"{statistics.median(alone):,.0f}",
                         "-", "-"))
        if ceiling:
            bound = ceiling["steps"][step]
            body.append((step, f"ceiling: spare cores at {bound['decode_images_per_s']:,.0f} img/s each",
                         f"{bound['ceiling']:.2f}", "-", "-", "-", "-"))
        for row in result["rows"]:
            if row["file"] == file:
                s = row["steps"][step]
                body.append((step, row["loader"], f"{s['kept']:.2f}", f"{s['wait_share']:.1%}",
                             f"{s['steps_per_s']:,.0f} / {s['alone_steps_per_s']:,.0f}", f"{s['cpu_per_1k_all']:.3f}",
                             f"{s['cpu_per_1k_loader']:.3f}"))
    body += [("-", f"{name}: {why}", "-", "-", "-", "-", "-") for name, why in result["missing"].items()]
    headers = ["step", "loader", "step rate kept", "data wait", "steps/s fed / alone", "CPU s / 1k img (all)",
               "CPU s / 1k img (loader)"]
    return markdown_table(headers, body, "llrrrrr")


def text(result):
    """Return the section's Markdown: one table per file and how to read it."""
    versions = ", ".join(f"{name} {version or 'not installed'}" for name, version in result["versions"].items())
    units = ", ".join(f"{name}: {count:,} rounds" for name, count in result["units"].items())
    parts = [f"## Busy step: the step's rate beside each loader ({result['num_images']:,} photos, batch "
             f"{result['batch_size']}, endless shuffled stream)", "",
             "Step rate kept: steps/s fed by the loader over the loop alone's, in turn in the same process, median "
             "of rounds (NOTE [step rate kept] in benchmarks/sections/busystep.py). Data wait: time in next() over "
             "the timed steps. CPU: user + system seconds of the process and its children per 1,000 images; "
             "loader = all minus the loop alone's (NOTE [cpu of a row]). Ceiling (jpeg): the spare cores' "
             "read_batch(threads=1) rate over the loop's images/s, at most 1.", "",
             f"GIL-holding steps (hold_gil, calibrated alone): {units}. Versions: {versions}."]
    for file, _, _ in FILES:
        if any(row["file"] == file for row in result["rows"]):
            parts += ["", f"### {file}", "", table(result, file)]
    busy = [f"{row['file']} {row['loader']}: {row['busy_starts']}" for row in result["rows"] if row["busy_starts"]]
    if busy:
        parts += ["", "Passes started before the process went idle: " + ", ".join(busy) + "."]
    return "\n".join(parts)
