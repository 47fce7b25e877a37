"""Augmentation section: batched, seeded augmentation against the same augmentations applied per sample.

Run through benchmarks/run.py (``--only augment``). Each recipe takes a
batch of ``batch_size`` (256) uint8 images [B, 3, S, S] in memory, as a
packed raw file returns them, to normalized float32 at the output size:

* cifar: 32 px, RandomCrop(32, padding=4) with a horizontal flip;
* imagenet-64: 80 px to 64 px, RandomResizedCrop (torchvision's scale and
  ratio) with a horizontal flip;
* imagenet-224: 256 px to 224 px, the same.

Rows per recipe, on CPU, at one torch thread (see NOTE [one thread]):

* eval: no augmentation, CenterCrop to the output size + Normalize (the
  conversion to float that any pipeline pays);
* batched: fastdata.loading.augment, Compose(crop, Normalize): whole-batch
  ops with per-sample parameters from sample_uniforms;
* per-sample: torchvision-style, a Python loop per image: its parameters
  drawn with ``random`` (get_params' algorithm), slice, ``interpolate``
  (bilinear, no antialias) for RRC, flip, then ``x / 255`` and Normalize, and
  ``torch.stack``; the same work, one image at a time;
* batched again with a torch thread per usable CPU.

A warm-up batch, then timed batches (each a new epoch, so new draws) until
``repeats`` and ``min_seconds``; the row's figure is the median batch. The
process's CPU time per batch is kept too: at one thread it is the row's
cost with other jobs' time left out (on a busy machine wall time is not).
Each row runs in a fresh process (NOTE [fresh process per row] in fresh.py).
--quick uses batches of 32 and 40 px to 32 px for the RRC recipes.
"""

import math
import random
import statistics
import time

from fastdata._cpu import usable_cpus
from fastdata.measure.tables import markdown_table

RECIPES = (("cifar", 32, 32), ("imagenet-64", 80, 64), ("imagenet-224", 256, 224))
QUICK_RECIPES = (("cifar", 32, 32), ("imagenet-64", 40, 32))
QUICK_BATCH = 32
KINDS = ("eval", "batched", "per-sample")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
BATCHED_VS_PER_SAMPLE = 1.0  # target: on one core, batching costs no throughput (its gain is fewer, larger ops)


def run(config, fresh):
    """Run the augmentation section; return rows, targets, table and text."""
    recipes = QUICK_RECIPES if config["quick"] else RECIPES
    setup = {"batch_size": QUICK_BATCH if config["quick"] else config["batch_size"], "seed": config["seed"],
             "repeats": config["repeats"], "min_seconds": config["min_seconds"]}
    rows = [fresh.run(measure_row, recipe, kind, setup, threads) for recipe in recipes for kind, threads in kinds()]
    results = {"batch_size": setup["batch_size"], "rows": rows, "targets": targets_of(rows), "table": table(rows)}
    results["text"] = text(results)
    return results


def kinds():
    """Return the rows of a recipe: (kind, torch threads); see NOTE [one thread]."""
    cpus = usable_cpus()
    return [(kind, 1) for kind in KINDS] + ([("batched", cpus)] if cpus > 1 else [])


# NOTE [one thread]: at 32 and 64 px the per-sample loop's ops (3,072 to
# 12,288 elements an image) are under torch's 32,768-element grain, so the
# loop runs on one core whatever torch.get_num_threads() says, while the
# batched ops split over threads. So every kind is measured at 1 thread
# (as in a DataLoader worker, which torch sets to 1 thread), and the
# batched pipeline again with a thread per usable CPU. On a busy machine the
# threaded row suffers most: with 2 threads on 2 cores shared with 3 other
# jobs, copying 786 KB (256 x 3 x 32 x 32 uint8) took 3.8 ms against 0.39 ms
# at 1 thread, as one of the 2 threads waits for a core.


def measure_row(recipe, kind, setup, threads):
    """Time one pipeline over batches of uint8 images in this process at ``threads`` torch threads; return its row."""
    import torch

    name, stored, size = recipe
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(setup["seed"])
    images = torch.randint(0, 256, (setup["batch_size"], 3, stored, stored), dtype=torch.uint8, generator=generator)
    indices = torch.arange(setup["batch_size"], dtype=torch.int64).numpy()
    pipeline = pipeline_of(name, kind, size)
    pipeline(images, indices, 0, setup["seed"])  # warm-up
    seconds, cpu_seconds = [], []
    while len(seconds) < setup["repeats"] or sum(seconds) < setup["min_seconds"]:
        started, cpu_started = time.perf_counter(), time.process_time()
        out = pipeline(images, indices, len(seconds) + 1, setup["seed"])
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - cpu_started)
    assert out.shape == (setup["batch_size"], 3, size, size) and out.dtype == torch.float32
    batch = statistics.median(seconds)
    print(f"  augment {name} {kind} ({threads} threads): {setup['batch_size'] / batch:,.0f} samples/s", flush=True)
    return {"key": f"{name} {kind} {threads}", "recipe": name, "kind": kind, "threads": threads, "stored": stored,
            "size": size,
            "batch_size": setup["batch_size"], "batches": len(seconds), "batch_ms": batch * 1e3,
            "cpu_ms": statistics.median(cpu_seconds) * 1e3,
            "samples_per_s": setup["batch_size"] / batch}


def pipeline_of(name, kind, size):
    """Return ``pipeline(images, indices, epoch, seed) -> float32 batch`` for a recipe and a row kind."""
    from fastdata.loading import augment

    normalize = augment.Normalize(MEAN, STD)
    if kind == "eval":
        return augment.Compose(augment.CenterCrop(size), normalize)
    crop = augment.RandomCrop(size, padding=4) if name == "cifar" else augment.RandomResizedCrop(size)
    if kind == "batched":
        return augment.Compose(crop, normalize)
    return PerSample(crop, size)


class PerSample:
    """The recipe torchvision-style: a loop of per-image tensor ops, then ``torch.stack``."""

    def __init__(self, crop, size):
        import torch

        self.crop, self.size = crop, size
        self.mean, self.std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)

    def __call__(self, images, indices, epoch, seed):
        import torch
        import torch.nn.functional as F

        draws = random.Random(seed * 1_000_003 + epoch)
        rows = []
        for image in images:
            if hasattr(self.crop, "padding"):  # RandomCrop: pad, a uniform corner
                image = F.pad(image, (self.crop.padding,) * 4)
                top, left = (draws.randint(0, side - self.size) for side in image.shape[1:])
                image = image[:, top:top + self.size, left:left + self.size].float()
            else:
                top, left, h, w = get_params(image.shape[1], image.shape[2], self.crop.scale, self.crop.ratio, draws)
                crop = image[None, :, top:top + h, left:left + w].float()
                image = F.interpolate(crop, size=(self.size, self.size), mode="bilinear", align_corners=False,
                                      antialias=False)[0]
            if draws.random() < 0.5:
                image = image.flip(-1)
            rows.append((image / 255 - self.mean) / self.std)
        return torch.stack(rows)


def get_params(height, width, scale, ratio, draws):
    """Return torchvision's RandomResizedCrop.get_params box (top, left, h, w), drawn from ``draws``."""
    area, log_ratio = height * width, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * draws.uniform(*scale)
        aspect_ratio = math.exp(draws.uniform(*log_ratio))
        w, h = round(math.sqrt(target_area * aspect_ratio)), round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            return draws.randint(0, height - h), draws.randint(0, width - w), h, w
    in_ratio = width / height  # the fallback: the centre crop, clamped to ratio
    h = round(width / ratio[0]) if in_ratio < ratio[0] else height
    w = round(height * ratio[1]) if in_ratio > ratio[1] else width
    return (height - h) // 2, (width - w) // 2, h, w


def targets_of(rows):
    """Return one target per recipe: the batched pipeline against the per-sample loop, both on one core."""
    rates = {(row["recipe"], row["kind"], row["threads"]): row["samples_per_s"] for row in rows}
    targets = []
    for recipe in dict.fromkeys(row["recipe"] for row in rows):
        batched, loop, plain = (rates[recipe, kind, 1] for kind in ("batched", "per-sample", "eval"))
        threaded = [f"; batched at {threads} threads: {rate:,.0f}" for (name, kind, threads), rate in rates.items()
                    if name == recipe and kind == "batched" and threads > 1]
        targets.append({"name": f"augmentation {recipe}: batched vs per-sample loop, samples/s on one core",
                        "value": batched / loop, "threshold": BATCHED_VS_PER_SAMPLE,
                        "info": f"{batched:,.0f} vs {loop:,.0f} samples/s; no augmentation {plain:,.0f}"
                                + "".join(threaded)})
    return targets


def table(rows):
    rates = {(row["recipe"], row["kind"], row["threads"]): row["samples_per_s"] for row in rows}
    body = []
    for row in rows:
        loop, plain = rates[row["recipe"], "per-sample", 1], rates[row["recipe"], "eval", 1]
        body.append((row["recipe"], f"{row['stored']} -> {row['size']}", row["kind"], row["threads"],
                     f"{row['samples_per_s']:,.0f}", f"{row['batch_ms']:.1f}", f"{row['cpu_ms']:.1f}",
                     f"{row['samples_per_s'] / loop:.2f}", f"{row['samples_per_s'] / plain:.2f}", row["batches"]))
    headers = ["recipe", "px", "pipeline", "threads", "samples/s", "ms per batch", "CPU ms per batch",
               "vs per-sample loop", "vs no augmentation", "batches"]
    return markdown_table(headers, body, "lllrrrrrrr")


def text(results):
    return "\n".join([f"## Augmentation (CPU, batches of {results['batch_size']} uint8 images to normalized float32)",
                      "", results["table"], "",
                      "eval: CenterCrop + Normalize; batched: fastdata.loading.augment (Compose(crop, Normalize)); "
                      "per-sample: the same recipe as a Python loop of tensor ops per image, then torch.stack.", ""])
