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
from contextlib import contextmanager
from functools import partial

from benchmarks import inputs
from benchmarks.rows import measure_row, worker_mb
from fastdata.measure.engine import consume
from fastdata.measure.tables import Row, markdown_table

MAX_LENGTH = 256
TEXT_VS_LIMIT = 0.5  # target: packed text at least half the limit


def prepare(config):
    """Make and convert the corpus; return the setup shared by the rows."""
    corpus = inputs.review_corpus(config["workdir"], config["text_docs"], config["seed"])
    files, conversion = inputs.convert_reviews(corpus, config["workdir"], MAX_LENGTH)
    from fastdata.converters.text import find_texts

    _, relpaths, labels = find_texts(corpus)
    paths = [os.path.join(corpus, path) for path in relpaths]
    setup = {key: config[key] for key in ("batch_size", "workers", "repeats", "min_seconds", "seed")}
    return {**setup, "corpus": corpus, "paths": paths, "labels": labels, "num_samples": len(paths), "files": files,
            "conversion": conversion}


def rows(workers):
    """Return the Row of every text row."""
    raw = "raw .txt files: read + Tokenizer.encode per item, pad in collate_fn"
    found = [Row("raw_files", raw, "0", _raw_epochs, {"num_workers": 0}, "raw", memory=True),
             Row("raw_files_workers", raw, f"{workers} (persistent)", _raw_epochs, {"num_workers": workers}, "raw",
                 memory=True)]
    for fmt in ("hdf5", "arrow"):
        name = "HDF5" if fmt == "hdf5" else "Arrow"
        padded = f"fastdata {name}: make_loader, padded to longest"
        for key, method, workers_label, options in (
            ("padded", padded, "0 (defaults)", {}),
            ("padded_workers", padded, f"{workers} (persistent)", {"num_workers": workers}),
            ("pad_to", f"fastdata {name}: make_loader, pad_to={MAX_LENGTH}", "0 (defaults)", {"pad_to": MAX_LENGTH}),
            ("bucketed", f"fastdata {name}: make_loader, BucketBatchSampler", "0 (defaults)", {"bucketed": True}),
        ):
            found.append(Row(f"{fmt}-{key}", method, workers_label, _packed_epochs, {"fmt": fmt, **options}, "packed",
                             memory=True))
    copy = "copy: the batch's stored tokens from the memmap"
    found += [Row("copy_rows", f"{copy}, row by row into a preallocated [B, {MAX_LENGTH}] array", "1 thread",
                  _copy_epochs, {"contiguous": False}, "copy", memory=True, limit=True),
              Row("copy_contiguous", "copy: as many bytes per batch in one contiguous slice (scale only)", "1 thread",
                  _copy_epochs, {"contiguous": True}, "copy", memory=True, limit=True)]
    return found


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
    from fastdata.measure.limits import token_copy_epochs

    columns, _ = read_packed(setup["files"]["hdf5"])
    yield token_copy_epochs(columns.samples, columns.offsets, setup["batch_size"], MAX_LENGTH,
                            contiguous=contiguous, seed=setup["seed"])


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
                     f"{row['ratio_vs_raw']:,.1f}x", worker_mb(row)))
    headers = ["method", "workers", "sequences/s", "fraction of limit", "vs raw files (0 workers)",
               "per-worker MB: USS (private dirty)"]
    return markdown_table(headers, body, "llrrrr")


def run(config, fresh):
    """Run the text section; return its results (rows, conversion, targets, table)."""
    setup = prepare(config)
    print(f"text: {len(setup['paths'])} reviews in {setup['corpus']}", flush=True)
    measured = [fresh.run(measure_row, row, setup) if row.kind == "raw"  # slow rows: one process is enough
                else fresh.run_median(config["process_repeats"], measure_row, row, setup)  # NOTE [process to process]
                for row in rows(config["workers"])]
    targets = summarize(measured)
    padding = padding_shares(setup["files"]["hdf5"], config["batch_size"], config["seed"])
    return {
        "num_samples": len(setup["paths"]),
        "max_length": MAX_LENGTH,
        "files": setup["files"],
        "conversion": setup["conversion"],
        "padding": padding,
        "rows": measured,
        "targets": targets,
        "table": table(measured),
    }
