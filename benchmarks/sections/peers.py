"""Other tools section: the same preprocessed samples read through other libraries.

Run through benchmarks/run.py (``--only peers``). The 64x64 pixels and
labels of the packed HDF5 raw file (the photos converted by fastdata) are
written once more in each tool's own format, then read with that tool's
documented PyTorch path at the same batch size, shuffled, with 0 and N
workers (persistent), each row in a fresh process:

* tutorial h5py: the pattern of many tutorials, the file opened in the
  Dataset's constructor and ``dset[i]`` per item, default collate. With
  workers the open handle is inherited through fork (HDF5 does not support
  that; reads happen to work here), so that row uses fork;
* Hugging Face ``datasets``: ``Dataset.from_dict`` with an ``Array3D``
  uint8 feature, ``save_to_disk`` then ``load_from_disk`` (memory-mapped
  Arrow), ``.with_format("torch")`` into a DataLoader (its ``__getitems__``
  reads a batch per call);
* WebDataset: 8 tar shards of ``.npy`` + ``.cls`` samples, read with
  ``WebDataset(...).shuffle(1000).decode().to_tuple().batched()`` into a
  DataLoader with ``batch_size=None`` (shards split over workers).

A tool that is not installed gets a row saying so (``pip install
'fastdata[peers]'``). Nothing is downloaded: HF runs offline, with its
caches inside the work folder.
"""

import os
import shutil
from contextlib import contextmanager
from functools import partial

import numpy as np

from benchmarks import inputs
from benchmarks.rows import measure_row
from fastdata.measure.engine import consume
from fastdata.measure.machine import installed_version
from fastdata.measure.tables import Row, markdown_table

SIZE = 64  # peers hold the 64x64 samples, the size of the reference figures
NUM_SHARDS = 8
SHUFFLE_BUFFER = 1000
TOOLS = {"hf_datasets": "datasets", "webdataset": "webdataset"}  # row kind -> package
NAMES = {"tutorial": "tutorial h5py", "hf_datasets": "HF datasets", "webdataset": "WebDataset"}


def offline_env(workdir):
    """Set the environment so Hugging Face libraries never reach the network and cache under ``workdir``."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HOME"] = os.path.join(workdir, "hf-home")
    os.environ["HF_DATASETS_CACHE"] = os.path.join(workdir, "hf-home", "datasets")
    os.environ.setdefault("TQDM_DISABLE", "1")


def write_peer_files(source, folder):
    """Write the samples of packed file ``source`` in each installed tool's format; return their paths.

    Runs in a fresh process (the tools' imports stay out of the main one).
    """
    from fastdata.formats import read_packed

    offline_env(folder)
    columns, _ = read_packed(source)
    pixels, labels = np.asarray(columns.samples), np.asarray(columns.labels)
    written = {}
    if installed_version("datasets"):
        written["hf_datasets"] = _write_hf(pixels, labels, os.path.join(folder, "hf-dataset"))
    if installed_version("webdataset"):
        written["webdataset"] = _write_shards(pixels, labels, os.path.join(folder, "wds"))
    return written


def _write_hf(pixels, labels, path):
    import datasets

    datasets.disable_progress_bars()
    shutil.rmtree(path, ignore_errors=True)
    features = datasets.Features({"image": datasets.Array3D(pixels.shape[1:], "uint8"),
                                  "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": pixels, "label": labels}, features=features).save_to_disk(path)
    return path


def _write_shards(pixels, labels, folder):
    import webdataset as wds

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    per_shard = -(-len(pixels) // NUM_SHARDS)
    with wds.ShardWriter(os.path.join(folder, "shard-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for index, (image, label) in enumerate(zip(pixels, labels.tolist())):
            sink.write({"__key__": f"{index:08d}", "npy": image, "cls": label})
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".tar"))


def rows(workers):
    """Return the Row of every tool's row: 0 workers, then ``workers``."""
    tutorial = "tutorial h5py Dataset: file opened in __init__, dset[i] per item, default collate"
    hf = "Hugging Face datasets: load_from_disk (Arrow mmap), with_format('torch'), DataLoader"
    wds = f"WebDataset: {NUM_SHARDS} tar shards of .npy, shuffle({SHUFFLE_BUFFER}).decode().batched()"
    found = []
    for kind, method, build in (("tutorial", tutorial, _tutorial_epochs), ("hf_datasets", hf, _hf_epochs),
                                ("webdataset", wds, _wds_epochs)):
        found.append(Row(kind, method, "0", build, {"num_workers": 0}, kind))
        label = f"{workers} (fork, handle inherited)" if kind == "tutorial" else f"{workers} (persistent)"
        found.append(Row(f"{kind}_workers", method, label, build, {"num_workers": workers}, kind))
    return found


def measure(row, setup):
    """Measure one row in this process (Hugging Face kept offline); return its dict."""
    offline_env(setup["folder"])
    return measure_row(row, setup, num_workers=row.options["num_workers"], tool=row.kind, tool_name=NAMES[row.kind])


@contextmanager
def _tutorial_epochs(setup, num_workers):
    from torch.utils.data import DataLoader

    from fastdata.measure.baselines import TutorialH5Dataset

    dataset = TutorialH5Dataset(setup["source"])
    context = "fork" if num_workers else None  # the open handle cannot be pickled for spawn
    loader = DataLoader(dataset, setup["batch_size"], shuffle=True, num_workers=num_workers,
                        persistent_workers=num_workers > 0, multiprocessing_context=context)
    try:
        yield partial(consume, loader)
    finally:
        dataset.close()


@contextmanager
def _hf_epochs(setup, num_workers):
    import datasets
    from torch.utils.data import DataLoader

    dataset = datasets.load_from_disk(setup["files"]["hf_datasets"]).with_format("torch")
    loader = DataLoader(dataset, setup["batch_size"], shuffle=True, num_workers=num_workers,
                        persistent_workers=num_workers > 0)
    yield partial(consume, loader, key="image")


@contextmanager
def _wds_epochs(setup, num_workers):
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = setup["files"]["webdataset"]
    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), workersplitter=wds.split_by_worker,
                               nodesplitter=wds.split_by_node, empty_check=False)
                .shuffle(SHUFFLE_BUFFER).decode().to_tuple("npy", "cls").batched(setup["batch_size"]))
    loader = DataLoader(pipeline, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)
    yield partial(consume, loader)


def table(rows):
    body = []
    for row in rows:
        if "skipped" in row:
            body.append((row["method"], row["workers"], "skipped", row["skipped"]))
        else:
            body.append((row["method"], row["workers"], f"{row['samples_per_s']:,.0f}", ""))
    return markdown_table(["other tool (same 64x64 uint8 samples)", "workers", "samples/s", "note"], body, "llrl")


def run(config, fresh):
    """Run the other-tools section; return rows (with skipped ones), versions and table."""
    files = inputs.packed_images(config["workdir"], config["num_images"], SIZE, config["seed"])
    folder = os.path.join(config["workdir"], "peers", f"{config['num_images']}-images-{SIZE}px")
    os.makedirs(folder, exist_ok=True)
    written = fresh.run(write_peer_files, files["hdf5-raw"], folder)
    setup = {key: config[key] for key in ("batch_size", "repeats", "min_seconds", "seed")}
    setup.update(source=files["hdf5-raw"], files=written, folder=folder, num_samples=_num_samples(files))
    measured = []
    for row in rows(config["workers"]):
        if row.kind in TOOLS and row.kind not in written:
            note = f"{TOOLS[row.kind]} is not installed: pip install 'fastdata[peers]'"
            measured.append({"key": row.key, "method": row.method, "workers": row.workers, "tool": row.kind,
                             "tool_name": NAMES[row.kind], "num_workers": row.options["num_workers"], "skipped": note})
            continue
        measured.append(fresh.run(measure, row, setup))
    versions = {package: installed_version(package) for package in TOOLS.values()}
    return {"size": SIZE, "num_samples": setup["num_samples"], "versions": versions, "rows": measured,
            "table": table(measured)}


def _num_samples(files):
    from fastdata.formats import read_packed

    return read_packed(files["hdf5-raw"])[1]["num_samples"]
