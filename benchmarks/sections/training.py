"""Training section: the example's training loop fed from a raw image folder and from packed files.

The loop is examples/train_resnet.py's (its ResNet, SGD and ``train_epoch``)
at its size: learnable synthetic shapes (make_learnable_imagefolder, sides
40-200 px, seven file kinds) at 32 px, batches of 64, on the CPU. Each row
runs the same number of steps on the same model, wrapped in
``fastdata.profile``, which reports img/s and the share of the loop spent
waiting for data (NOTE [data-bound fraction] in fastdata/measure/profiler.py):

* folder, 0 and 2 workers: a torch DataLoader over the image files, each
  sample decoded with Pillow, resized and centre-cropped to 32 px, padded by
  4 and randomly cropped and flipped, then normalized (per-sample tensor
  ops, as torchvision's transforms do);
* packed raw / jpeg: ``make_loader(..., device="cpu",
  augment=RandomCrop(32, padding=4), normalize=True)`` over the folder
  converted once to HDF5 (raw pixels, or JPEG re-encoded at quality 90);
* model only: the same steps on one batch already in memory, the loop's
  speed with no input pipeline at all.

NOTE [training rows]: the model computes on the same two cores that load
the data, so time lost to data shows twice: as waits in ``next()`` and as a
slower body (the loader's threads and workers take cores from the model's
kernels). The img/s against the model-only row is the fair comparison; the
data-wait share only shows the first part. A warm-up pass of a few steps
(worker start-up, first allocations) comes before the timed pass; each row
runs in a fresh process.
"""

import importlib.util
import os
import shutil
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "train_resnet.py")
NUM_CLASSES = 10
SIZE = 32
PADDING = 4
BATCH_SIZE = 64
WARMUP_STEPS = 3
STEPS = 100  # --quick: 10
IMAGES = 2000  # --quick: 200
PACKED_VS_FOLDER_MIN = 1.25  # target: packed raw trains 1.25x as fast as the faster folder row


def prepare(workdir, num_images, seed):
    """Return ``(root, {"raw": path, "jpeg": path})``: the synthetic shapes and their packed files, made once."""
    from fastdata import convert_imagefolder
    from fastdata.measure.synthetic import make_learnable_imagefolder

    per_class = max(1, num_images // NUM_CLASSES)
    name = f"shapes-{NUM_CLASSES}x{per_class}-seed{seed}"
    folder = os.path.join(workdir, "training")
    root = os.path.join(folder, name)
    if not os.path.exists(root + ".done"):  # written last: a half-made folder is made again
        shutil.rmtree(root, ignore_errors=True)
        make_learnable_imagefolder(root, NUM_CLASSES, per_class, seed=seed)
        open(root + ".done", "w").close()
    files = {}
    for storage in ("raw", "jpeg"):
        files[storage] = os.path.join(folder, f"{name}-{SIZE}px-{storage}.h5")
        if not os.path.exists(files[storage]):
            convert_imagefolder(root, files[storage], size=SIZE, storage=storage, progress=False)
    return root, files


def load_example():
    """Import examples/train_resnet.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_resnet", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FolderSamples:
    """Per-sample ImageFolder pipeline: Pillow decode, resize + centre crop, pad, random crop and flip, normalize.

    Items are ``(image float32 [3, size, size], label int)``; the random
    draws use torch's global generator, as torchvision's transforms do.
    """

    def __init__(self, paths, labels, size, mean, std):
        self.paths, self.labels, self.size = paths, labels, size
        self.mean, self.std = mean, std

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        import torch
        import torch.nn.functional as F

        from fastdata.measure.baselines import load_resized

        image = F.pad(torch.from_numpy(load_resized(self.paths[index], self.size)).permute(2, 0, 1), (PADDING,) * 4)
        top, left = torch.randint(0, 2 * PADDING + 1, (2,)).tolist()
        image = image[:, top:top + self.size, left:left + self.size]
        if torch.rand(()) < 0.5:
            image = image.flip(2)
        mean, std = torch.tensor(self.mean).view(3, 1, 1), torch.tensor(self.std).view(3, 1, 1)
        return (image.float() / 255 - mean) / std, int(self.labels[index])


def measure_row(spec, setup):
    """Run the example's loop for the warm-up and timed steps over one row's loader; return its dict."""
    import torch

    from fastdata import profile

    key, kind, option = spec
    example = load_example()
    torch.manual_seed(setup["seed"])
    loader = Epochs(_loader(kind, option, setup))
    model = example.ResNet(NUM_CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for steps in (WARMUP_STEPS, setup["steps"]):
        profiled = profile(loader, max_batches=steps)
        started = time.perf_counter()
        loss = example.train_epoch(model, profiled, optimizer, scheduler)
        seconds = time.perf_counter() - started
    report = profiled.report()
    if report.batches != setup["steps"]:
        raise RuntimeError(f"{key}: {report.batches} steps, expected {setup['steps']}")
    print(f"  training {key}: {report.samples_per_s:,.0f} img/s, data-wait {report.data_bound_fraction:.1%}",
          flush=True)
    return {"key": key, "kind": kind, "steps": report.batches, "batch_size": BATCH_SIZE, "seconds": seconds,
            "samples_per_s": report.samples_per_s, "data_wait": report.data_bound_fraction,
            "wait_seconds": report.wait_seconds, "body_seconds": report.body_seconds,
            "first_batch_seconds": report.first_batch_seconds, "loss": loss}


def _loader(kind, option, setup):
    """Return the row's iterable of ``(images float32 [64, 3, 32, 32], labels)`` batches."""
    import torch

    if kind == "memory":
        batch = (torch.randn(BATCH_SIZE, 3, SIZE, SIZE), torch.randint(0, NUM_CLASSES, (BATCH_SIZE,)))
        return [batch]
    if kind == "folder":
        from torch.utils.data import DataLoader

        dataset = FolderSamples(setup["paths"], setup["labels"], SIZE, setup["mean"], setup["std"])
        return DataLoader(dataset, BATCH_SIZE, shuffle=True, drop_last=True, num_workers=option,
                          persistent_workers=option > 0)
    from fastdata import make_loader, open_dataset
    from fastdata.loading.augment import RandomCrop

    return make_loader(open_dataset(option), BATCH_SIZE, shuffle=True, seed=setup["seed"], drop_last=True,
                       device="cpu", augment=RandomCrop(SIZE, padding=PADDING), normalize=True)


class Epochs:
    """Iterate ``loader`` epoch after epoch without end: a pass of ``profile(max_batches=...)`` may span epochs."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        while True:
            yield from self.loader


def row_specs(files):
    """Return ``(key, kind, option)`` of every row: model only, the folder at 0 and 2 workers, the packed files."""
    return [("model only (one batch in memory)", "memory", None),
            ("folder, per-sample PIL + transforms, 0 workers", "folder", 0),
            ("folder, per-sample PIL + transforms, 2 workers", "folder", 2),
            ("packed raw HDF5, make_loader(device='cpu')", "packed", files["raw"]),
            ("packed jpeg HDF5, make_loader(device='cpu')", "packed", files["jpeg"])]


def targets_of(rows):
    """Return the packed raw row's img/s against the faster folder row (see NOTE [training rows])."""
    model = next(row for row in rows if row["kind"] == "memory")
    folder = max((row for row in rows if row["kind"] == "folder"), key=lambda row: row["samples_per_s"])
    packed = next(row for row in rows if row["key"].startswith("packed raw"))
    return [{"name": "training example, 32 px: img/s from packed raw vs from the raw folder (faster of 0 and 2 "
                     "workers)", "value": packed["samples_per_s"] / folder["samples_per_s"],
             "threshold": PACKED_VS_FOLDER_MIN,
             "info": f"{packed['samples_per_s']:,.0f} vs {folder['samples_per_s']:,.0f} img/s; data-wait "
                     f"{packed['data_wait']:.1%} vs {folder['data_wait']:.1%}; model alone "
                     f"{model['samples_per_s']:,.0f} img/s"}]


def table(rows):
    from fastdata.measure.tables import markdown_table

    model = next(row for row in rows if row["kind"] == "memory")
    body = [(row["key"], f"{row['samples_per_s']:,.0f}", f"{row['samples_per_s'] / model['samples_per_s']:.2f}",
             f"{row['data_wait']:.1%}", f"{row['first_batch_seconds']:.2f}", row["steps"]) for row in rows]
    headers = ["input pipeline", "img/s", "vs model only", "data-wait", "first batch s", "steps"]
    return markdown_table(headers, body, "lrrrrr")


def text(results):
    """Return the section's Markdown."""
    return "\n".join([
        "## Training example: a raw image folder versus packed files", "",
        f"examples/train_resnet.py's loop (its ResNet, SGD, batch {BATCH_SIZE}, {results['size']} px, CPU) for "
        f"{results['steps']} steps after {WARMUP_STEPS} warm-up steps, over {results['num_images']:,} synthetic "
        "shapes (make_learnable_imagefolder); img/s and data-wait from fastdata.profile. The folder rows decode, "
        "resize, crop, flip and normalize each sample in a torch DataLoader; the packed rows use make_loader's "
        "device pipeline (RandomCrop(32, padding=4), normalize=True). The model computes on the cores that load "
        "the data, so compare img/s with the model-only row (NOTE [training rows] in "
        "benchmarks/sections/training.py).", "",
        results["table"]])


def run(config, fresh):
    """Run the training section; return rows, targets, table and text."""
    from fastdata import open_dataset
    from fastdata.converters import find_images

    num_images = IMAGES // 10 if config["quick"] else IMAGES
    root, files = prepare(config["workdir"], num_images, config["seed"])
    _, relpaths, labels = find_images(root)
    metadata = open_dataset(files["raw"]).metadata
    setup = {"paths": [os.path.join(root, path) for path in relpaths], "labels": labels.tolist(),
             "mean": metadata["mean"], "std": metadata["std"], "seed": config["seed"],
             "steps": STEPS // 10 if config["quick"] else STEPS}
    rows = [fresh.run(measure_row, spec, setup) for spec in row_specs(files)]
    results = {"size": SIZE, "steps": setup["steps"], "num_images": len(relpaths), "batch_size": BATCH_SIZE,
               "rows": rows, "targets": targets_of(rows), "table": table(rows)}
    results["text"] = text(results)
    return results
