"""GPU section: what make_loader(device="cuda") delivers to a GPU, and ResNet training steps fed by it.

Runs where torch sees a CUDA device and is skipped, saying so, elsewhere.
``bash scripts/gpu-check.sh`` runs it together with the CUDA tests and
writes benchmarks/results/gpu/ (benchmarks/gpucheck.py); the same code runs
on the CPU (``--device cpu --quick``), which is how it is tested without a GPU.

* copies: uint8 image batches (256 of 3 x 256 x 256, 50 MB) delivered by
  ``make_loader(dataset, device=...)`` over a packed raw file, in bytes/s,
  against a plain copy of the same bytes from one page-locked buffer
  (``dst.copy_(src, non_blocking=True)``) and from one pageable buffer;
  interleaved rounds, the median of each. On the CPU the plain copy is a
  host ``copy_`` and nothing is pinned.
* training: ResNet-18 and ResNet-50 (benchmarks/resnet.py: random init,
  1000 classes), SGD with momentum, bf16 autocast on CUDA (fp32 on the CPU),
  channels_last, batches of 128 at 224 px, fed from packed raw and jpeg
  files that the converter made from varied photos (stored at 256 px),
  through ``make_loader(..., device, augment=RandomResizedCrop(224),
  normalize=True, dtype, memory_format=channels_last)``, and from one batch
  already on the device (the model alone). It reports steps/s and the
  data-wait share: the time the loop spends in ``next()`` over the timed
  window, from the first timed step to a synchronize after the last.
* helper rows: ResNet-18 from raw and jpeg again, the batches read in a
  helper process (``make_loader(helper_process=True)``, issue 28): on the
  first H200 run the in-process rows kept 0.66-0.70 (raw) of the model
  alone while the host read alone delivered twice what the model takes,
  so the reading threads' share of the training process (the GIL) is the
  suspect. Informative: the targets are the in-process rows'.
* host reads: the same files read as the training rows read them, with
  no GPU work (raw: the host batches; jpeg: the fused crop and flips on
  the CPU), in img/s: what the loader can deliver at most.

NOTE [waits in next() on a GPU]: CUDA runs ahead of the loop, so a loop
whose GPU is busy blocks in its kernel launches, and one whose data is
late waits in ``next()`` while the GPU runs out of work. But a blocking
copy to the device synchronizes the stream (torch copies pageable memory
with a ``cudaStreamSynchronize``), and the pipeline makes such copies
inside ``next()``: RandomResizedCrop's sampling grid, the flips' row
numbers. There ``next()`` also waits for the GPU to finish the step before,
which the share counts as data-wait. The "vs model alone" column (steps/s
against one batch already on the device) holds what the loop really lost.
On the first H200 run, ResNet-18 from raw: 39% of the window in ``next()``
and 0.66-0.70 of the model alone; ResNet-50: 21-24% and 0.95-0.97.

Each row runs in a fresh process; the sampler is one endless epoch
(EpochBatches), so no epoch start falls in a timed window.
"""

import itertools
import os
import shutil
import time

from benchmarks.machine import cuda_device

FULL = {"images": 512, "photo_size": (500, 375), "stored": 256, "crop": 224, "batch_size": 128,
        "copy_batch_size": 256, "warmup_steps": 15, "seconds": 8.0, "min_steps": 20, "copy_seconds": 1.0,
        "copy_rounds": 3}
QUICK = {"images": 24, "photo_size": (160, 120), "stored": 40, "crop": 32, "batch_size": 4, "copy_batch_size": 8,
         "warmup_steps": 0, "seconds": 0.0, "min_steps": 1, "copy_seconds": 0.05, "copy_rounds": 1}
MODELS = ("resnet18", "resnet50")
NUM_CLASSES = 8  # of the photo folder; the models keep 1000 outputs, as published
ENDLESS = 2**31 - 1  # batches in the sampler's one epoch
LOADER_VS_PINNED_MIN = 0.8  # target: the loader delivers >= 0.8x the bytes/s of a plain pinned copy
DATA_WAIT_MAX = 0.02  # target: <= 2% of a training window inside next()


def make_setup(device, quick, seed=0, precision=None):
    """Return the plain dict every measuring process gets: sizes, ``device`` ("cuda" or "cpu"), precision."""
    setup = dict(QUICK if quick else FULL, device=device, seed=seed, quick=quick)
    setup["precision"] = precision or ("bf16" if device == "cuda" else "fp32")
    return setup


def prepare(workdir, setup):
    """Return ``{"raw": path, "jpeg": path}``: varied photos converted by convert_imagefolder, made once."""
    from fastdata import convert_imagefolder
    from fastdata.measure.synthetic import make_imagefolder

    width, height = setup["photo_size"]
    per_class = max(1, setup["images"] // NUM_CLASSES)
    folder = os.path.join(workdir, "gpu")
    root = os.path.join(folder, f"photos-{NUM_CLASSES}x{per_class}-{width}x{height}-seed{setup['seed']}")
    if not os.path.exists(root + ".done"):  # written last: a half-made folder is made again
        shutil.rmtree(root, ignore_errors=True)
        make_imagefolder(root, NUM_CLASSES, per_class, size=(width, height), seed=setup["seed"], vary=True)
        open(root + ".done", "w").close()
    files = {}
    for storage in ("raw", "jpeg"):
        files[storage] = f"{root}-{setup['stored']}px-{storage}.h5"
        if not os.path.exists(files[storage]):
            convert_imagefolder(root, files[storage], size=setup["stored"], storage=storage, progress=False)
    return files


def time_steps(batches, step, seconds, min_count, sync):
    """Run ``step(next(batches))`` at least ``min_count`` times and ``seconds``; return (steps, seconds, wait).

    ``wait`` is the time spent in ``next()``; the window ends with ``sync()``, after the last step's work.
    """
    sync()
    wait, count, started = 0.0, 0, time.perf_counter()
    while count < min_count or time.perf_counter() - started < seconds:
        before = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - before
        step(batch)
        count += 1
    sync()
    return count, time.perf_counter() - started, wait


def _loader(path, setup, batch_size, **options):
    """Return an endless iterator of ``make_loader(dataset, device=setup["device"], **options)``'s batches."""
    from benchmarks.samplers import EpochBatches
    from fastdata import make_loader, open_dataset

    dataset = open_dataset(path)
    sampler = EpochBatches(len(dataset), batch_size, ENDLESS, seed=setup["seed"])
    loader = make_loader(dataset, batch_sampler=sampler, device=setup["device"], **options)
    return loader, iter(loader)


def _sync(device):
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def measure_copies(path, setup):
    """Return the copy rows over packed raw ``path``: make_loader's delivery, then plain copies of the same bytes."""
    import statistics

    import torch

    device, sync = torch.device(setup["device"]), _sync(torch.device(setup["device"]))
    loader, batches = _loader(path, setup, setup["copy_batch_size"])
    first = next(batches)[0]
    nbytes = first.numel() * first.element_size()
    pageable = first.cpu().reshape(-1).clone()  # real pixels, in ordinary memory
    target = torch.empty_like(pageable, device=device)
    kinds = {"loader": (batches, lambda batch: None)}
    if device.type == "cuda":
        pinned = pageable.pin_memory()
        kinds["pinned"] = (itertools.repeat(None), lambda _: target.copy_(pinned, non_blocking=True))
    kinds["pageable"] = (itertools.repeat(None), lambda _: target.copy_(pageable))
    for source, step in kinds.values():  # warm-up: pools started, buffers allocated
        time_steps(source, step, 0.0, 3, sync)
    rates = {key: [] for key in kinds}
    for _ in range(setup["copy_rounds"]):
        for key, (source, step) in kinds.items():
            count, seconds, _ = time_steps(source, step, setup["copy_seconds"], 3, sync)
            rates[key].append(count * nbytes / seconds)
    batches.close()
    shape = list(first.shape)
    return [{"key": key, "bytes_per_s": statistics.median(values), "rates": values, "batch_bytes": nbytes,
             "batch_shape": shape, "pin_memory": loader.pin_memory if key == "loader" else key == "pinned"}
            for key, values in rates.items()]


def measure_host(spec, setup):
    """Read ``spec = (storage, path)`` as the training rows do, with no GPU work; return its img/s row.

    Raw: make_loader's host batches (pinned where CUDA is there). JPEG: the
    RandomResizedCrop fused into decoding and its flips, on the CPU. What
    the loader can deliver at most, beside what each model takes.
    """
    from fastdata.loading.augment import RandomResizedCrop

    storage, path = spec
    device, options = ("cpu", {"augment": RandomResizedCrop(setup["crop"])}) if storage == "jpeg" else (None, {})
    _, batches = _loader(path, {**setup, "device": device}, setup["batch_size"], **options)
    time_steps(batches, lambda batch: None, 0.0, setup["warmup_steps"], lambda: None)
    steps, seconds, _ = time_steps(batches, lambda batch: None, setup["copy_seconds"] * 2, setup["min_steps"],
                                   lambda: None)
    batches.close()
    print(f"  gpu host {storage}: {steps * setup['batch_size'] / seconds:,.0f} img/s", flush=True)
    return {"storage": storage, "steps": steps, "seconds": seconds,
            "samples_per_s": steps * setup["batch_size"] / seconds}


def measure_training(spec, setup):
    """Train ``spec = (model name, storage, path or None, helper)`` for the warm-up and timed steps; return its row.

    ``helper``: the batches are read in a helper process (``make_loader(helper_process=True)``), off the process
    whose thread launches the step's kernels.
    """
    import torch

    from benchmarks.resnet import make_resnet
    from fastdata.loading.augment import RandomResizedCrop

    name, storage, path, helper = spec
    device, sync = torch.device(setup["device"]), _sync(torch.device(setup["device"]))
    torch.manual_seed(setup["seed"])
    torch.backends.cudnn.benchmark = True
    model = make_resnet(name).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    dtype = torch.bfloat16 if setup["precision"] == "bf16" else torch.float32
    started = time.perf_counter()
    if path is None:  # the model alone: one batch already on the device
        shape = (setup["batch_size"], 3, setup["crop"], setup["crop"])
        images = torch.randn(shape, device=device).to(dtype, memory_format=torch.channels_last)
        batches = itertools.repeat((images, torch.randint(0, 1000, shape[:1], device=device)))
    else:
        _, batches = _loader(path, setup, setup["batch_size"], augment=RandomResizedCrop(setup["crop"]),
                             normalize=True, dtype=dtype, memory_format=torch.channels_last, helper_process=helper)
    step = _train_step(model, optimizer, setup["precision"])
    step(next(batches))
    sync()
    first_step = time.perf_counter() - started
    time_steps(batches, step, 0.0, setup["warmup_steps"], sync)
    steps, seconds, wait = time_steps(batches, step, setup["seconds"], setup["min_steps"], sync)
    if hasattr(batches, "close"):
        batches.close()
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    where = ", helper process" if helper else ""
    print(f"  gpu {name} {storage}{where}: {steps / seconds:.2f} steps/s, data-wait {wait / seconds:.2%}", flush=True)
    return {"model": name, "storage": storage, "helper_process": helper, "steps": steps, "seconds": seconds,
            "wait_seconds": wait,
            "steps_per_s": steps / seconds, "samples_per_s": steps * setup["batch_size"] / seconds,
            "data_wait": wait / seconds, "first_step_seconds": first_step, "max_memory_bytes": memory,
            "parameters": sum(p.numel() for p in model.parameters())}


def _train_step(model, optimizer, precision):
    """Return ``step((images, labels))``: forward (under bf16 autocast for "bf16"), cross-entropy, backward, SGD."""
    import torch

    loss_of = torch.nn.CrossEntropyLoss()

    def step(batch):
        images, labels = batch
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def measure(workdir, setup, fresh):
    """Make the packed files, then measure the copies and every training row, each in a fresh process."""
    files = prepare(workdir, setup)
    copies = fresh.run(measure_copies, files["raw"], setup)
    host = [fresh.run(measure_host, (storage, files[storage]), setup) for storage in ("raw", "jpeg")]
    specs = [(name, storage, files.get(storage), False) for name in MODELS for storage in ("model only", "raw", "jpeg")]
    specs += [(MODELS[0], storage, files[storage], True) for storage in ("raw", "jpeg")]  # the helper rows
    training = [fresh.run(measure_training, spec, setup) for spec in specs]
    return {"setup": setup, "files": files, "copies": copies, "host": host, "training": training,
            "targets": targets_of(copies, training, setup["device"]),
            "tables": {"copies": copies_table(copies), "host": host_table(host, setup),
                       "training": training_table(training, setup)}}


def targets_of(copies, training, device):
    """Return the loader's bytes/s against the plain pinned copy, and each fed row's data-wait share."""
    rates = {row["key"]: row["bytes_per_s"] for row in copies}
    plain = "pinned" if "pinned" in rates else "pageable"
    targets = [{"name": f"make_loader(device={device!r}) bytes/s vs a plain {plain} copy_ of the same bytes",
                "value": rates["loader"] / rates[plain], "threshold": LOADER_VS_PINNED_MIN,
                "info": f"{rates['loader'] / 1e9:.2f} vs {rates[plain] / 1e9:.2f} GB/s"}]
    alone = {row["model"]: row["steps_per_s"] for row in training if row["storage"] == "model only"}
    for row in training:
        if row["storage"] != "model only" and not row["helper_process"]:
            targets.append({"name": f"{row['model']} from packed {row['storage']}: share of the window in next()",
                            "value": row["data_wait"], "threshold": DATA_WAIT_MAX, "at_least": False,
                            "info": f"{row['steps_per_s']:.2f} steps/s, {row['steps_per_s'] / alone[row['model']]:.2f}"
                                    f" of the model alone"})
    return targets


def copies_table(rows):
    from fastdata.measure.tables import markdown_table

    names = {"loader": "make_loader(device=...) over packed raw", "pinned": "plain copy_ from a pinned buffer",
             "pageable": "plain copy_ from a pageable buffer"}
    by_key = {row["key"]: row["bytes_per_s"] for row in rows}
    plain = by_key.get("pinned", by_key["pageable"])
    body = [(names[row["key"]], f"{row['bytes_per_s'] / 1e9:.2f}", f"{row['bytes_per_s'] / plain:.2f}",
             row["pin_memory"]) for row in rows]
    shape = "x".join(str(side) for side in rows[0]["batch_shape"])
    headers = [f"uint8 batches {shape} ({rows[0]['batch_bytes'] / 1e6:.3g} MB)", "GB/s",
               "vs pinned copy_" if "pinned" in by_key else "vs plain copy_", "pin_memory"]
    return markdown_table(headers, body, "lrrl")


def host_table(rows, setup):
    from fastdata.measure.tables import markdown_table

    body = [(row["storage"], f"{row['samples_per_s']:,.0f}", row["steps"]) for row in rows]
    headers = [f"host batches of {setup['batch_size']}, no GPU work", "img/s", "batches"]
    return markdown_table(headers, body, "lrr")


def training_table(rows, setup):
    from fastdata.measure.tables import markdown_table

    alone = {row["model"]: row["steps_per_s"] for row in rows if row["storage"] == "model only"}
    body = [(row["model"], row["storage"], "helper process" if row["helper_process"] else "this process",
             f"{row['steps_per_s']:.2f}", f"{row['samples_per_s']:,.0f}",
             f"{row['steps_per_s'] / alone[row['model']]:.2f}", f"{row['data_wait']:.2%}",
             f"{row['first_step_seconds']:.2f}", row["steps"]) for row in rows]
    headers = ["model", f"input ({setup['crop']} px, batch {setup['batch_size']}, {setup['precision']})", "read in",
               "steps/s",
               "img/s", "vs model alone", "data-wait", "first step s", "timed steps"]
    return markdown_table(headers, body, "lllrrrrrr")


def run(config, fresh):
    """Run the GPU section of benchmarks/run.py; without a CUDA device return why it was skipped."""
    name = fresh.run(cuda_device)
    if name is None:
        reason = "no CUDA device: torch sees none here; run bash scripts/gpu-check.sh on a machine with one"
        print(f"  gpu: skipped ({reason})", flush=True)
        return {"skipped": reason}
    results = measure(config["workdir"], make_setup("cuda", config["quick"], config["seed"]), fresh)
    return {"device": name, **results}
