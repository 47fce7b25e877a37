"""Language-model section: 2048-token sequences from one tokenized corpus, fastdata's packings against nanoGPT's
memmap, Hugging Face's group_texts and the copy of the same bytes.

Run through benchmarks/run.py (``--only lm``). Writes LM_DOCS review-like
documents (``make_review``, about 270 tokens each) as JSON Lines, trains a
word-level ``tokenizers`` model on them (with ``<|endoftext|>``), converts
them once with ``fastdata convert text`` (no labels), and writes the same
stored ids, each document followed by its end-of-document id, as nanoGPT's
``train.bin`` (uint16) and as a Hugging Face dataset cut into blocks of
SEQ_LEN + 1 (``group_texts``). Every row reads batches of BATCH sequences
(the median of process_repeats fresh processes, warm page cache):

* fastdata ``make_loader(seq_len=SEQ_LEN)``: packing concat, best_fit, and
  concat through ``fastdata.mix`` of two halves (the mixing's cost); and
  concat with ``tokens_only=True``: ``[BATCH, SEQ_LEN + 1]`` uint16 rows;
* nanoGPT's ``get_batch``: x and y from random offsets into the memmap;
* Hugging Face: the grouped blocks, ``with_format("torch")``, a shuffled
  DataLoader (the grouping is stored, done once before);
* LitData (where it imports): the stream written by ``optimize`` with
  ``TokensLoader``, read as blocks of SEQ_LEN + 1 by a shuffled
  ``StreamingDataLoader``: ``[BATCH, SEQ_LEN + 1]`` uint16, as tokens_only;
* the limit: the same ``[BATCH, SEQ_LEN + 1]`` rows copied, a slice per
  row, from a plain array view of the memmap into a preallocated uint16
  array, in shuffled order; beside it the same copy slicing the
  ``np.memmap`` itself, as nanoGPT does (its subclass costs ~3 us a slice:
  NOTE [copy limit]).

A "sample" is a sequence of SEQ_LEN tokens; tokens/s = samples/s x SEQ_LEN.
The targets compare fastdata with the others timed in turn in one process,
PAIRED_ROUNDS rounds (NOTE [interleaved rates] in fastdata/measure/engine.py):
rows measured in separate processes a minute apart put nanoGPT at 44.1M and
71.1M tokens/s in two runs. Each peer is compared with the fastdata row of
its own output: nanoGPT and Hugging Face (int64 inputs and labels) with the
dict batches, LitData and the copy ([B, T + 1] stored ids) with tokens_only.

NOTE [copy limit]: until 2026-11-28 the limit sliced the np.memmap itself;
a plain view of the same map copies the same rows 2.6x faster (8 rows of
2,049 uint16: 14-17 against 37-41 us, /tmp/lmt/copybench.py), since each
np.memmap slice runs the subclass's Python (``__array_finalize__``). The
faster one is the limit; the memmap copy stays beside it as a row.
"""

import json
import os
import shutil
import statistics
import time
from contextlib import contextmanager
from functools import partial

import numpy as np

from benchmarks.rows import measure_row
from benchmarks.sections.peers import offline_env
from fastdata.measure.engine import consume
from fastdata.measure.machine import installed_version
from fastdata.measure.tables import Row, markdown_table

LM_DOCS = 100_000  # documents (--quick: text_docs)
SEQ_LEN = 2048
BATCH = 8
EOD = "<|endoftext|>"
VS_COPY = 0.8  # fastdata concat over the copy of the same rows (the bar, warm)
VS_PEER = 1.0  # fastdata concat over each peer
CONVERT_ROUNDS = 3  # the conversion and datasets' timed in turn (--quick 1)
LITDATA_PIECES = 64  # inputs of LitData's optimize: the stream cut in this many pieces
PAIRED_ROUNDS = 7  # rounds of the interleaved passes behind the read targets (--quick 2)
PAIRED = ("concat", "tokens", "nanogpt", "hf", "litdata", "copy", "copy_memmap")  # timed in turn (where present)
TARGETS = {  # peer row -> (the fastdata row it is compared with, its name in the target, the bar)
    "copy": ("tokens", "the copy of the same rows (warm)", VS_COPY),
    "nanogpt": ("concat", "nanoGPT get_batch", VS_PEER),
    "hf": ("concat", "Hugging Face group_texts", VS_PEER),
    "litdata": ("tokens", "LitData TokensLoader", VS_PEER),
}


def prepare(workdir, num_docs, seed, rounds=1):
    """Write, tokenize and convert the corpus; write the peers' forms of the same ids. Return the files.

    The conversion and datasets' are timed in turn, ``rounds`` times each (``convert_seconds`` and
    ``hf_convert_seconds`` are lists): one of each put datasets at 15.1 s and 21.3 s in two runs.
    """
    import tokenizers

    from fastdata import convert_text
    from fastdata.formats import read_packed
    from fastdata.measure.synthetic import make_review

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    rng = np.random.default_rng(seed)
    texts = [make_review(rng) for _ in range(num_docs)]
    with open(os.path.join(workdir, "docs.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, tokenizers.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", EOD]))
    tokenizer.save(os.path.join(workdir, "tokenizer.json"))
    files = {"fastdata": os.path.join(workdir, "docs.h5"), "eod": tokenizer.token_to_id(EOD)}
    convert_seconds, hf_seconds = [], []
    for _ in range(rounds):
        report = convert_text(os.path.join(workdir, "docs.jsonl"), files["fastdata"], overwrite=True,
                              tokenizer=os.path.join(workdir, "tokenizer.json"), label_field=None, progress=False)
        convert_seconds.append(report.seconds)
        if installed_version("datasets"):
            hf_seconds.append(_hf_convert(workdir, tokenizer, len(read_packed(files["fastdata"])[0].samples)))
    columns, _ = read_packed(files["fastdata"])
    values, offsets = np.asarray(columns.samples), np.asarray(columns.offsets)
    stream = np.insert(values, offsets[1:], files["eod"]).astype(np.uint16)  # each document, then its eod
    files["bin"] = os.path.join(workdir, "train.bin")
    stream.tofile(files["bin"])
    files.update(tokens=len(stream), documents=report.num_samples, convert_seconds=convert_seconds)
    from fastdata import TokenSequences, open_dataset

    files["best_fit_rows"] = len(TokenSequences(open_dataset(files["fastdata"]), SEQ_LEN, files["eod"], "best_fit"))
    if installed_version("datasets"):
        files["hf"] = _write_hf(stream, os.path.join(workdir, "hf"))
        files["hf_convert_seconds"] = hf_seconds
    if installed_version("litdata"):
        files["litdata"] = _write_litdata(files["bin"], os.path.join(workdir, "litdata"))
        files["litdata_blocks"] = len(_litdata_blocks(files["litdata"], seed))
    return files


def _write_litdata(stream_path, folder):
    """The stream written by LitData's ``optimize`` for its TokensLoader, in LITDATA_PIECES pieces on 2 workers."""
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    shutil.rmtree(folder, ignore_errors=True)
    # keep_data_ordered: each worker writes a slice of the pieces in order. By default its workers share one queue,
    # and a chunk joined pieces that are not neighbours in the stream (a fresh-clone CI run saw a block of LitData's
    # that the stream does not hold).
    optimize(fn=partial(_stream_piece, stream_path), inputs=list(range(LITDATA_PIECES)), output_dir=folder,
             chunk_size=(SEQ_LEN + 1) * 1024, item_loader=TokensLoader(), num_workers=2, mode="overwrite",
             keep_data_ordered=True)
    return folder


def _stream_piece(stream_path, piece):
    """Yield piece ``piece`` of LITDATA_PIECES of the uint16 stream, as LitData's optimize takes it."""
    import torch

    stream = np.memmap(stream_path, dtype=np.uint16, mode="r")
    yield torch.from_numpy(np.array(stream[piece * len(stream) // LITDATA_PIECES :
                                           (piece + 1) * len(stream) // LITDATA_PIECES]))


def _hf_convert(workdir, tokenizer, tokens):
    """Seconds for datasets to tokenize the same JSONL with the same tokenizer: load_dataset, map(batched=True,
    num_proc=usable CPUs) with encode_batch, save_to_disk; checks it made as many ids as fastdata stored."""
    import datasets

    from fastdata._cpu import usable_cpus

    datasets.disable_progress_bars()
    for made in ("hf-cache", "hf-tokens"):  # an earlier round's: load_dataset would read its cache
        shutil.rmtree(os.path.join(workdir, made), ignore_errors=True)
    started = time.perf_counter()
    corpus = datasets.load_dataset("json", data_files=os.path.join(workdir, "docs.jsonl"), split="train",
                                   cache_dir=os.path.join(workdir, "hf-cache"))

    def encode(batch):
        return {"input_ids": [encoding.ids for encoding in tokenizer.encode_batch(batch["text"])]}

    encoded = corpus.map(encode, batched=True, num_proc=usable_cpus(), remove_columns=["text"])
    encoded.save_to_disk(os.path.join(workdir, "hf-tokens"))
    seconds = time.perf_counter() - started
    made = sum(len(ids) for ids in datasets.load_from_disk(os.path.join(workdir, "hf-tokens"))["input_ids"])
    if made != tokens:
        raise RuntimeError(f"datasets.map made {made} ids, fastdata stored {tokens}: not the same tokenization")
    return seconds


def _write_hf(stream, folder):
    """The stream as Hugging Face's run_clm group_texts leaves it: blocks of SEQ_LEN + 1 ids, the rest dropped."""
    import datasets

    datasets.disable_progress_bars()
    blocks = stream[: len(stream) // (SEQ_LEN + 1) * (SEQ_LEN + 1)].reshape(-1, SEQ_LEN + 1)
    datasets.Dataset.from_dict({"input_ids": blocks.astype(np.int32)}).save_to_disk(folder)
    return folder


def rows(files):
    """Return the Row of every measured reader and the limit."""
    found = [Row("concat", f"fastdata make_loader(seq_len={SEQ_LEN}), packing concat", "0 (defaults)",
                 _fastdata_epochs, {"packing": "concat"}, "fastdata"),
             Row("tokens", f"fastdata make_loader(seq_len={SEQ_LEN}, tokens_only=True): [B, T + 1] uint16",
                 "0 (defaults)", _fastdata_epochs, {"packing": "tokens"}, "fastdata"),
             Row("best_fit", f"fastdata make_loader(seq_len={SEQ_LEN}), packing best_fit", "0 (defaults)",
                 _fastdata_epochs, {"packing": "best_fit"}, "fastdata"),
             Row("mixed", "fastdata mix of two halves of the concat sequences, 1:1", "0 (defaults)",
                 _fastdata_epochs, {"packing": "mixed"}, "fastdata"),
             Row("nanogpt", "nanoGPT get_batch: random offsets into a uint16 memmap", "0", _nanogpt_epochs, {},
                 "peer"),
             Row("copy", "copy: the same [B, T + 1] rows from a plain view of the memmap into a preallocated uint16 "
                 "array", "1 thread", _copy_epochs, {"plain": True}, "copy", limit=True),
             Row("copy_memmap", "the same copy slicing the np.memmap (NOTE [copy limit])", "1 thread", _copy_epochs,
                 {"plain": False}, "copy")]
    if "hf" in files:
        found.append(Row("hf", "Hugging Face datasets: group_texts blocks, with_format('torch'), DataLoader",
                         "0", _hf_epochs, {}, "peer"))
    if "litdata" in files:
        found.append(Row("litdata", "LitData TokensLoader: StreamingDataLoader of [B, T + 1] uint16 blocks", "0",
                         _litdata_epochs, {}, "peer"))
    return found


def measure(row, setup):
    offline_env(setup["folder"])
    files = setup["files"]
    sequences = {"hf": setup["hf_blocks"], "best_fit": files["best_fit_rows"], "litdata": files.get("litdata_blocks"),
                 "tokens": (files["tokens"] - 1) // SEQ_LEN}.get(row.key, setup["sequences"])
    return measure_row(row, {**setup, "num_samples": sequences}, tokens_per_sample=SEQ_LEN)


@contextmanager
def _fastdata_epochs(setup, packing):
    from fastdata import TokenSequences, make_loader, mix, open_dataset

    dataset = open_dataset(setup["files"]["fastdata"])
    if packing == "tokens":
        loader = make_loader(dataset, BATCH, shuffle=True, seed=setup["seed"], seq_len=SEQ_LEN,
                             eod=setup["files"]["eod"], tokens_only=True)
        yield partial(consume, loader, key="tokens")
        return
    if packing == "mixed":  # the concat sequences, as two sources drawn 1:1
        sequences = TokenSequences(dataset, SEQ_LEN, setup["files"]["eod"])
        loader = make_loader(mix({"a": sequences, "b": sequences}, length=len(sequences)), BATCH)
    else:
        loader = make_loader(dataset, BATCH, shuffle=True, seed=setup["seed"], seq_len=SEQ_LEN,
                             eod=setup["files"]["eod"], packing=packing)
    yield partial(consume, loader, key="input_ids")


@contextmanager
def _nanogpt_epochs(setup):
    data = np.memmap(setup["files"]["bin"], dtype=np.uint16, mode="r")
    sizes = [min(BATCH, setup["sequences"] - start) for start in range(0, setup["sequences"], BATCH)]

    def epoch():  # as many sequences as the concat rows: random offsets, not an epoch of the tokens
        return sum(len(get_batch(data, size)[0]) for size in sizes)

    yield epoch


def get_batch(data, size):
    """nanoGPT's train.py get_batch on the CPU (its batch_size = ``size``) over the uint16 memmap ``data``."""
    import torch

    ix = torch.randint(len(data) - SEQ_LEN, (size,))
    x = torch.stack([torch.from_numpy(data[i : i + SEQ_LEN].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + SEQ_LEN].astype(np.int64)) for i in ix])
    return x, y


@contextmanager
def _copy_epochs(setup, plain):
    data = np.memmap(setup["files"]["bin"], dtype=np.uint16, mode="r")
    data = np.asarray(data) if plain else data  # see NOTE [copy limit]
    count = setup["sequences"]
    order = np.random.default_rng(setup["seed"]).permutation(count)
    starts = np.minimum(order * SEQ_LEN, len(data) - SEQ_LEN - 1).tolist()
    out = np.empty((BATCH, SEQ_LEN + 1), np.uint16)

    def epoch():
        for batch in range(0, count, BATCH):
            for row, start in enumerate(starts[batch : batch + BATCH]):
                out[row] = data[start : start + SEQ_LEN + 1]
        return count

    yield epoch


@contextmanager
def _hf_epochs(setup):
    import datasets
    from torch.utils.data import DataLoader

    blocks = datasets.load_from_disk(setup["files"]["hf"]).with_format("torch")
    loader = DataLoader(blocks, BATCH, shuffle=True)
    yield partial(consume, loader, key="input_ids")


@contextmanager
def _litdata_epochs(setup):
    from litdata import StreamingDataLoader

    loader = StreamingDataLoader(_litdata_blocks(setup["files"]["litdata"], setup["seed"]), batch_size=BATCH)
    yield partial(consume, loader)


def _litdata_blocks(folder, seed):
    """LitData's StreamingDataset of blocks of SEQ_LEN + 1 tokens of ``folder``, shuffled (a block never spans two
    of its chunks: a few tokens at each chunk's end are not read)."""
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    return StreamingDataset(folder, item_loader=TokensLoader(block_size=SEQ_LEN + 1), shuffle=True, seed=seed)


def run(config, fresh):
    """Run the LM section; return its rows, targets and text."""
    workdir = os.path.join(config["workdir"], "lm")
    num_docs = config["text_docs"] if config.get("quick") else LM_DOCS
    files = fresh.run(prepare, workdir, num_docs, config["seed"], 1 if config.get("quick") else CONVERT_ROUNDS)
    sequences = -(-(files["tokens"] - 1) // SEQ_LEN)
    setup = {key: config[key] for key in ("repeats", "min_seconds", "seed")}
    setup.update(files=files, folder=workdir, sequences=sequences, hf_blocks=files["tokens"] // (SEQ_LEN + 1),
                 batch_size=BATCH)
    found = rows(files)
    measured = [fresh.run_median(config["process_repeats"], measure, row, setup) for row in found]
    for row in measured:
        row["tokens_per_s"] = row["samples_per_s"] * SEQ_LEN
    paired = [row for row in found if row.key in PAIRED]
    rounds = 2 if config.get("quick") else PAIRED_ROUNDS
    result = {"rows": measured, "files": {key: value for key, value in files.items() if key != "eod"},
              "versions": {name: installed_version(name) for name in ("datasets", "tokenizers", "litdata")},
              "paired": fresh.run(measure_paired, paired, setup, rounds)}
    result["targets"] = targets_of(result["paired"], files)
    result["text"] = text(result)
    return result


def measure_paired(paired, setup, rounds):
    """Time the ``paired`` rows in turn in this process, ``rounds`` times; return key -> tokens/s per round."""
    from contextlib import ExitStack

    from fastdata.measure.engine import interleaved_rates

    offline_env(setup["folder"])
    with ExitStack() as stack:
        runs = {row.key: stack.enter_context(row.build(setup, **row.options)) for row in paired}
        rates = interleaved_rates(runs, rounds, setup["min_seconds"])  # sequences/s
    return {key: [rate * SEQ_LEN for rate in per_round] for key, per_round in rates.items()}


def targets_of(paired, files):
    """The read targets: medians of the per-round ratios of a fastdata row over each paired peer (TARGETS); the
    conversion's ratio."""
    targets = []
    for key, (ours_key, name, bar) in TARGETS.items():
        if key in paired:
            ours, theirs = paired[ours_key], paired[key]
            ratios = [a / b for a, b in zip(ours, theirs)]
            label = "concat sequences" if ours_key == "concat" else "tokens_only rows"
            targets.append({"name": f"lm: fastdata {label} over {name}", "value": statistics.median(ratios),
                            "threshold": bar, "info": f"median of {len(ratios)} interleaved rounds; medians "
                            f"{statistics.median(ours) / 1e6:,.1f}M vs {statistics.median(theirs) / 1e6:,.1f}M "
                            "tokens/s"})
    if "hf_convert_seconds" in files:
        ours, theirs = (statistics.median(files[key]) for key in ("convert_seconds", "hf_convert_seconds"))
        ratios = [b / a for a, b in zip(files["convert_seconds"], files["hf_convert_seconds"])]
        targets.append({"name": "lm: fastdata convert text tokens/s over datasets.map(batched=True, num_proc)",
                        "value": statistics.median(ratios), "threshold": VS_PEER,
                        "info": f"median of {len(ratios)} rounds in turn; medians {ours:.1f} vs {theirs:.1f} s"})
    return targets


def text(result):
    files = result["files"]
    body = [(row["method"], row["workers"], f"{row['tokens_per_s'] / 1e6:,.1f}", f"{row['samples_per_s']:,.0f}")
            for row in result["rows"]]
    table = markdown_table(["reader", "workers", "M tokens/s", "sequences/s"], body, "llrr")
    versions = ", ".join(f"{name} {version or 'not installed'}" for name, version in result["versions"].items())
    return "\n".join([f"## Language-model sequences ({files['documents']:,} documents, {files['tokens']:,} tokens "
                      f"with end-of-document ids; batches of {BATCH} x {SEQ_LEN}, warm)", "",
                      f"Converted in {_seconds(files['convert_seconds'])} (fastdata convert text, a word-level "
                      f"tokenizers file){_hf_converted(files)}. Versions: {versions}.", "", table])


def _hf_converted(files):
    if "hf_convert_seconds" not in files:
        return ""
    return (f"; datasets took {_seconds(files['hf_convert_seconds'])} for the same tokenizer (load_dataset, "
            "map(batched=True, num_proc) with encode_batch, save_to_disk)")


def _seconds(rounds):
    return ", ".join(f"{seconds:.1f}" for seconds in rounds) + " s" + (" in turn" if len(rounds) > 1 else "")
