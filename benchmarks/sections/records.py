"""Records section: dict batches of image + caption pairs and of a detection-like set, against the same records
read through Hugging Face ``datasets`` and WebDataset, and their conversion against ``datasets.map`` and a Pool.

Run through benchmarks/run.py (``--only records``). The photos of the images
section (varied JPEGs around 500x375) become records with fastdata.write
(2 workers):

* pairs: ``image`` (64 px raw, 64 px jpeg, 224 px jpeg), ``caption`` (the
  first CAPTION_WORDS words of a synthetic review, text) and ``tokens``
  (those words' ids, uint16, ragged);
* boxes: ``image`` (64 px raw), ``boxes`` float32 ``[n, 4]`` and
  ``labels`` int64 ``[n]`` with n uniform in 0..MAX_BOXES.

The stored values are then written once more in each peer's format (read
back from the fastdata file, so every tool holds the same pixels, JPEG bytes
and captions): a ``datasets`` folder (save_to_disk; raw images as
``Array3D``, jpeg as ``Image`` holding the same bytes) read with
``with_format("torch")`` into a DataLoader with a padding collate, and
NUM_SHARDS WebDataset tars read with ``shuffle().decode("rgb8")`` and a
padding collation. Each row runs in a fresh process, shuffled, batch 256:
fastdata's ``make_loader`` defaults (the median of process_repeats
processes); the peers with 0 and 2 workers. For jpeg, fastdata and the
decode limit (decode_jpeg of every stored JPEG on every core) are timed in
turn in one process, LIMIT_ROUNDS rounds, the target being the median
ratio (NOTE [interleaved rates] in fastdata/measure/engine.py).

Conversion: CONVERT_RECORDS 64 px jpeg pairs (photos of an ImageNet-like
folder, see fastdata.measure.synthetic.make_imagenet_like) written by
fastdata.write (2 workers) against ``datasets.Dataset.map(num_proc=2)`` doing
the same decode, resize and encode (then save_to_disk) and a plain
multiprocessing.Pool doing it and writing the same columns to an .h5 file,
each in a fresh process.
"""

import os
import shutil
import statistics
import time
import zlib
from contextlib import contextmanager
from functools import partial

import numpy as np

from benchmarks import inputs
from benchmarks.rows import measure_row
from benchmarks.sections.peers import offline_env
from fastdata.measure.engine import consume
from fastdata.measure.machine import installed_version
from fastdata.measure.tables import Row, markdown_table

SETS = (("pairs", 64, "raw"), ("pairs", 64, "jpeg"), ("pairs", 224, "jpeg"), ("boxes", 64, "raw"))
CAPTION_WORDS = 77
VOCAB = 30_000
MAX_BOXES = 50
NUM_SHARDS = 8
SHUFFLE_BUFFER = 1000
WORKERS = 2
QUALITY = 90
VS_BEST_PEER = 10.0  # raw storage: fastdata's dict batches over the best peer's rate
VS_DECODE_LIMIT = 0.9  # jpeg storage: fastdata's dict batches over the decode limit
CONVERT_RECORDS = 100_000  # records of the conversion rows (--quick: num_images), from an ImageNet-like folder
LIMIT_ROUNDS = 5  # rounds of the loader and the decode limit in turn (--quick 2)
VS_POOL = 0.9  # conversion: fastdata.write over a plain Pool doing the same work and writing the same columns
PEERS = {"hf": "datasets", "wds": "webdataset"}


def set_key(kind, size, storage):
    return f"{kind}-{size}-{storage}"


def make_records(paths, kind, seed):
    """Return the records of ``kind`` ("pairs" or "boxes") for image ``paths``: image paths and seeded values."""
    from fastdata.measure.synthetic import make_review

    rng = np.random.default_rng(seed)
    records = []
    for path in paths:
        if kind == "pairs":
            words = make_review(rng).split()[:CAPTION_WORDS]
            ids = [zlib.crc32(word.encode()) % VOCAB for word in words]
            records.append({"image": path, "caption": " ".join(words), "tokens": ids})
        else:
            count = int(rng.integers(0, MAX_BOXES + 1))
            records.append({"image": path, "boxes": (rng.random((count, 4)) * 64).astype(np.float32),
                            "labels": rng.integers(0, 80, count).tolist()})
    return records


def schema_of(kind, size, storage):
    from fastdata import Field

    image = Field("image", size=(size, size), storage=storage, quality=QUALITY if storage == "jpeg" else None)
    if kind == "pairs":
        return {"image": image, "caption": "str", "tokens": Field("tokens", dtype="uint16")}
    return {"image": image, "boxes": Field("ragged", shape=(4,)), "labels": Field("ragged", dtype="int64")}


def write_sets(paths, workdir, seed):
    """Write every set with fastdata.write, then its stored values in each installed peer's format (fresh process)."""
    from fastdata import write

    offline_env(workdir)
    files = {}
    for kind, size, storage in SETS:
        key = set_key(kind, size, storage)
        folder = os.path.join(workdir, key)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        path = os.path.join(folder, f"{key}.h5")
        write(make_records(paths, kind, seed), path, schema_of(kind, size, storage), workers=WORKERS)
        files[key] = {"fastdata": path}
        values = _stored_values(path)
        if installed_version("datasets"):
            files[key]["hf"] = _write_hf(values, storage, os.path.join(folder, "hf"))
        if installed_version("webdataset"):
            files[key]["wds"] = _write_wds(values, storage, os.path.join(folder, "wds"))
    return files


def _stored_values(path):
    """Return ``{field: [value per record]}`` as the fastdata file stores them (images: CHW pixels or JPEG bytes)."""
    from fastdata.formats import read_records

    columns, fields, _ = read_records(path)
    values = {}
    for name, field in fields.items():
        column = columns[name]
        if column.offsets is None:
            values[name] = list(np.asarray(column.values))
            continue
        pieces = [np.asarray(column.values[a:b]) for a, b in zip(column.offsets[:-1], column.offsets[1:])]
        values[name] = [bytes(piece) if field.type == "image" else piece.tobytes().decode() if field.type == "str"
                        else piece for piece in pieces]
    return values


def _write_hf(values, storage, folder):
    import datasets

    datasets.disable_progress_bars()
    first = values["image"][0]
    features = {"image": datasets.Image() if storage == "jpeg" else datasets.Array3D(first.shape, "uint8")}
    rows = {"image": [{"bytes": data, "path": None} for data in values["image"]] if storage == "jpeg"
            else values["image"]}
    if "caption" in values:
        features.update(caption=datasets.Value("string"), tokens=datasets.Sequence(datasets.Value("int32")))
        rows.update(caption=values["caption"], tokens=[ids.tolist() for ids in values["tokens"]])
    else:
        features.update(boxes=datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
                        labels=datasets.Sequence(datasets.Value("int64")))
        rows.update(boxes=[boxes.tolist() for boxes in values["boxes"]],
                    labels=[ids.tolist() for ids in values["labels"]])
    datasets.Dataset.from_dict(rows, features=datasets.Features(features)).save_to_disk(folder)
    return folder


def _write_wds(values, storage, folder):
    import webdataset as wds

    os.makedirs(folder)
    count = len(values["image"])
    with wds.ShardWriter(os.path.join(folder, "shard-%04d.tar"), maxcount=-(-count // NUM_SHARDS), verbose=0) as sink:
        for index in range(count):
            sample = {"__key__": f"{index:08d}", "jpg" if storage == "jpeg" else "npy": values["image"][index]}
            if "caption" in values:
                sample.update({"txt": values["caption"][index], "ids.npy": values["tokens"][index].astype(np.int32)})
            else:
                sample.update({"boxes.npy": values["boxes"][index], "labels.npy": values["labels"][index]})
            sink.write(sample)
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".tar"))


# ---------------------------------------------------------------- loading rows


def rows(files, storage_of):
    """Return the Row of every measured loader or limit, per set."""
    found = []
    for key, paths in files.items():
        found.append(Row(f"{key}/fastdata", "fastdata make_loader, dict batches (defaults)", "0 (defaults)",
                         _fastdata_epochs, {"data": key, "num_workers": 0}, "fastdata"))
        for peer in ("hf", "wds"):
            if peer in paths:
                for workers in (0, WORKERS):
                    found.append(Row(f"{key}/{peer}-{workers}", _PEER_METHODS[peer], str(workers),
                                     _PEER_EPOCHS[peer], {"data": key, "num_workers": workers}, peer))
    return found


def measure(row, setup):
    offline_env(setup["folder"])
    return measure_row(row, {**setup, "files": setup["files"][row.options["data"]]}, data=row.options["data"],
                       tool=row.kind)


@contextmanager
def _fastdata_epochs(setup, data, num_workers):
    from fastdata import make_loader, open_dataset

    loader = make_loader(open_dataset(setup["files"]["fastdata"]), setup["batch_size"], shuffle=True,
                         seed=setup["seed"], num_workers=num_workers)
    try:
        yield partial(consume, loader, key="image")
    finally:
        loader.close()


def _padded(values):
    """Return ``(values padded into one tensor [B, T, ...], lengths [B])``; an empty value of the wrong rank (a peer
    gives ``[0]`` for an empty list of boxes) takes the others' row shape."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    tensors = [torch.as_tensor(value) for value in values]
    row = next((tensor.shape[1:] for tensor in tensors if len(tensor)), tensors[0].shape[1:])
    tensors = [tensor.reshape(0, *row) if not len(tensor) else tensor for tensor in tensors]
    return pad_sequence(tensors, batch_first=True), torch.tensor([len(tensor) for tensor in tensors])


class PadDicts:
    """Collate dict items: images stacked, ragged values padded (with their lengths), text as a list."""

    def __call__(self, items):
        import torch

        batch = {"image": torch.stack([item["image"] for item in items])}
        for name in items[0]:
            values = [item[name] for item in items]
            if name == "image":
                continue
            if isinstance(values[0], str):
                batch[name] = values
            else:
                batch[name], batch[f"{name}_lengths"] = _padded(values)
        return batch


def pad_tuples(samples):
    """WebDataset's collation of ``(image, *fields)`` tuples: as PadDicts, by position."""
    import torch

    columns = list(zip(*samples))
    batch = [torch.stack([torch.as_tensor(image) for image in columns[0]])]
    for values in columns[1:]:
        batch += [list(values)] if isinstance(values[0], str) else list(_padded(values))
    return batch


@contextmanager
def _hf_epochs(setup, data, num_workers):
    import datasets
    from torch.utils.data import DataLoader

    dataset = datasets.load_from_disk(setup["files"]["hf"]).with_format("torch")
    loader = DataLoader(dataset, setup["batch_size"], shuffle=True, num_workers=num_workers, collate_fn=PadDicts(),
                        persistent_workers=num_workers > 0)
    yield partial(consume, loader, key="image")


@contextmanager
def _wds_epochs(setup, data, num_workers):
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = setup["files"]["wds"]
    image = "jpg" if data.endswith("jpeg") else "npy"
    fields = ("txt", "ids.npy") if data.startswith("pairs") else ("boxes.npy", "labels.npy")
    pipeline = (wds.WebDataset(urls, shardshuffle=len(urls), workersplitter=wds.split_by_worker,
                               nodesplitter=wds.split_by_node, empty_check=False)
                .shuffle(SHUFFLE_BUFFER).decode("rgb8").to_tuple(image, *fields)
                .batched(setup["batch_size"], collation_fn=pad_tuples))
    loader = DataLoader(pipeline, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)
    yield partial(consume, loader)


def measure_against_limit(data, setup, rounds):
    """Time fastdata's dict batches and the decode limit of set ``data`` in turn in this process (a fresh one).

    The limit: decode_jpeg of every stored JPEG on every core (fastdata.measure.limits.DecodeEpochs). See NOTE
    [interleaved rates] in fastdata/measure/engine.py: the ratio of each round's rates is the comparison.
    """
    from fastdata._cpu import usable_cpus
    from fastdata.formats import Columns, read_records
    from fastdata.measure.engine import interleaved_rates
    from fastdata.measure.limits import DecodeEpochs

    files = setup["files"][data]
    columns, _, _ = read_records(files["fastdata"])
    image = columns["image"]
    with _fastdata_epochs({**setup, "files": files}, data, 0) as loader_epoch, \
            DecodeEpochs(Columns(image.values, np.empty(0, np.int64), image.offsets), usable_cpus()) as decode:
        rates = interleaved_rates({"fastdata": loader_epoch, "limit": decode}, rounds, setup["min_seconds"])
    ratios = [ours / limit for ours, limit in zip(rates["fastdata"], rates["limit"])]
    return {"data": data, **rates, "ratios": ratios, "ratio": statistics.median(ratios),
            "limit_per_s": statistics.median(rates["limit"])}


_PEER_METHODS = {"hf": "Hugging Face datasets: load_from_disk, with_format('torch'), padding collate",
                 "wds": f"WebDataset: {NUM_SHARDS} tars, shuffle({SHUFFLE_BUFFER}).decode('rgb8'), padding collation"}
_PEER_EPOCHS = {"hf": _hf_epochs, "wds": _wds_epochs}


# ---------------------------------------------------------------- conversion


def convert_fastdata(paths, workdir, seed):
    from fastdata import write

    records = make_records(paths, "pairs", seed)
    started = time.perf_counter()
    report = write(records, os.path.join(workdir, "convert-fastdata.h5"), schema_of("pairs", 64, "jpeg"),
                   workers=WORKERS, overwrite=True)
    return {"tool": "fastdata.write(workers=2)", "seconds": time.perf_counter() - started,
            "num_records": report.num_samples}


def _hf_encode(row):
    from fastdata.codecs.images import encode_jpeg
    from fastdata.measure.baselines import load_resized

    return {"image": encode_jpeg(load_resized(row["image"], 64), QUALITY)}


def convert_hf(paths, workdir, seed):
    import datasets

    offline_env(workdir)
    datasets.disable_progress_bars()
    records = make_records(paths, "pairs", seed)
    started = time.perf_counter()
    dataset = datasets.Dataset.from_list(records).map(_hf_encode, num_proc=WORKERS)
    dataset.save_to_disk(os.path.join(workdir, "convert-hf"))
    return {"tool": f"datasets.map(num_proc={WORKERS}) + save_to_disk", "seconds": time.perf_counter() - started,
            "num_records": len(dataset)}


def convert_pool(paths, workdir, seed):
    import h5py

    from fastdata.measure.baselines import plain_pool

    records = make_records(paths, "pairs", seed)
    started = time.perf_counter()
    with plain_pool(WORKERS) as pool:
        jpegs = pool.map(_hf_encode, records, chunksize=max(1, len(records) // (WORKERS * 8)))
    captions = [record["caption"].encode() for record in records]
    with h5py.File(os.path.join(workdir, "convert-pool.h5"), "w") as f:
        for name, parts in (("image", [row["image"] for row in jpegs]), ("caption", captions),
                            ("tokens", [np.asarray(r["tokens"], np.uint16).tobytes() for r in records])):
            f[name] = np.frombuffer(b"".join(parts), np.uint8)
            f[f"{name}.offsets"] = np.concatenate([[0], np.cumsum([len(part) for part in parts])])
    return {"tool": f"multiprocessing.Pool({WORKERS}) + h5py columns", "seconds": time.perf_counter() - started,
            "num_records": len(jpegs)}


def conversions(paths, workdir, seed, fresh):
    found = [fresh.run(convert_pool, paths, workdir, seed), fresh.run(convert_fastdata, paths, workdir, seed)]
    if installed_version("datasets"):
        found.append(fresh.run(convert_hf, paths, workdir, seed))
    for row in found:
        row["records_per_s"] = row["num_records"] / row["seconds"]
    return found


# ---------------------------------------------------------------- the section


def run(config, fresh):
    """Run the records section; return its rows, conversions, targets and text."""
    workdir = os.path.join(config["workdir"], "records")
    os.makedirs(workdir, exist_ok=True)
    _, paths, _, _ = inputs.photo_folder(config["workdir"], config["num_images"], config["seed"])
    files = fresh.run(write_sets, paths, workdir, config["seed"])
    setup = {key: config[key] for key in ("batch_size", "repeats", "min_seconds", "seed")}
    setup.update(files=files, folder=workdir, num_samples=len(paths))
    storage_of = {set_key(*spec): spec[2] for spec in SETS}
    measured = [fresh.run(measure, row, setup) if row.kind in PEERS  # slow rows: one process is enough
                else fresh.run_median(config["process_repeats"], measure, row, setup)  # NOTE [process to process]
                for row in rows(files, storage_of)]
    rounds = 2 if config.get("quick") else LIMIT_ROUNDS
    limits = [fresh.run(measure_against_limit, key, setup, rounds) for key, storage in storage_of.items()
              if storage == "jpeg"]
    count = config["num_images"] if config.get("quick") else CONVERT_RECORDS
    _, root, _ = inputs.imagenet_like(config["workdir"], count, min(1000, count), min(3000, count), config["seed"])
    converted = conversions(inputs.list_images(root)[0], workdir, config["seed"], fresh)
    result = {"num_records": len(paths), "batch_size": config["batch_size"], "files": files, "rows": measured,
              "limits": limits,
              "conversions": converted, "versions": {name: installed_version(name) for name in PEERS.values()}}
    result["targets"] = targets_of(result, storage_of)
    result["text"] = text(result)
    return result


def targets_of(result, storage_of):
    rate = {row["key"]: row["samples_per_s"] for row in result["rows"]}
    targets = []
    for key, storage in storage_of.items():
        ours = rate[f"{key}/fastdata"]
        if storage == "raw":
            peers = {k: v for k, v in rate.items() if k.startswith(f"{key}/") and k.split("/")[1][:2] in ("hf", "wd")}
            if peers:
                best = max(peers, key=peers.get)
                targets.append({"name": f"records {key}: fastdata dict batches over the best peer ({best})",
                                "value": ours / peers[best], "threshold": VS_BEST_PEER,
                                "info": f"{ours:,.0f} vs {peers[best]:,.0f} records/s"})
        else:
            pair = next(pair for pair in result["limits"] if pair["data"] == key)
            targets.append({"name": f"records {key}: fastdata dict batches over the decode limit, in turn",
                            "value": pair["ratio"], "threshold": VS_DECODE_LIMIT,
                            "info": "per-round ratios " + ", ".join(f"{ratio:.2f}" for ratio in pair["ratios"])
                                    + f"; limit {pair['limit_per_s']:,.0f} records/s"})
    speeds = {row["tool"]: row["records_per_s"] for row in result["conversions"]}
    ours = next(value for tool, value in speeds.items() if tool.startswith("fastdata"))
    pool = next(value for tool, value in speeds.items() if tool.startswith("multiprocessing"))
    targets.append({"name": "records conversion (64 px jpeg pairs): fastdata.write over a plain Pool writing the "
                            "same columns", "value": ours / pool, "threshold": VS_POOL,
                    "info": f"{ours:,.0f} vs {pool:,.0f} records/s"})
    return targets


def text(result):
    body = [(row["data"], row["method"], row["workers"], f"{row['samples_per_s']:,.0f}") for row in result["rows"]]
    loading = markdown_table(["set", "reader", "workers", "records/s"], body, "lllr")
    converting = markdown_table([f"conversion of {result['conversions'][0]['num_records']:,} 64 px jpeg pairs",
                                 "records/s", "seconds"],
                                [(row["tool"], f"{row['records_per_s']:,.0f}", f"{row['seconds']:.1f}")
                                 for row in result["conversions"]], "lrr")
    limits = markdown_table(["set", "fastdata records/s", "decode limit records/s", "ratio (median of rounds)"],
                            [(pair["data"], f"{statistics.median(pair['fastdata']):,.0f}",
                              f"{pair['limit_per_s']:,.0f}", f"{pair['ratio']:.2f}") for pair in result["limits"]],
                            "lrrr")
    versions = ", ".join(f"{name} {version or 'not installed'}" for name, version in result["versions"].items())
    return "\n".join([f"## Records: dict batches ({result['num_records']:,} records per set, batch "
                      f"{result['batch_size']}, shuffled)", "",
                      "pairs: image + caption (77 words) + tokens; boxes: image + 0-50 boxes and labels. The peers "
                      f"hold the values fastdata stored. Versions: {versions}.", "", loading, "",
                      "JPEG sets against the decode limit (decode_jpeg of every stored JPEG on every core), timed in "
                      "turn in one process:", "", limits, "", converting])
