"""Text section: raw .txt files tokenized per sample versus packed HDF5 and Arrow, padded and bucketed.

Run through benchmarks/run.py (``--only text``). Makes an IMDB-like corpus
of review-like texts (median ~220 tokens), converts it with the "words"
tokenizer cut to 256 tokens, and measures sequences/s (median of timed
passes after a warm-up epoch, each row in a fresh process) for:

* raw files: a Dataset reading one ``.txt`` per item and encoding it with the
  same Tokenizer, padded in ``collate_fn`` (0 and N workers);
* packed files through ``make_loader``: padded to the longest sequence of
  each random batch (defaults, and with N workers), padded to 256, and
  bucketed by length with BucketBatchSampler;
* the limit: the same stored tokens copied from the memory map in the same
  batches, row by row into a preallocated ``[B, 256]`` array (no padding
  fill, no widening); and, for scale only, one contiguous copy of as many
  bytes per batch (random samples cannot be read that way).
"""

import os
import statistics
from contextlib import contextmanager
from functools import partial

import _prepare
import numpy as np
from _system import WorkerMemoryProbe
from _timing import markdown_table, measure_rate

MAX_LENGTH = 256
TEXT_VS_LIMIT = 0.5  # target: packed text at least half the limit


def prepare(config):
    """Make and convert the corpus; return the setup shared by the rows."""
    corpus = _prepare.review_corpus(config["workdir"], config["text_docs"], config["seed"])
    files, conversion = _prepare.convert_reviews(corpus, config["workdir"], MAX_LENGTH)
    from fastdata.converters.text import find_texts

    _, relpaths, labels = find_texts(corpus)
    paths = [os.path.join(corpus, path) for path in relpaths]
    setup = {key: config[key] for key in ("batch_size", "workers", "repeats", "min_seconds", "seed")}
    return {**setup, "corpus": corpus, "paths": paths, "labels": labels, "files": files, "conversion": conversion}


def row_specs(workers):
    """Return ``(key, method, workers label, kind, options)`` for every text row."""
    raw = "raw .txt files: read + Tokenizer.encode per item, pad in collate_fn"
    specs = [
        ("raw_files", raw, "0", "raw", {"num_workers": 0}),
        ("raw_files_workers", raw, f"{workers} (persistent)", "raw", {"num_workers": workers}),
    ]
    for fmt in ("hdf5", "arrow"):
        name = "HDF5" if fmt == "hdf5" else "Arrow"
        specs += [
            (f"{fmt}-padded", f"fastdata {name}: make_loader, padded to longest", "0 (defaults)", "packed",
             {"fmt": fmt}),
            (f"{fmt}-padded_workers", f"fastdata {name}: make_loader, padded to longest", f"{workers} (persistent)",
             "packed", {"fmt": fmt, "num_workers": workers}),
            (f"{fmt}-pad_to", f"fastdata {name}: make_loader, pad_to={MAX_LENGTH}", "0 (defaults)", "packed",
             {"fmt": fmt, "pad_to": MAX_LENGTH}),
            (f"{fmt}-bucketed", f"fastdata {name}: make_loader, BucketBatchSampler", "0 (defaults)", "packed",
             {"fmt": fmt, "bucketed": True}),
        ]
    copy = "copy: the batch's stored tokens from the memmap"
    specs += [
        ("copy_rows", f"{copy}, row by row into a preallocated [B, {MAX_LENGTH}] array", "1 thread", "copy",
         {"contiguous": False}),
        ("copy_contiguous", "copy: as many bytes per batch in one contiguous slice (scale only)", "1 thread", "copy",
         {"contiguous": True}),
    ]
    return specs


def measure_row(spec, setup):
    """Measure one row in its own process; return its dict."""
    key, method, workers_label, kind, options = spec
    print(f"  {method} [{workers_label}] ...", end="", flush=True)
    probe = WorkerMemoryProbe()
    with _EPOCH_BUILDERS[kind](setup, **options) as run_epoch:
        rate = measure_rate(probe.wrap(run_epoch), setup["repeats"], min_seconds=setup["min_seconds"])
        memory = probe.report()
    if rate.samples_per_pass != rate.epochs_per_pass * len(setup["paths"]):
        raise RuntimeError(f"{key}: an epoch gave {rate.samples_per_pass // rate.epochs_per_pass} sequences")
    print(f" {rate.samples_per_s:,.0f} seq/s", flush=True)
    return {"key": key, "method": method, "workers": workers_label, **rate.to_dict(), "memory": memory}


def consume(loader):
    """Iterate one epoch, touching every batch; return the sequences seen."""
    count = 0
    for batch in loader:
        tokens = batch[0]
        count += len(tokens)
        int(tokens[-1, 0])
    return count


@contextmanager
def _raw_epochs(setup, num_workers):
    from torch.utils.data import DataLoader

    from fastdata import Tokenizer
    from fastdata.measure.baselines import PadCollate, RawTextDataset

    tokenizer = Tokenizer.from_file(setup["files"]["hdf5"])  # the stored vocabulary and max_length
    dataset = RawTextDataset(setup["paths"], setup["labels"], tokenizer)
    loader = DataLoader(dataset, setup["batch_size"], shuffle=True, num_workers=num_workers,
                        persistent_workers=num_workers > 0, collate_fn=PadCollate(tokenizer.pad_id))
    yield partial(consume, loader)


@contextmanager
def _packed_epochs(setup, fmt, num_workers=0, pad_to=None, bucketed=False):
    from fastdata import BucketBatchSampler, make_loader, open_dataset

    dataset = open_dataset(setup["files"][fmt])
    kwargs = {"num_workers": num_workers} if num_workers else {}  # defaults unless forced
    if pad_to is not None:
        kwargs["pad_to"] = pad_to
    if bucketed:
        sampler = BucketBatchSampler(dataset.lengths, setup["batch_size"], shuffle=True, seed=setup["seed"])
        loader = make_loader(dataset, batch_sampler=sampler, **kwargs)
    else:
        loader = make_loader(dataset, setup["batch_size"], shuffle=True, seed=setup["seed"], **kwargs)
    yield partial(consume, loader)


@contextmanager
def _copy_epochs(setup, contiguous):
    """Epochs copying each batch's stored tokens from the memmap (no loader, no padding fill)."""
    from fastdata.formats import read_packed

    columns, _ = read_packed(setup["files"]["hdf5"])
    values, offsets = np.asarray(columns.samples), np.asarray(columns.offsets)
    order = np.random.default_rng(setup["seed"]).permutation(len(offsets) - 1)
    size = setup["batch_size"]
    batches = [np.sort(order[i : i + size]) for i in range(0, len(order), size)]
    out = np.zeros((size, MAX_LENGTH), values.dtype)
    flat = out.reshape(-1)

    def copy_rows():
        for indices in batches:
            starts, stops = offsets[indices].tolist(), offsets[indices + 1].tolist()
            for row, (start, stop) in enumerate(zip(starts, stops)):
                out[row, : stop - start] = values[start:stop]
        return len(order)

    def copy_contiguous():
        for indices in batches:
            count = int((offsets[indices + 1] - offsets[indices]).sum())
            start = int(offsets[indices[0]]) % max(1, len(values) - count)
            flat[:count] = values[start : start + count]
        return len(order)

    yield copy_contiguous if contiguous else copy_rows


_EPOCH_BUILDERS = {"raw": _raw_epochs, "packed": _packed_epochs, "copy": _copy_epochs}


def padding_shares(path, batch_size, seed):
    """Return the padded share of ``[B, T]`` cells with random and with bucketed batches."""
    from fastdata import BucketBatchSampler, open_dataset

    sampler = BucketBatchSampler(open_dataset(path).lengths, batch_size, shuffle=True, seed=seed)
    return sampler.padding(0)


# ---------------------------------------------------------------- report


def summarize(rows):
    """Add fractions of the limit and ratios to the raw files; return the target checks."""
    by_key = {row["key"]: row for row in rows}
    limit_row, raw = by_key["copy_rows"], by_key["raw_files"]["samples_per_s"]
    limit_row["is_limit"] = True
    for row in rows:
        row["fraction_of_limit"] = row["samples_per_s"] / limit_row["samples_per_s"]
        row["ratio_vs_raw"] = row["samples_per_s"] / raw
    targets = []
    for fmt in ("hdf5", "arrow"):
        value = by_key[f"{fmt}-padded"]["fraction_of_limit"]
        targets.append({"name": f"text {fmt} packed, make_loader defaults vs copy limit", "value": value,
                        "threshold": TEXT_VS_LIMIT, "at_least": True,
                        "info": f"{by_key[f'{fmt}-padded']['ratio_vs_raw']:,.1f}x the raw files (0 workers)"})
    return targets


def table(rows):
    """Return the Markdown table of the text rows."""
    body = []
    for row in rows:
        method = row["method"] + (" = LIMIT" if row.get("is_limit") else "")
        body.append((method, row["workers"], f"{row['samples_per_s']:,.0f}", f"{row['fraction_of_limit']:.3g}",
                     f"{row['ratio_vs_raw']:,.1f}x", _worker_mb(row)))
    headers = ["method", "workers", "sequences/s", "fraction of limit", "vs raw files (0 workers)",
               "per-worker MB: USS (private dirty)"]
    return markdown_table(headers, body, "llrrrr")


def _worker_mb(row):
    workers = (row.get("memory") or {}).get("per_worker") or []
    if not workers:
        return "-"
    uss = statistics.mean(w["uss"] for w in workers) / 1e6
    return f"{uss:,.0f} ({statistics.mean(w.get('private_dirty', 0) for w in workers) / 1e6:,.0f})"


def run(config, fresh):
    """Run the text section; return its results (rows, conversion, targets, table)."""
    setup = prepare(config)
    print(f"text: {len(setup['paths'])} reviews in {setup['corpus']}", flush=True)
    rows = [fresh.run(measure_row, spec, setup) if spec[3] == "raw"  # slow rows: one process is enough
            else fresh.run_median(config["process_repeats"], measure_row, spec, setup)  # NOTE [process to process]
            for spec in row_specs(config["workers"])]
    targets = summarize(rows)
    padding = padding_shares(setup["files"]["hdf5"], config["batch_size"], config["seed"])
    return {
        "num_samples": len(setup["paths"]),
        "max_length": MAX_LENGTH,
        "files": setup["files"],
        "conversion": setup["conversion"],
        "padding": padding,
        "rows": rows,
        "targets": targets,
        "table": table(rows),
    }
