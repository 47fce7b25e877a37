"""Fused JPEG random-resized-crop: decoding each box at a DCT scale against decoding in full, then cropping.

Run through benchmarks/run.py (``--only fusedcrop``). The same stored JPEG
bytes (photos from inputs.py packed by the converter at 256 and 512 px a
side, jpeg storage, HDF5) go through torchvision-default random-resized-crop
boxes (fastdata.loading.augment.RandomResizedCrop: scale 0.08-1, ratio
3/4-4/3) to 224 and to 112 px, three ways, on 1 thread and on every core:

* fused: decode_jpeg_resized_crop, the box decoded at the smallest DCT scale
  that keeps it at least the output, then one Pillow bilinear resize;
* decode, then crop: decode_jpeg in full, then the same Pillow bilinear
  resize of the same box (the reference the tests compare against);
* read_batch(crop=): the fused decode as the loader runs it, through
  JpegImageDecoder's threads into the batch buffer.

The first two run each row on the same threads (a shared row counter, as
the decoder does) into one reused batch buffer, so only the decoding
differs. All rows of a size run in one process, in turn, round after round
(NOTE [interleaved rates] in fastdata/measure/engine.py); each figure is
the median of the rounds.

NOTE [cpu time of one thread]: on this 2-core VM, shared with other work,
the wall-clock rates of two methods doing the same work (256 px stored,
scale 1) came out 0.89x and 1.09x apart in one run. One-thread rows
therefore also give the calling thread's CPU time per image
(``time.thread_time``), which other processes barely move; the speedup
at one thread is the ratio of those, the all-core rows stay wall-clock.
"""

import itertools
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from benchmarks import inputs

STORED_SIZES = (256, 512)
OUTPUT_SIZES = (224, 112)
IMAGES = 256  # photos per epoch (--quick: 32)
ROUNDS = 5  # interleaved rounds (--quick: 1)
METHODS = ("fused", "decode, then crop", "read_batch(crop=)")
FUSED_VS_FULL = 1.0  # target where boxes decode at a reduced scale: less CPU than decoding in full, then cropping
REDUCED_SCALE = 0.9  # pairs whose mean DCT scale is below this decode at a reduced scale; the others do equal work


def jpeg_file(config, stored):
    """Return the HDF5 jpeg file of the section's photos packed at ``stored`` px, converting it unless cached."""
    from fastdata import convert_imagefolder
    from fastdata.formats import read_packed

    count = 32 if config["quick"] else IMAGES
    root, _ = inputs.prepare_imagefolder(os.path.join(config["workdir"], "fusedcrop"), count, config["seed"])
    path = os.path.join(config["workdir"], "fusedcrop", f"{count}-photos-{stored}px-jpeg.h5")
    try:
        metadata = read_packed(path)[1]
        cached = metadata["num_samples"] == count and metadata["sample_shape"] == [3, stored, stored]
    except (OSError, ValueError, KeyError):
        cached = False
    if not cached:
        convert_imagefolder(root, path, size=stored, storage="jpeg", overwrite=True, progress=False)
    return path


def measure(path, setup):
    """Time every (output size, threads, method) on the file at ``path`` in this process; return the rows."""
    import numpy as np

    from fastdata import open_dataset
    from fastdata._cpu import usable_cpus
    from fastdata.formats import read_packed
    from fastdata.loading.augment import RandomResizedCrop
    from fastdata.measure.engine import interleaved_rates

    columns, metadata = read_packed(path)
    rows = [bytes(columns.samples[columns.offsets[i] : columns.offsets[i + 1]]) for i in range(columns.num_samples)]
    dataset, pool = open_dataset(path), ThreadPoolExecutor(max(1, usable_cpus() - 1))
    epoch_fns, cases = {}, []
    for output, threads in itertools.product(OUTPUT_SIZES, sorted({1, usable_cpus()})):
        rrc = RandomResizedCrop(output)
        boxes = [rrc.boxes(setup["seed"], epoch, np.arange(len(rows)), *_sizes(rows)) for epoch in range(4)]
        out = np.empty((len(rows), output, output, 3), np.uint8)
        key = (output, threads)
        epoch_fns[(*key, "fused")] = partial(_epoch, _fused, rows, boxes, out, threads, pool)
        epoch_fns[(*key, "decode, then crop")] = partial(_epoch, _decode_then_crop, rows, boxes, out, threads, pool)
        epoch_fns[(*key, "read_batch(crop=)")] = partial(_read_epoch, dataset, rrc, setup["seed"], len(rows),
                                                         setup["batch_size"], threads)
        cases.append((key, boxes[0]))
    cpu = {name: [] for name in epoch_fns}  # see NOTE [cpu time of one thread]
    rates = interleaved_rates({name: _counting(fn, cpu[name]) for name, fn in epoch_fns.items()}, setup["rounds"],
                              setup["min_seconds"])
    results = []
    for (output, threads), boxes in cases:
        scales = [_scale_of(box, output) for box in boxes.tolist()]
        for method in METHODS:
            per_round = rates[(output, threads, method)]
            cpu_ms = statistics.median(cpu[(output, threads, method)][1:])  # after the warm-up epoch
            results.append({"stored": metadata["sample_shape"][-1], "output": output, "threads": threads,
                            "method": method, "samples_per_s": statistics.median(per_round), "rates": per_round,
                            "cpu_ms": cpu_ms if threads == 1 else None, "mean_scale": statistics.mean(scales),
                            "num_samples": len(rows)})
    pool.shutdown()
    return results


def _sizes(rows):
    """Return int64 ``(heights, widths)`` from the rows' JPEG headers."""
    import numpy as np

    from fastdata.codecs.images import jpeg_size

    sizes = np.array([jpeg_size(data) for data in rows], np.int64).reshape(-1, 2)
    return sizes[:, 0], sizes[:, 1]


def _scale_of(box, output):
    from fastdata.codecs.images import dct_scale

    return dct_scale(box, (output, output)) / 8


def _counting(epoch, cpu):
    """Return an epoch function that runs ``epoch`` with the next epoch number and returns the samples it did.

    Appends to ``cpu`` this thread's CPU milliseconds per sample of each epoch.
    """
    counter = itertools.count()

    def run():
        began = time.thread_time()
        count = epoch(next(counter))
        cpu.append((time.thread_time() - began) * 1e3 / count)
        return count

    return run


def _epoch(decode_row, rows, boxes, out, threads, pool, epoch):
    """Decode every row with ``decode_row(data, box, out_row)`` on ``threads`` threads (this one included)."""
    boxes = boxes[epoch % len(boxes)].tolist()  # a fresh draw each epoch, as in training
    counter = itertools.count()

    def loop():
        for row in counter:
            if row >= len(rows):
                return
            decode_row(rows[row], boxes[row], out[row])

    helpers = [pool.submit(loop) for _ in range(threads - 1)]
    loop()
    for helper in helpers:
        helper.result()
    return len(rows)


def _fused(data, box, out):
    from fastdata.codecs.images import decode_jpeg_resized_crop

    decode_jpeg_resized_crop(data, box, out.shape[:2], out)


def _decode_then_crop(data, box, out):
    import numpy as np
    from PIL import Image

    from fastdata.codecs.images import decode_jpeg

    top, left, height, width = box
    full = Image.fromarray(decode_jpeg(data), "RGB")
    resized = full.resize((out.shape[1], out.shape[0]), Image.Resampling.BILINEAR,
                          box=(left, top, left + width, top + height))
    out[...] = np.asarray(resized)


def _read_epoch(dataset, rrc, seed, count, batch_size, threads, epoch):
    """Read ``count`` samples in shuffled batches through ``read_batch(crop=...)``; return how many."""
    import numpy as np

    from fastdata.loading.decoders import ResizedCrop

    order = np.random.default_rng([seed, epoch]).permutation(count)
    for start in range(0, count, batch_size):
        indices = np.sort(order[start : start + batch_size])
        crop = ResizedCrop(rrc.size, partial(rrc.boxes, seed, epoch, indices))
        dataset.read_batch(indices, crop=crop, threads=threads)
    return count


def speedups(rows):
    """Return one dict per (stored, output, threads): the fused decode against decoding in full, then cropping.

    ``speedup`` is the ratio of CPU time per image at one thread (see NOTE
    [cpu time of one thread]) and of wall-clock rates on more threads.
    """
    by_key = {(r["stored"], r["output"], r["threads"], r["method"]): r for r in rows}
    result = []
    for stored, output, threads in sorted({(r["stored"], r["output"], r["threads"]) for r in rows}):
        fused, full, loader = (by_key[stored, output, threads, method] for method in METHODS)
        wall = fused["samples_per_s"] / full["samples_per_s"]
        result.append({"stored": stored, "output": output, "threads": threads, "mean_scale": fused["mean_scale"],
                       "fused": fused["samples_per_s"], "decode_then_crop": full["samples_per_s"],
                       "read_batch": loader["samples_per_s"], "fused_cpu_ms": fused["cpu_ms"],
                       "decode_then_crop_cpu_ms": full["cpu_ms"], "read_batch_cpu_ms": loader["cpu_ms"],
                       "wall_speedup": wall, "speedup": full["cpu_ms"] / fused["cpu_ms"] if threads == 1 else wall,
                       "round_speedups": [a / b for a, b in zip(fused["rates"], full["rates"])]})
    return result


def targets_of(pairs):
    """Return a target per pair at one thread whose boxes mostly decode reduced: less CPU than decoding in full.

    Pairs at a mean scale near 1 do the same work both ways (their ratio is
    noise around 1, see NOTE [where the fused crop pays] in codecs/images.py);
    their figures are in the table.
    """
    return [{"name": f"fused RRC {p['stored']}px -> {p['output']}px, 1 thread: CPU time of decode-then-crop "
                     "over the fused decode's",
             "value": p["speedup"], "threshold": FUSED_VS_FULL, "at_least": True,
             "info": f"{p['fused_cpu_ms']:.2f} vs {p['decode_then_crop_cpu_ms']:.2f} ms per image; mean DCT scale "
                     f"{p['mean_scale']:.2f}; {p['fused']:,.0f} vs {p['decode_then_crop']:,.0f} img/s"}
            for p in pairs if p["threads"] == 1 and p["mean_scale"] < REDUCED_SCALE]


def table(pairs):
    from fastdata.measure.tables import markdown_table

    def ms(value):
        return "-" if value is None else f"{value:.2f}"

    body = [(p["stored"], p["output"], p["threads"], f"{p['mean_scale']:.2f}", f"{p['fused']:,.0f}",
             f"{p['decode_then_crop']:,.0f}", f"{p['read_batch']:,.0f}", ms(p["fused_cpu_ms"]),
             ms(p["decode_then_crop_cpu_ms"]), f"{p['speedup']:.2f}x") for p in pairs]
    headers = ["stored px", "output px", "threads", "mean DCT scale", "fused img/s", "decode, then crop img/s",
               "read_batch(crop=) img/s", "fused CPU ms/img", "decode, then crop CPU ms/img", "fused speedup"]
    return markdown_table(headers, body, "r" * len(headers))


def run(config, fresh):
    """Run the fused-crop section; return rows, speedups, targets and table."""
    setup = {"seed": config["seed"], "batch_size": min(config["batch_size"], 64 if config["quick"] else IMAGES),
             "rounds": 1 if config["quick"] else ROUNDS, "min_seconds": config["min_seconds"]}
    rows = []
    for stored in STORED_SIZES:
        path = jpeg_file(config, stored)
        print(f"-- fused crop: {stored}px stored", flush=True)
        rows += fresh.run(measure, path, setup)
    pairs = speedups(rows)
    for p in pairs:
        print(f"  {p['stored']}px -> {p['output']}px, {p['threads']} thread(s): fused {p['fused']:,.0f} img/s, "
              f"decode then crop {p['decode_then_crop']:,.0f} img/s ({p['speedup']:.2f}x)", flush=True)
    results = {"stored_sizes": list(STORED_SIZES), "output_sizes": list(OUTPUT_SIZES), "rows": rows, "pairs": pairs,
               "targets": targets_of(pairs), "table": table(pairs)}
    results["text"] = "\n".join([
        "## Fused JPEG random-resized-crop (CPU)", "", results["table"], "",
        "The same stored JPEGs, torchvision-default RandomResizedCrop boxes: fused (each box decoded at the "
        "smallest DCT scale of 1/8, 1/4, 1/2, 1 that keeps it at least the output, then one bilinear resize) "
        "against decoding in full, then the same resize of the same box. One-thread speedups are ratios of the "
        "calling thread's CPU time (NOTE [cpu time of one thread] in benchmarks/sections/fusedcrop.py); rows "
        "at a mean scale near 1 do the same work both ways.", ""])
    return results
