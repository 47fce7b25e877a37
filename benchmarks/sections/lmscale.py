"""Language-model sequences at scale: a 1-2 GB tokenized corpus, warm and bigger than the page cache.

Run through benchmarks/run.py (``--only lmscale``). Makes (once, cached under
the work folder) ``lmscale_docs`` documents of words drawn from a Zipf law
over a made-up vocabulary (lengths log-normal around MEAN_WORDS words:
``make_review`` writes ~1 ms a document, 30 minutes for this corpus),
trains a word-level ``tokenizers`` model on the vocabulary, and converts
them with ``fastdata convert text`` (no labels, ``eod``) into a shard
folder; then writes the same stored ids, each document followed by its
end-of-document id, as nanoGPT's ``train.bin`` and through LitData's
``optimize`` for its TokensLoader (where LitData imports). Batches of 8 x
2048 tokens:

* warm (every file read into the page cache first): fastdata concat (dict
  batches) and tokens_only, nanoGPT's get_batch, LitData's TokensLoader and
  the copy of the same rows (the limit, NOTE [copy limit] in lm.py), timed
  in turn in one process, ``lmscale_rounds`` rounds;
* bigger than the page cache: each row for ``lmscale_seconds`` in a fresh
  process inside a memory cgroup of ``lmscale_cache_limit`` (NOTE [bounded
  page cache] in fastdata/measure/pagecache.py), the files evicted first:
  the sequential read of the shard files before and after the fastdata
  rows (NOTE [drifting disk] in scale.py), fastdata tokens_only and concat
  with ``shuffle=True`` (the block order of sequences, NOTE [sequence
  blocks]), tokens_only over the same documents written by ``fastdata.write``
  as a record file's tokens field (``records``: made once beside the
  corpus), nanoGPT's get_batch and LitData; and RANKS gloo ranks of one
  machine (spawned in the cgroup, an all_reduce a step, each BATCH rows a
  step) reading tokens_only in a block order of RANK_WINDOW blocks a window,
  through the windows they share (``ranks``, NOTE [shared sequence windows])
  and through the kernel hints they had before (``ranks_hints``: no file to
  share, the rank's warning recorded).

A "sample" is a sequence of SEQ_LEN tokens; tokens/s = samples/s x SEQ_LEN.
"""

import json
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.sections import lm
from fastdata.measure.tables import markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL = {"lmscale_docs": 1_900_000, "lmscale_cache_limit": 1 << 30, "lmscale_seconds": 15.0, "lmscale_rounds": 5}
# QUICK's cgroup holds the ranks rows' processes (torch and gloo: ~300 MB each; 512 MB killed one in scale.py)
QUICK = {"lmscale_docs": 3000, "lmscale_cache_limit": 1 << 30, "lmscale_seconds": 0.5, "lmscale_rounds": 2}
SEQ_LEN, BATCH, EOD = lm.SEQ_LEN, lm.BATCH, lm.EOD
VOCAB_WORDS = 30_000  # distinct words of the made-up vocabulary
MEAN_WORDS = 270  # mean words a document (the lm section's reviews: ~270 tokens)
ZIPF = 1.1  # the exponent of the words' frequencies
CHUNK_DOCS = 50_000  # documents made and written at a time
SHARD_BYTES = 64 << 20  # the converter's default shard size
VS_COPY, VS_PEER, VS_DISK = lm.VS_COPY, lm.VS_PEER, 0.8  # bars: the issue's
WARM = ("tokens", "concat", "nanogpt", "copy", "litdata")  # timed in turn, warm
WARM_TARGETS = {"copy": ("tokens", "the copy of the same rows (warm)", VS_COPY),
                "nanogpt": ("concat", "nanoGPT get_batch (warm)", VS_PEER),
                "litdata": ("tokens", "LitData TokensLoader (warm)", VS_PEER)}
VS_HINTS = 1.0  # the ranks sharing windows over the same ranks keeping kernel hints
VS_TEXT = 0.9  # a record field's tokens_only from disk over the text folder's: the same reads
COLD = ("limit", "tokens", "records", "limit", "concat", "nanogpt", "litdata", "ranks", "ranks_hints")  # each in a
# fresh process, in the cgroup
RANKS = 2  # gloo ranks of the ranks rows
# Two of the default windows (1024 blocks of ~256 KiB: ~0.5 GB shared) do not fit the 1 GiB cgroup beside two ranks
# (window_room refuses them, NOTE [window room]); 256 blocks do.
RANK_WINDOW = 256


def settings(config):
    """Return the section's sizes: FULL (QUICK with --quick), with any ``lmscale_*`` key of ``config`` over it."""
    given = {key: value for key, value in config.items() if key.startswith("lmscale_")}
    return {**(QUICK if config.get("quick") else FULL), **given}


def run(config, fresh):
    """Run the section; return its rows, targets and text."""
    conf = settings(config)
    workdir = os.path.join(config["workdir"], "lmscale")
    # In a process of its own: LitData's optimize leaves a SIGINT handler that ends its process with os._exit(0)
    files = fresh.run(corpus, workdir, conf["lmscale_docs"], config["seed"])
    setup = {"files": files, "sequences": -(-(files["tokens"] - 1) // SEQ_LEN), "seed": config["seed"],
             "min_seconds": config["min_seconds"], "rounds": conf["lmscale_rounds"]}
    results = {"settings": conf, "files": {key: value for key, value in files.items() if key != "eod"},
               "warm": fresh.run(measure_warm, setup), "cold": cold_rows(files, conf)}
    results["targets"] = targets_of(results)
    results["text"] = text(results)
    return results


# ---------------------------------------------------------------- the corpus


def corpus(workdir, num_docs, seed):
    """Make the corpus, its conversion and the peers' forms of it unless cached; return their paths and facts."""
    from benchmarks.inputs import _cached
    from fastdata.measure.machine import installed_version

    peers = {"litdata": installed_version("litdata")}
    params = {"docs": num_docs, "seed": seed, "vocab": VOCAB_WORDS, "mean_words": MEAN_WORDS, "zipf": ZIPF,
              "shard_bytes": SHARD_BYTES, **peers}
    seconds = _cached(workdir, params, lambda: _make(workdir, num_docs, seed, litdata=peers["litdata"] is not None))
    with open(os.path.join(workdir, "facts.json")) as f:
        files = json.load(f)
    files["records"] = _records(files, os.path.join(workdir, "records"))
    files["record_paths"] = _shard_paths(files["records"])
    return {**files, "made_seconds": seconds}


def _records(files, folder):
    """Write the corpus's documents as a record folder's uint16 tokens field with ``fastdata.write``, unless written
    (its index is written last); return the folder."""
    from fastdata import Field, write

    if os.path.exists(os.path.join(folder, "index.json")):
        return folder

    def documents():
        for values, offsets in _stored_documents(files["shard_paths"]):
            bounds = offsets.tolist()
            yield from ({"tokens": values[start:stop]} for start, stop in zip(bounds, bounds[1:]))

    write(documents(), folder, {"tokens": Field("tokens", dtype="uint16")}, shard_size=SHARD_BYTES, overwrite=True)
    return folder


def _make(workdir, num_docs, seed, litdata):
    """Write the documents, train the tokenizer, convert, write train.bin and (``litdata``: where it imports)
    LitData's chunks; save the facts."""
    import tokenizers

    from fastdata import convert_text

    os.makedirs(workdir)
    jsonl = os.path.join(workdir, "docs.jsonl")
    words = _write_documents(jsonl, num_docs, seed)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(words)],
                                  tokenizers.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", EOD]))
    tokenizer.save(os.path.join(workdir, "tokenizer.json"))
    folder = os.path.join(workdir, "docs")
    report = convert_text(jsonl, folder, tokenizer=os.path.join(workdir, "tokenizer.json"), label_field=None,
                          eod=EOD, shard_size=SHARD_BYTES, workers=2, progress=False)
    os.remove(jsonl)  # 2.5 GB of text, converted
    files = {"fastdata": folder, "eod": tokenizer.token_to_id(EOD), "documents": report.num_samples,
             "convert_seconds": report.seconds, "bin": os.path.join(workdir, "train.bin")}
    files["tokens"] = _write_stream(folder, files["bin"], files["eod"])
    files["shard_paths"] = _shard_paths(folder)
    files["bytes"] = sum(os.path.getsize(path) for path in files["shard_paths"])
    if litdata:
        files["litdata"] = lm._write_litdata(files["bin"], os.path.join(workdir, "litdata"))
        files["litdata_blocks"] = len(lm._litdata_blocks(files["litdata"], seed))
    with open(os.path.join(workdir, "facts.json"), "w") as f:
        json.dump(files, f)


def _write_documents(path, num_docs, seed):
    """Write ``num_docs`` JSON Lines documents of made-up words; return the vocabulary (a list of str)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    spellings = {bytes(letters[rng.integers(0, 26, int(rng.integers(2, 11)))]).decode() for _ in range(2 * VOCAB_WORDS)}
    words = np.array(sorted(spellings)[:VOCAB_WORDS])
    rng.shuffle(words)  # which word is frequent: not the alphabet's order
    with open(path, "w") as f:
        for first in range(0, num_docs, CHUNK_DOCS):
            count = min(CHUNK_DOCS, num_docs - first)
            lengths = np.maximum(1, rng.lognormal(np.log(MEAN_WORDS) - 0.5, 1.0, count).astype(np.int64))
            picks = (rng.zipf(ZIPF, int(lengths.sum())) - 1) % VOCAB_WORDS
            ends = np.cumsum(lengths).tolist()
            drawn = words[picks].tolist()
            f.writelines(json.dumps({"text": " ".join(drawn[end - length : end])}) + "\n"
                         for end, length in zip(ends, lengths.tolist()))
    return words.tolist()


def _write_stream(folder, path, eod):
    """Write every document's ids followed by ``eod`` as uint16 to ``path``, shard by shard; return the count."""
    written = 0
    with open(path, "wb") as f:
        for values, offsets in _stored_documents(_shard_paths(folder)):
            stream = np.insert(values, offsets[1:], eod).astype(np.uint16)
            f.write(stream.tobytes())
            written += len(stream)
    return written


def _stored_documents(shard_paths):
    """Yield ``(ids, offsets)`` of each converted text shard: its documents' stored ids, back to back."""
    from fastdata.formats import read_packed

    for shard in shard_paths:
        columns, _ = read_packed(shard)
        yield np.asarray(columns.samples), np.asarray(columns.offsets)


def _shard_paths(folder):
    from fastdata.formats.shards import read_index

    index = read_index(folder)
    return [index.path(shard) for shard in range(index.num_shards)]


# ---------------------------------------------------------------- warm


def measure_warm(setup):
    """Read every file into the page cache, then time the WARM rows in turn; return key -> tokens/s per round."""
    from contextlib import ExitStack

    from fastdata.measure.engine import interleaved_rates
    from fastdata.measure.pagecache import sequential_read

    files = setup["files"]
    sequential_read(files["shard_paths"] + [files["bin"]] + _litdata_paths(files))
    builders = {"tokens": (lm._fastdata_epochs, {"packing": "tokens"}),
                "concat": (lm._fastdata_epochs, {"packing": "concat"}), "nanogpt": (lm._nanogpt_epochs, {}),
                "copy": (lm._copy_epochs, {"plain": True}), "litdata": (lm._litdata_epochs, {})}
    with ExitStack() as stack:
        runs = {key: stack.enter_context(builders[key][0](setup, **builders[key][1])) for key in WARM
                if key != "litdata" or "litdata" in files}
        rates = interleaved_rates(runs, setup["rounds"], setup["min_seconds"])  # sequences/s
    return {key: [rate * SEQ_LEN for rate in per_round] for key, per_round in rates.items()}


def _litdata_paths(files):
    if "litdata" not in files:
        return []
    return sorted(os.path.join(files["litdata"], name) for name in os.listdir(files["litdata"]))


# ---------------------------------------------------------------- bigger than the page cache


def cold_rows(files, conf):
    """Run each COLD row in a fresh process inside a memory cgroup of the section's limit, files evicted first."""
    from fastdata.measure.pagecache import MemoryCgroup, cgroup_problem

    problem = cgroup_problem()
    if problem:
        return {"skipped": f"not measured: {problem}"}
    rows = []
    for what in COLD:
        if what == "litdata" and "litdata" not in files:
            continue
        args = {"what": what, "files": files, "seconds": conf["lmscale_seconds"]}
        print(f"  {what} from disk ...", end="", flush=True)
        with MemoryCgroup(conf["lmscale_cache_limit"], name=f"fastdata-lmscale-{os.getpid()}") as group:
            argv = [sys.executable, "-c", "from benchmarks.sections.lmscale import measure_main; measure_main()",
                    json.dumps(args)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
            done = group.run(argv, timeout=600, cwd=REPO, env=env)
            usage = {key: group.stat()[key] for key in ("max_usage", "limit", "failcnt")}
        if done.returncode != 0:
            print(" failed", flush=True)
            rows.append({"what": what, "skipped": f"failed ({done.returncode}): {done.stderr.strip()[-1500:]}"})
            continue
        row = {"what": what, **json.loads(done.stdout.strip().splitlines()[-1]), "cgroup": usage}
        print(f" {row['tokens_per_s'] / 1e6:,.1f}M tokens/s, amplification {row['amplification']:.2f}", flush=True)
        rows.append(row)
    return {"limit_bytes": conf["lmscale_cache_limit"], "rows": rows}


def measure_main():
    """Entry of the measuring processes: ``python -c ... JSON``; prints one JSON line."""
    import fastdata  # noqa: F401  imported before the clock starts: the first batch times the read, not imports
    from benchmarks.machine import drop_from_page_cache
    from fastdata.measure.pagecache import ReadCounter

    args = json.loads(sys.argv[1])
    files, what = args["files"], args["what"]
    if what == "litdata":
        import litdata  # noqa: F401
    paths = files["shard_paths"] + files["record_paths"] + [files["bin"]] + _litdata_paths(files)
    drop = drop_from_page_cache(paths)
    counter = ReadCounter(files["bin"]).start()
    if what.startswith("ranks"):
        tokens, seconds, first, ranks = _read_with_ranks(what, files, args["seconds"])
    else:
        (tokens, seconds, first), ranks = _read_for(what, files, args["seconds"]), {}
    disk, process = counter.stop()[0], ranks.pop("process_bytes", counter.process_bytes)
    stored = tokens * np.dtype(np.uint16).itemsize  # the bytes of ids delivered
    print(json.dumps({"drop": drop, "tokens": tokens, "seconds": seconds, "first_batch_seconds": first,
                      "tokens_per_s": tokens / seconds, "mb_per_s": stored / seconds / 1e6, "disk_bytes": disk,
                      "process_bytes": process, "amplification": process / max(stored, 1),
                      "device_amplification": disk / max(stored, 1), **ranks}))


def _read_for(what, files, max_seconds):
    """Read with ``what`` for ``max_seconds``; return ``(tokens, seconds, seconds to the first batch)``.

    The sequential read counts its bytes as uint16 tokens; the loaders count SEQ_LEN tokens a sequence, and
    their rate counts from the first batch on (its shards opened: NOTE [first batch apart] in scale.py).
    """
    from fastdata.measure.pagecache import sequential_read

    if what == "limit":
        done, seconds = sequential_read(files["shard_paths"], max_seconds=max_seconds)
        return done // 2, seconds, 0.0
    batches = _batches(what, files)
    started = time.perf_counter()
    next(batches)
    first = time.perf_counter() - started
    counted_from, rows = time.perf_counter(), 0
    while time.perf_counter() - counted_from < max_seconds:
        rows += len(next(batches))
    seconds = time.perf_counter() - counted_from
    return rows * SEQ_LEN, seconds, first


def _read_with_ranks(what, files, max_seconds):
    """Read tokens_only rows with RANKS spawned gloo ranks for ``max_seconds``; return ``(tokens, seconds, seconds
    to the first batch, {their processes' read bytes, read-ahead, order, misses and warnings})``: tokens summed,
    seconds the longest rank's, each rank counting from its first batch."""
    import torch.multiprocessing as mp

    from benchmarks.machine import free_port

    port = free_port()
    out = os.path.join(os.path.dirname(files["fastdata"]), f"ranks-{os.getpid()}.json")
    mp.start_processes(_rank_main, args=(what, files, max_seconds, port, out), nprocs=RANKS, join=True,
                       start_method="spawn")
    with open(out) as f:
        ranks = json.load(f)
    os.remove(out)
    return (sum(rank["tokens"] for rank in ranks), max(rank["seconds"] for rank in ranks),
            max(rank["first"] for rank in ranks),
            {"process_bytes": sum(rank["process_bytes"] for rank in ranks), "readahead": ranks[0]["readahead"],
             "order": ranks[0]["order"], "misses": [rank["misses"] for rank in ranks],
             "fast_path_warnings": sorted({w for rank in ranks for w in rank["warnings"]})})


def _rank_main(rank, what, files, max_seconds, port, out):
    """One rank of _read_with_ranks: BATCH rows a step, an all_reduce a step (every rank takes as many)."""
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    from fastdata import make_loader, open_dataset
    from fastdata.errors import FastPathWarning
    from fastdata.measure.engine import close_loader
    from fastdata.measure.pagecache import process_read_bytes
    from fastdata.reading import sharedwindows

    if what == "ranks_hints":  # no file to share: each rank keeps the kernel hints (it warns)
        sharedwindows.SHARED_FOLDER = os.path.join(os.path.dirname(files["fastdata"]), "no-shared-folder")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=120))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FastPathWarning)
        loader = make_loader(open_dataset(files["fastdata"]), BATCH, shuffle="block", window=RANK_WINDOW,
                             seq_len=SEQ_LEN, eod=files["eod"], tokens_only=True)
        dist.barrier()
        started, done = time.perf_counter(), torch.zeros(1)
        rows, first, first_rows = 0, None, 0
        while not done.item():
            for batch in loader:
                rows += len(batch["tokens"])
                if first is None:  # counted from the first batch on: see NOTE [first batch apart] in scale.py
                    first, first_rows, counted_from = time.perf_counter() - started, rows, time.perf_counter()
                    before = process_read_bytes()
                done[0] = float(time.perf_counter() - counted_from >= max_seconds)
                dist.all_reduce(done)
                if done.item():
                    break
        seconds, read = time.perf_counter() - counted_from, process_read_bytes() - before
        readahead = loader.steps.readahead
        close_loader(loader)
    mine = {"tokens": (rows - first_rows) * SEQ_LEN, "seconds": seconds, "first": first, "process_bytes": read,
            "readahead": type(readahead).__name__, "misses": getattr(readahead, "misses", None),
            "order": [loader.sampler.order.shuffle, loader.sampler.order.block_size, loader.sampler.order.window],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, FastPathWarning)]}
    ranks = [None] * RANKS
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(ranks, f)
    dist.destroy_process_group()


def _batches(what, files):
    """Yield the batches (a tensor of rows) of reader ``what`` over ``files``, epoch after epoch."""
    if what in ("tokens", "concat", "records"):
        from fastdata import make_loader, open_dataset

        path = files["records"] if what == "records" else files["fastdata"]
        loader = make_loader(open_dataset(path), BATCH, shuffle=True, seq_len=SEQ_LEN, eod=files["eod"],
                             tokens_only=what != "concat")
        key = "input_ids" if what == "concat" else "tokens"
        while True:
            yield from (batch[key] for batch in loader)
    elif what == "nanogpt":
        data = np.memmap(files["bin"], dtype=np.uint16, mode="r")
        while True:
            yield lm.get_batch(data, BATCH)[0]
    else:
        from litdata import StreamingDataLoader

        loader = StreamingDataLoader(lm._litdata_blocks(files["litdata"], 0), batch_size=BATCH)
        while True:
            yield from loader


# ---------------------------------------------------------------- report


def targets_of(results):
    """Warm: medians of per-round ratios of a fastdata row over each peer; from disk: tokens_only over the
    sequential read around it (mean of the two) and over each peer."""
    targets = []
    warm = results["warm"]
    for key, (ours_key, name, bar) in WARM_TARGETS.items():
        if key in warm:
            ratios = [a / b for a, b in zip(warm[ours_key], warm[key])]
            label = "concat sequences" if ours_key == "concat" else "tokens_only rows"
            targets.append({"name": f"lmscale: fastdata {label} over {name}", "value": statistics.median(ratios),
                            "threshold": bar, "info": f"median of {len(ratios)} interleaved rounds; medians "
                            f"{statistics.median(warm[ours_key]) / 1e6:,.1f}M vs "
                            f"{statistics.median(warm[key]) / 1e6:,.1f}M tokens/s"})
    rows = [row for row in results["cold"].get("rows", []) if "skipped" not in row]
    limits = [row["tokens_per_s"] for row in rows if row["what"] == "limit"]
    by_what = {row["what"]: row for row in rows if row["what"] != "limit"}
    if limits and "tokens" in by_what:
        ours = by_what["tokens"]["tokens_per_s"]
        targets.append({"name": "lmscale: fastdata tokens_only rows from disk over the sequential read (bigger than "
                                "the page cache)", "value": ours / statistics.mean(limits), "threshold": VS_DISK,
                        "info": f"{ours / 1e6:,.1f}M tokens/s vs {', '.join(f'{v / 1e6:,.1f}M' for v in limits)} "
                                f"(reads before and after); amplification {by_what['tokens']['amplification']:.2f}"})
        if "records" in by_what:
            theirs = by_what["records"]["tokens_per_s"]
            targets.append({"name": "lmscale: a record file's tokens field from disk over the text folder's "
                                    "(tokens_only rows)", "value": theirs / ours, "threshold": VS_TEXT,
                            "info": f"{theirs / 1e6:,.1f}M vs {ours / 1e6:,.1f}M tokens/s; amplification "
                                    f"{by_what['records']['amplification']:.2f}"})
        if "ranks" in by_what and "ranks_hints" in by_what:
            shared, hints = by_what["ranks"], by_what["ranks_hints"]
            targets.append({"name": f"lmscale: {RANKS} ranks' tokens_only rows from disk through the windows they "
                                    "share over the kernel hints", "value": shared["tokens_per_s"] /
                            hints["tokens_per_s"], "threshold": VS_HINTS,
                            "info": f"{shared['tokens_per_s'] / 1e6:,.1f}M vs {hints['tokens_per_s'] / 1e6:,.1f}M "
                                    f"tokens/s ({shared['tokens_per_s'] / statistics.mean(limits):.2f} and "
                                    f"{hints['tokens_per_s'] / statistics.mean(limits):.2f} of the sequential read; "
                                    f"an all_reduce a step); read-ahead {shared['readahead']} vs "
                                    f"{hints['readahead']}; amplification {shared['amplification']:.2f} vs "
                                    f"{hints['amplification']:.2f}"})
        for peer, name in (("nanogpt", "nanoGPT get_batch"), ("litdata", "LitData TokensLoader")):
            if peer in by_what:
                theirs = by_what[peer]["tokens_per_s"]
                targets.append({"name": f"lmscale: fastdata tokens_only rows from disk over {name}",
                                "value": ours / theirs, "threshold": VS_PEER,
                                "info": f"{ours / 1e6:,.1f}M vs {theirs / 1e6:,.1f}M tokens/s, each {SEQ_LEN} a row"})
    return targets


def text(results):
    files, conf = results["files"], results["settings"]
    warm = markdown_table(["reader (warm)", "M tokens/s (median of rounds)"],
                          [(key, f"{statistics.median(rates) / 1e6:,.1f}") for key, rates in results["warm"].items()],
                          "lr")
    cold = results["cold"]
    if "skipped" in cold:
        cold_text = f"Bigger than the page cache: {cold['skipped']}."
    else:
        body = [(row["what"], "-" if "skipped" in row else f"{row['tokens_per_s'] / 1e6:,.1f}",
                 "-" if "skipped" in row else f"{row['mb_per_s']:,.0f}",
                 "-" if "skipped" in row else f"{row['amplification']:.2f}",
                 "-" if "skipped" in row else f"{row['first_batch_seconds']:.2f}",
                 row.get("skipped") or _read_ahead_note(row)) for row in cold["rows"]]
        cold_text = "\n".join([
            f"Bigger than the page cache: each row {conf['lmscale_seconds']:g} s in a fresh process in a memory "
            f"cgroup of {cold['limit_bytes'] / 1e9:.2f} GB (RSS included), every file evicted first; MB/s: the ids "
            "delivered (2 bytes a token), amplification: bytes the process read from disk over them.", "",
            markdown_table(["reader (from disk)", "M tokens/s", "MB/s", "amplification", "first batch s", "note"],
                           body, "lrrrrl")])
    made = files.get("made_seconds")
    return "\n".join([
        f"## Language-model sequences at scale ({files['documents']:,} documents, {files['tokens']:,} tokens with "
        f"end-of-document ids, {files['bytes'] / 1e9:.2f} GB of shards; batches of {BATCH} x {SEQ_LEN})", "",
        f"Converted by fastdata convert text (2 workers) in {files['convert_seconds']:.0f} s"
        + (f"; the corpus made in {made:.0f} s this run" if made else " (cached from an earlier run)") + ".", "",
        warm, "", cold_text])


def _read_ahead_note(row):
    """Return a ranks row's read-ahead and how many FastPathWarnings its ranks gave; "" for any other row."""
    if "readahead" not in row:
        return ""
    warned = len(row["fast_path_warnings"])
    return f"{RANKS} ranks, {row['readahead']}" + (f", {warned} warning{'s' * (warned > 1)}" if warned else "")
