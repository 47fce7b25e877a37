"""make_loader(seq_len=...): language-model sequences cut at load time from documents (NOTE [concat packing])."""

import re
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import EOD, memory_short_of, run_cli, stored_sequences, word_corpus

from fastdata import Field, OptionError, TokenSequences, convert_text, make_loader, mix, open_dataset, write
from fastdata.errors import FastPathWarning
from fastdata.loading.helper import HelperReadAhead
from fastdata.loading.sequences import DICT_TOKEN_BYTES, GROUP_BATCHES, GROUP_BYTES, IGNORE_INDEX, cu_seqlens
from fastdata.loading.sequencewindows import SequenceWindows, WholeStream
from fastdata.reading.kernel import PAGE
from fastdata.reading.readahead import ReadAhead
from fastdata.reading.shuffles import BLOCK_BYTES, block_settings
from fastdata.reading.windows import direct_alignment


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``(file, shard folder, documents [ids], eod id)``: support.word_corpus's 240 documents."""
    root = tmp_path_factory.mktemp("corpus")
    eod = word_corpus(root)
    documents, _, metadata = stored_sequences(root / "docs.h5")
    assert sum(map(len, documents)) > 20_000 and len(documents) == 240
    return root / "docs.h5", root / "docs", documents, eod


def _stream(documents, eod):
    return np.concatenate([np.append(document, eod) for document in documents])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.integers(1, 700), picks=st.lists(st.integers(0, 10**9), min_size=1, max_size=9),
       sharded=st.booleans())
def test_each_sequence_is_its_slice_of_the_documents_joined_with_eod(corpus, seq_len, picks, sharded):
    path, folder, documents, eod = corpus
    stream = _stream(documents, eod)
    sequences = make_loader(open_dataset(folder if sharded else path), 4, seq_len=seq_len, eod=EOD).dataset
    assert len(sequences) == -(-(len(stream) - 1) // seq_len)
    indices = np.array([pick % len(sequences) for pick in picks])
    batch = sequences.read_batch(indices)
    for row, index in enumerate(indices.tolist()):
        start = index * seq_len
        inputs, targets = stream[start : start + seq_len], stream[start + 1 : start + seq_len + 1]
        assert batch["input_ids"][row, : len(inputs)].tolist() == inputs.tolist()
        assert batch["labels"][row, : len(targets)].tolist() == targets.tolist()
        assert (batch["labels"][row, len(targets) :] == IGNORE_INDEX).all()
    _check_positions(batch, documents, seq_len, indices, len(stream))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.integers(1, 700), picks=st.lists(st.integers(0, 10**9), min_size=1, max_size=9),
       source=st.sampled_from(["file", "folder", "records"]))
def test_token_rows_are_the_stored_ids_of_each_full_row(corpus, tmp_path_factory, seq_len, picks, source):
    # NOTE [token rows]: [B, T + 1] of the stored dtype, the stream's last partial row left out
    path, folder, documents, eod = corpus
    stream = _stream(documents, eod)
    dataset = _records(corpus, tmp_path_factory) if source == "records" else open_dataset(
        folder if source == "folder" else path)
    sequences = make_loader(dataset, 4, seq_len=seq_len, eod=eod, tokens_only=True).dataset
    assert len(sequences) == (len(stream) - 1) // seq_len
    indices = np.array([pick % len(sequences) for pick in picks])
    tokens = sequences.read_batch(indices)["tokens"]
    assert tokens.dtype == torch.uint16 and tokens.shape == (len(indices), seq_len + 1)
    for row, index in enumerate(indices.tolist()):
        assert tokens[row].tolist() == stream[index * seq_len : (index + 1) * seq_len + 1].tolist()


def _records(corpus, tmp_path_factory):
    """The corpus's documents written as a record file's uint16 tokens field, in shards (made once)."""
    out = tmp_path_factory.getbasetemp() / "token-records"
    if not out.exists():
        write([{"tokens": document.tolist()} for document in corpus[2]], out,
              {"tokens": Field("tokens", dtype="uint16")}, shard_size=20_000)
    return open_dataset(out, fields=["tokens"])


@pytest.mark.parametrize("world_size", [1, 3])
def test_token_rows_of_an_epoch_are_each_full_row_once_in_the_dict_batches_inputs(corpus, world_size):
    # every row of tokens_only is once an epoch over the ranks, and equals the dict batch's row of the same index
    path, folder, _, eod = corpus
    seen = []
    for rank in range(world_size):
        loader = make_loader(open_dataset(folder), 5, shuffle=True, seed=2, seq_len=61, eod=eod, tokens_only=True,
                             rank=rank, world_size=world_size)
        dict_rows = loader.dataset
        orders = list(loader.sampler.batches(0, 0))
        for batch, indices in zip(loader, orders, strict=True):
            alone = TokenSequences(open_dataset(path), 61, eod).read_batch(indices)
            assert torch.equal(batch["tokens"][:, :-1].long(), alone["input_ids"])
            assert torch.equal(batch["tokens"][:, 1:].long(), alone["labels"])
            seen += indices.tolist()
    # every row once; several ranks pad the last global batch with the epoch's first rows (NOTE [remainder])
    assert sorted(set(seen)) == list(range(len(dict_rows))) and len(seen) - len(dict_rows) < 5 * world_size
    assert len(seen) == len(dict_rows) if world_size == 1 else len(seen) % (5 * world_size) == 0


def test_token_rows_from_worker_processes_and_a_mix_equal_those_read_here(corpus):
    path, folder, _, eod = corpus
    here = list(make_loader(open_dataset(path), 6, shuffle=True, seed=5, seq_len=128, eod=eod, tokens_only=True))
    loader = make_loader(open_dataset(folder), 6, shuffle=True, seed=5, seq_len=128, eod=eod, tokens_only=True,
                         num_workers=2)
    try:
        there = list(loader)
    finally:
        loader.close()
    assert len(here) == len(there) and all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(here, there))
    web, books = (TokenSequences(open_dataset(source), 64, eod, tokens_only=True) for source in (path, folder))
    mixture = mix({"web": web, "books": books}, {"web": 3, "books": 1}, by="tokens", period=8)
    batch = next(iter(make_loader(mixture, 8)))
    sources, samples = mixture.locate(np.arange(8))
    assert list(batch) == ["tokens"] and batch["tokens"].dtype == torch.uint16
    for row, (source, sample) in enumerate(zip(sources.tolist(), samples.tolist())):
        assert torch.equal(batch["tokens"][row], (web, books)[source][sample]["tokens"])


def _padded_rows(documents, eod, seq_len):
    """packing="pad": each row's tokens (at most seq_len + 1) and its first position in its document."""
    rows = []
    for document in documents:
        tokens = np.append(document, eod)
        rows += [(tokens[start : start + seq_len + 1], start) for start in range(0, len(document), seq_len)]
    return rows


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.integers(1, 500), picks=st.lists(st.integers(0, 10**9), min_size=1, max_size=9))
def test_padded_rows_hold_one_document_each(corpus, seq_len, picks):
    _, folder, documents, eod = corpus
    rows = _padded_rows(documents, eod, seq_len)
    sequences = make_loader(open_dataset(folder), 4, seq_len=seq_len, eod=eod, packing="pad").dataset
    assert len(sequences) == len(rows)
    indices = np.array([pick % len(rows) for pick in picks])
    batch = sequences.read_batch(indices)
    for row, index in enumerate(indices.tolist()):
        tokens, start = rows[index]
        inputs = len(tokens) - 1
        assert batch["input_ids"][row, : len(tokens[:seq_len])].tolist() == tokens[:seq_len].tolist()
        assert (batch["input_ids"][row, len(tokens[:seq_len]) :] == sequences.pad_id).all()
        assert batch["labels"][row, :inputs].tolist() == tokens[1:].tolist()
        assert (batch["labels"][row, inputs:] == IGNORE_INDEX).all()
        assert batch["position_ids"][row, : len(tokens[:seq_len])].tolist() == list(range(start, start + len(
            tokens[:seq_len])))
    cuts = batch["cu_seqlens"].numpy()
    assert set(range(0, batch["input_ids"].numel(), seq_len)) <= set(cuts.tolist())  # every row starts a segment


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.integers(1, 500), picks=st.lists(st.integers(0, 10**9), min_size=1, max_size=9))
def test_best_fit_rows_hold_their_pieces_side_by_side(corpus, seq_len, picks):
    path, _, documents, eod = corpus
    sequences = make_loader(open_dataset(path), 4, seq_len=seq_len, eod=eod, packing="best_fit").dataset
    row_starts, owners, starts, stops = sequences._best_fit()
    indices = np.array([pick % len(sequences) for pick in picks])
    batch = sequences.read_batch(indices)
    for row, index in enumerate(indices.tolist()):
        pieces = range(row_starts[index], row_starts[index + 1])
        tokens = np.concatenate([np.append(documents[owners[p]], eod)[starts[p] : stops[p]] for p in pieces])
        positions = np.concatenate([np.arange(starts[p], stops[p]) for p in pieces])
        inputs = tokens[:seq_len]
        assert batch["input_ids"][row, : len(inputs)].tolist() == inputs.tolist()
        assert batch["labels"][row, : len(tokens) - 1].tolist() == tokens[1:].tolist()
        assert (batch["labels"][row, len(tokens) - 1 :] == IGNORE_INDEX).all()
        assert batch["position_ids"][row, : len(inputs)].tolist() == positions[:seq_len].tolist()
        cuts = batch["cu_seqlens"].numpy()
        segments = cuts[(cuts >= row * seq_len) & (cuts < (row + 1) * seq_len)]
        assert len(segments) == len(pieces) + (len(tokens) < seq_len)  # a piece each, and any padding of the inputs


def _check_positions(batch, documents, seq_len, indices, stream_length):
    """position_ids count each document's tokens from 0 (its eod last); cu_seqlens cut every row and document."""
    within = np.concatenate([np.arange(len(document) + 1) for document in documents])
    positions = batch["position_ids"].numpy()
    cuts = batch["cu_seqlens"].numpy()
    assert cuts.dtype == np.int32 and cuts[0] == 0 and cuts[-1] == positions.size and (np.diff(cuts) > 0).all()
    assert cuts.tolist() == cu_seqlens(batch["document_ids"].numpy()).tolist()  # every row and document change
    for row, index in enumerate(indices.tolist()):
        start = index * seq_len
        real = min(seq_len, stream_length - start)
        assert positions[row, :real].tolist() == within[start : start + real].tolist()
        owners = np.repeat(np.arange(len(documents)), [len(document) + 1 for document in documents])
        assert batch["document_ids"][row, :real].tolist() == owners[start : start + real].tolist()
        assert (batch["document_ids"][row, real:] == -1).all()
    flat = positions.reshape(-1)
    for a, b in zip(cuts[:-1], cuts[1:]):  # within a segment, positions count up by one; a segment starts a row
        assert (np.diff(flat[a:b]) == 1).all() and (flat[a] == 0 or a % seq_len == 0)


def test_full_concat_rows_are_read_a_slice_each_and_the_others_by_their_pieces(corpus):
    # NOTE [concat rows]: a row inside one file is one slice; the stream's last row and a row across two shards
    # are read by their pieces, with the same outputs either way
    path, folder, _, eod = corpus
    taken = {"rows": 0, "pieces": 0}
    for source in (path, folder):
        sequences = TokenSequences(open_dataset(source), 97, eod)
        for index in range(len(sequences)):
            rows = sequences._concat_rows(np.array([index]))
            if rows is None:
                taken["pieces"] += 1
                assert index == len(sequences) - 1 or source == folder
                continue
            taken["rows"] += 1
            (arrays, cuts), pieces = rows, sequences._from_pieces(np.array([index]))
            assert all(np.array_equal(arrays[name], pieces[name]) for name in pieces)
            assert cuts.tolist() == cu_seqlens(pieces["document_ids"])[:-1].tolist()
    shards = open_dataset(folder).num_shards
    assert shards >= 3 and taken["pieces"] == 2 + (shards - 1)  # each file's last row; a row across each boundary
    assert taken["rows"] == 2 * len(sequences) - taken["pieces"]
    # rows of many shards in one read, in any order (a group of make_loader's): still a slice a row
    whole = [index for index in range(len(sequences)) if sequences._concat_rows(np.array([index])) is not None]
    shuffled = np.random.default_rng(0).permutation(whole)
    rows = sequences._concat_rows(shuffled)
    assert rows is not None and np.array_equal(rows[0]["input_ids"], sequences._from_pieces(shuffled)["input_ids"])


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("packing", ["concat", "pad", "best_fit", "tokens_only"])
def test_batches_are_read_several_at_a_time_and_equal_those_read_one_by_one(corpus, monkeypatch, sharded, packing):
    # NOTE [grouped sequences]: groups of GROUP_BYTES (concat: a group holding the stream's last row by its pieces)
    path, folder, _, eod = corpus
    tokens_only = packing == "tokens_only"
    loader = make_loader(open_dataset(folder if sharded else path), 7, shuffle=True, seed=4, seq_len=97, eod=eod,
                         **({"tokens_only": True} if tokens_only else {"packing": packing}))
    sequences, reads, start = loader.dataset, [], loader.dataset.start_batches
    monkeypatch.setattr(sequences, "start_batches", lambda indices, sizes, *args: reads.append(list(sizes)) or start(
        indices, sizes, *args))
    group = GROUP_BYTES // (7 * 97 * (sequences.dtype.itemsize if tokens_only else DICT_TOKEN_BYTES))
    assert sequences.batches_per_read(7) == min(group, GROUP_BATCHES) > 1
    orders = list(loader.sampler.batches(0, 0))  # epoch 0's index batches
    batches = list(loader)
    assert len(batches) == len(orders) == sum(map(len, reads)) and all(len(sizes) <= group for sizes in reads)
    assert reads[-1][-1] == len(sequences) % 7 or reads[-1][-1] == 7
    for batch, indices in zip(batches, orders, strict=True):
        alone = sequences.read_batch(indices)
        assert set(batch) == set(alone) and all(torch.equal(batch[name], alone[name]) for name in alone)


@pytest.mark.parametrize("packing", ["concat", "pad"])
def test_a_corpus_bigger_than_memory_is_read_in_blocks_of_sequences(corpus, monkeypatch, packing):
    # NOTE [sequence blocks]: shuffle=True picks the block order when the text files do not fit, as for images
    path, folder, _, eod = corpus
    dataset = open_dataset(folder)
    every = [tuple(row) for batch in make_loader(dataset, 5, seq_len=97, eod=eod, packing=packing)
             for row in batch["input_ids"].tolist()]
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    loader = make_loader(dataset, 5, shuffle=True, seed=3, seq_len=97, eod=eod, packing=packing)
    sequences = loader.dataset
    assert loader.sampler.shuffle == "block" and sequences.nbytes == dataset.nbytes
    assert (loader.sampler.order.block_size, loader.sampler.order.window) == block_settings(sequences)
    assert block_settings(sequences)[0] == round(BLOCK_BYTES / (dataset.nbytes / len(sequences)))
    read = [tuple(row) for batch in loader for row in batch["input_ids"].tolist()]
    assert sorted(read) == sorted(every) and read != every  # each sequence once, in another order
    small = make_loader(dataset, 5, shuffle="block", block_size=4, window=3, seed=3, seq_len=97, eod=eod,
                        packing=packing)
    blocks = [tuple(row) for batch in small for row in batch["input_ids"].tolist()]
    assert sorted(blocks) == sorted(every) and blocks != every
    # concat rows come from windows read whole (NOTE [sequence windows]), pad rows through hinted maps (NOTE
    # [read ahead]): the hints' document ranges exactly cover the rows'
    assert isinstance(loader.steps.readahead, SequenceWindows if packing == "concat" else ReadAhead)
    if packing == "concat":
        assert loader.steps.readahead.misses == 0
    for first, stop in [(0, 1), (3, 9), (len(sequences) - 4, len(sequences)), (7, 7)]:
        documents = np.unique(sequences._pieces(np.arange(first, stop))[1])
        expected = [[documents[0], documents[-1] + 1]] if len(documents) else []
        assert sequences._document_ranges(np.array([[first, stop]])).tolist() == expected


@pytest.mark.parametrize(("tokens_only", "batch_size", "group", "direct"), [
    (False, 5, 1, True), (True, 5, 1, False), (False, 2, 4, False), (True, 2, 4, True), (True, 1, 9, True)])
def test_concat_rows_of_a_corpus_bigger_than_memory_come_from_windows_read_whole(corpus, monkeypatch, tokens_only,
                                                                                batch_size, group, direct):
    # NOTE [sequence windows]: one process reading alone cuts rows from its windows' ids read whole (direct I/O
    # where the files take it, else buffered): the same batches as through the maps, every one of them from the
    # windows (a row across two shards too), read a group of batches at a time where a window holds the group
    # (windows of 12 rows: groups of 9 rows at most)
    _, folder, documents, eod = corpus
    dataset = open_dataset(folder)
    if not direct:
        monkeypatch.setattr("fastdata.loading.sequencewindows.direct_alignment", lambda path: None)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    options = {"shuffle": "block", "block_size": 4, "window": 3, "seed": 3, "seq_len": 97, "eod": eod,
               "tokens_only": tokens_only}
    loader = make_loader(dataset, batch_size, **options)
    windows, key = loader.steps.readahead, "tokens" if tokens_only else "input_ids"
    assert isinstance(windows, SequenceWindows) and loader.dataset._windows is windows
    maps = TokenSequences(open_dataset(folder), 97, eod, tokens_only=tokens_only)  # no windows: the maps
    streams = {}  # every window's Stream held, kept alive here
    for epoch in range(2):
        orders = list(loader.sampler.batches(epoch, 0))
        for batch, indices in zip(loader, orders, strict=True):
            assert torch.equal(batch[key], maps.read_batch(indices)[key])
            with windows._lock:
                streams.update((id(stream), stream) for stream in windows._held.values())
    assert windows.misses == 0 and len(windows._held) <= 2 and windows._lag == group - 1
    assert len({id(stream.memory) for stream in streams.values()}) < len(streams)  # windows read into freed ones
    assert (windows._alignment is not None) == (direct and direct_alignment(dataset.shard_paths[0]) is not None)
    windows._reader.join()  # the next epoch's first window, read on the thread, is held once it is read
    stream = _stream(documents, eod)
    for held in windows._held.values():  # a window holds its documents' stream: ids and end-of-document ids
        for start, stop, place in zip(held.starts, held.stops, held.places):
            assert np.array_equal(held.ids[place : place + stop - start], stream[start:stop])

    def held(row):  # whether the windows held read the stream positions of the row
        low, high = row * 97, row * 97 + 98
        return any(((held.starts <= low) & (high <= held.stops)).any() for held in windows._held.values())

    outside = np.array([next(row for row in range(len(maps)) if not held(row))])
    with warnings.catch_warnings(record=True) as caught:  # a row of no window held: read through the maps, said
        warnings.simplefilter("always")
        assert torch.equal(loader.dataset.read_batch(outside)[key], maps.read_batch(outside)[key])
    assert windows.misses == 1 and [str(w.message)[:48] for w in caught if w.category is FastPathWarning] == [
        "a batch of sequences lies outside the block orde"]
    loader.close()
    assert windows._files is None and not windows._held
    resumed = make_loader(dataset, batch_size, **options)  # resumed mid-epoch, mid-group: the same batches
    resumed.load_state_dict({**loader.state_dict(), "epoch": 1, "samples_consumed": 7 * batch_size})
    rest = list(loader.sampler.batches(1, 7))
    for batch, indices in zip(resumed, rest, strict=True):
        assert torch.equal(batch[key], maps.read_batch(indices)[key])
    assert resumed.steps.readahead.misses == 0
    resumed.close()
    workers = make_loader(dataset, batch_size, num_workers=1, **options)  # each worker would read every window
    assert isinstance(workers.steps.readahead, ReadAhead)
    workers.close()
    if batch_size == 5:  # a helper process reads every batch, and the windows: NOTE [read-ahead in the helper]
        with make_loader(dataset, batch_size, helper_process=True, **options) as helped:
            assert isinstance(helped.steps.readahead, HelperReadAhead)
            for epoch in range(2):
                for batch, indices in zip(helped, list(helped.sampler.batches(epoch, 0)), strict=True):
                    assert torch.equal(batch[key], maps.read_batch(indices)[key])
            report = helped.helper.report()
        assert report["readahead"] == "SequenceWindows" and report["misses"] == 0, report


@pytest.mark.parametrize("tokens_only", [False, True])
def test_concat_rows_of_a_corpus_that_fits_come_from_its_whole_stream_held(corpus, tmp_path_factory, monkeypatch,
                                                                            tokens_only):
    # NOTE [whole stream]: one process reading alone a corpus that fits holds its stream and cuts every batch from
    # it: the same batches as through the maps, in any order, read before the first epoch and after close too
    path, folder, documents, eod = corpus
    key, stream = "tokens" if tokens_only else "input_ids", _stream(documents, eod)
    for source, shuffle in [(path, True), (folder, "uniform"), (folder, False)]:
        loader = make_loader(open_dataset(source), 3, shuffle=shuffle, seed=5, seq_len=61, eod=eod,
                             tokens_only=tokens_only)
        held, maps = loader.steps.readahead, TokenSequences(open_dataset(source), 61, eod, tokens_only=tokens_only)
        assert isinstance(held, WholeStream) and loader.dataset._windows is held
        early = np.array([len(maps) - 1, 0, 5])  # before the first epoch: the stream is read for it
        assert torch.equal(loader.dataset.read_batch(early)[key], maps.read_batch(early)[key])
        assert held._files is None  # read once: its files closed
        for epoch in range(2):
            for batch, indices in zip(loader, list(loader.sampler.batches(epoch, 0)), strict=True):
                assert torch.equal(batch[key], maps.read_batch(indices)[key])
        assert held.misses == 0 and np.array_equal(held._held[("all",)].ids, stream)
        loader.close()
        assert not held._held and held._files is None
    dataset = open_dataset(folder)
    with make_loader(dataset, 3, shuffle=True, seed=5, seq_len=61, eod=eod, tokens_only=tokens_only,
                     helper_process=True) as helped:  # the helper holds it: NOTE [read-ahead in the helper]
        maps = TokenSequences(open_dataset(folder), 61, eod, tokens_only=tokens_only)
        for batch, indices in zip(helped, list(helped.sampler.batches(0, 0)), strict=True):
            assert torch.equal(batch[key], maps.read_batch(indices)[key])
        assert helped.helper.report()["readahead"] == "WholeStream" and helped.helper.report()["misses"] == 0
    assert make_loader(dataset, 3, num_workers=1, seq_len=61, eod=eod).steps.readahead is None  # each would hold one
    assert make_loader(dataset, 3, rank=0, world_size=2, seq_len=61, eod=eod).steps.readahead is None
    assert make_loader(dataset, 3, seq_len=61, eod=eod, packing="pad").steps.readahead is None
    records = _records(corpus, tmp_path_factory)  # a record file's tokens field: held from its mapped columns
    loader = make_loader(records, 3, shuffle=True, seed=5, seq_len=61, eod=eod, tokens_only=tokens_only)
    held, maps = loader.steps.readahead, TokenSequences(_records(corpus, tmp_path_factory), 61, eod,
                                                        tokens_only=tokens_only)
    assert isinstance(held, WholeStream)
    for batch, indices in zip(loader, list(loader.sampler.batches(0, 0)), strict=True):
        assert torch.equal(batch[key], maps.read_batch(indices)[key])
    assert held.misses == 0 and np.array_equal(held._held[("all",)].ids, stream)
    loader.close()
    room = (len(stream) * 2 * 4 - 1, "test")  # a stream over a quarter of the memory available: the maps
    monkeypatch.setattr("fastdata.loading.sequences.available_memory", lambda: room)
    assert make_loader(dataset, 3, seq_len=61, eod=eod).steps.readahead is None


def test_windows_too_big_for_the_memory_available_are_not_read_and_say_so(corpus, monkeypatch):
    # NOTE [window room] in reading/windows.py: windows of 12 rows of 97 tokens in a memory of a few of them
    _, folder, _, eod = corpus
    dataset = open_dataset(folder)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (12 * 97, "test"))
    options = {"shuffle": "block", "block_size": 4, "window": 3, "seed": 3, "seq_len": 97, "eod": eod}
    with pytest.warns(FastPathWarning, match=r"not read whole: its windows .* would hold .*NOTE \[window room\]"):
        loader = make_loader(dataset, 5, **options)
    assert isinstance(loader.steps.readahead, ReadAhead) and loader.dataset._windows is None
    maps = TokenSequences(open_dataset(folder), 97, eod)
    for batch, indices in zip(loader, list(loader.sampler.batches(0, 0)), strict=True):
        assert torch.equal(batch["input_ids"], maps.read_batch(indices)["input_ids"])


@pytest.mark.parametrize(("out", "direct"), [("tokens.h5", True), ("tokens.arrow", False), ("h5-shards", False),
                                             ("arrow-shards", True)])
def test_a_record_tokens_field_bigger_than_memory_is_read_in_windows_whole(corpus, tmp_path, monkeypatch, out,
                                                                           direct):
    # NOTE [sequence windows] over a record file's tokens field: its ids read from where the field's values lie in
    # each file (HDF5 and Arrow, a file and shards, extra fields around it), the batches those of the maps
    _, _, documents, eod = corpus
    records = [{"id": number, "tokens": document.tolist(), "note": "é" * (number % 5)}
               for number, document in enumerate(documents)]
    schema = {"id": "int", "tokens": Field("tokens", dtype="uint16"), "note": "str"}
    shards = out.endswith("shards")
    write(records, tmp_path / out, schema, shard_size=9_000 if shards else None,
          format={"h5": "hdf5", "arrow": "arrow"}[out.split("-")[0]] if shards else None)
    dataset = open_dataset(tmp_path / out, fields=["tokens"])
    assert len(dataset.shard_paths) > 2 if shards else len(dataset.shard_paths) == 1
    if not direct:
        monkeypatch.setattr("fastdata.loading.sequencewindows.direct_alignment", lambda path: None)
    stored = sum(map(len, documents)) * 2
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (stored // 2, "test"))
    loader = make_loader(dataset, 3, shuffle=True, block_size=4, window=3, seed=3, seq_len=97, eod=eod)
    windows = loader.steps.readahead
    assert loader.sampler.shuffle == "block" and loader.dataset.nbytes == stored
    assert isinstance(windows, SequenceWindows) and not isinstance(windows, WholeStream)
    maps = TokenSequences(open_dataset(tmp_path / out, fields=["tokens"]), 97, eod)
    for epoch in range(2):
        for batch, indices in zip(loader, list(loader.sampler.batches(epoch, 0)), strict=True):
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(batch[key], maps.read_batch(indices)[key])
    assert windows.misses == 0
    windows._reader.join()
    stream = _stream(documents, eod)
    for held in windows._held.values():
        for start, stop, place in zip(held.starts, held.stops, held.places):
            assert np.array_equal(held.ids[place : place + stop - start], stream[start:stop])
    loader.close()
    ranked = make_loader(dataset, 3, shuffle=True, rank=1, world_size=2, seq_len=97, eod=eod)  # kernel hints
    assert ranked.sampler.shuffle == "block" and isinstance(ranked.steps.readahead, ReadAhead)
    for batch, indices in zip(ranked, list(ranked.sampler.batches(0, 0)), strict=True):
        assert torch.equal(batch["input_ids"], maps.read_batch(indices)["input_ids"])
    ranked.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is a Linux call")
def test_the_kernel_hints_of_a_record_tokens_field_cover_the_ids_of_those_rows(corpus, tmp_path):
    # NOTE [sequence blocks]: workers, ranks and pad rows over a record field bigger than memory are read through
    # hinted maps as a text file's: a hint names the mapped pages of the ids of the rows' documents, in every shard
    # they lie in, and no others
    _, _, documents, eod = corpus
    write([{"id": number, "tokens": document.tolist()} for number, document in enumerate(documents)],
          tmp_path / "records", {"id": "int", "tokens": Field("tokens", dtype="uint16")}, shard_size=9_000)
    dataset = open_dataset(tmp_path / "records", fields=["tokens"])
    sequences = TokenSequences(dataset, 97, eod)
    sequences.advise("random")
    starts = dataset.shard_starts
    for first_row, stop_row in [(0, 1), (len(sequences) // 2, len(sequences) // 2 + 40), (3, len(sequences))]:
        first, stop = sequences._document_ranges(np.array([[first_row, stop_row]]))[0].tolist()
        expected = set()
        for shard in range(len(starts) - 1):
            low, high = max(first, int(starts[shard])), min(stop, int(starts[shard + 1]))
            if low < high:
                column = dataset._open(shard)["tokens"]
                begin, end = (column.values.ctypes.data + int(column.offsets[document - starts[shard]]) * 2
                              for document in (low, high))
                expected.add((begin // PAGE * PAGE, -(-end // PAGE) * PAGE - begin // PAGE * PAGE))
        asked = []
        sequences.done_with(np.array([[first_row, stop_row]]))  # "done" asks whatever is cached
        assert dataset.token_field("tokens").hint(np.array([[first, stop]]), "done",
                                   lambda call, spans, advice, asked=asked: asked.append(spans))
        merged = []  # shards mapped side by side: their spans join
        for address, length in sorted(expected):
            if merged and merged[-1][0] + merged[-1][1] >= address:
                merged[-1][1] = max(merged[-1][1], address + length - merged[-1][0])
            else:
                merged.append([address, length])
        assert asked[0].tolist() == merged and merged
    assert sequences.will_need(np.array([[5, 5]])) is False


def test_best_fit_rows_of_a_corpus_bigger_than_memory_are_read_at_random_and_say_so(corpus, monkeypatch):
    path, _, _, eod = corpus
    dataset = open_dataset(path)
    monkeypatch.setattr("fastdata.reading.shuffles.available_memory", lambda: (memory_short_of(dataset.nbytes), "test"))
    with pytest.warns(UserWarning, match="best_fit.*at random.*'concat' or 'pad' reads rows in blocks"):
        loader = make_loader(dataset, 5, shuffle=True, seq_len=97, eod=eod, packing="best_fit")
    assert loader.sampler.shuffle == "uniform"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_an_epoch_reads_every_sequence_once_over_the_ranks(corpus, world_size):
    path, folder, documents, eod = corpus
    seen = []
    for rank in range(world_size):
        loader = make_loader(open_dataset(folder), 5, shuffle=True, seed=2, seq_len=97, eod=eod, rank=rank,
                             world_size=world_size)  # the short last global batch padded from the epoch's start
        seen += [tuple(row) for batch in loader for row in batch["input_ids"].tolist()]
    single = make_loader(open_dataset(path), 64, seq_len=97, eod=eod)
    expected = [row for batch in single for row in batch["input_ids"].tolist()]
    assert set(seen) == {tuple(row) for row in expected} and len(set(seen)) == len(single.dataset)
    assert len(seen) - len(expected) < 5 * world_size
    stream = _stream(documents, eod)
    assert np.concatenate(expected)[: len(stream)].tolist() == stream.tolist()  # padding after the stream only


def test_worker_processes_and_a_shard_folder_give_the_same_batches(corpus):
    path, folder, _, eod = corpus
    here = list(make_loader(open_dataset(path), 6, shuffle=True, seed=5, seq_len=128, eod=eod))
    loader = make_loader(open_dataset(folder), 6, shuffle=True, seed=5, seq_len=128, eod=eod, num_workers=2)
    try:
        there = list(loader)
    finally:
        loader.close()
    assert len(here) == len(there)
    for mine, theirs in zip(here, there):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_a_run_resumed_on_another_number_of_ranks_continues_the_same_global_batches(corpus):
    # global batch 12: 2 ranks of 6, resumed on 3 ranks of 4 and on 4 ranks of 3
    path, _, _, eod = corpus

    def loader(rank, world_size, state=None):
        made = make_loader(open_dataset(path), 12 // world_size, shuffle=True, seed=7, seq_len=64, eod=eod,
                           rank=rank, world_size=world_size)
        if state is not None:
            made.load_state_dict(state)
        return made

    def global_batches(world_size, state=None, steps=None):
        per_rank = [list(loader(rank, world_size, state)) for rank in range(world_size)]
        return [sorted(row for rank in per_rank for row in rank[step]["input_ids"].tolist())
                for step in range(len(per_rank[0]) if steps is None else steps)]

    uninterrupted = global_batches(2)
    first = loader(0, 2)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    for world_size in (3, 4):
        assert global_batches(world_size, state) == uninterrupted[3:]


def test_the_end_of_document_token_and_options_are_checked(corpus, packed_files):
    path, _, _, eod = corpus
    assert make_loader(open_dataset(path), 2, seq_len=8, eod=EOD).dataset.eod == eod
    for options, message in [
        ({"seq_len": 8, "eod": "<never>"}, "eod='<never>' is not a token of the tokenizer of"),
        ({"seq_len": 8, "eod": 10**6}, r"eod should be an id of the vocabulary of .*docs.h5' \(0\.\."),
        ({"seq_len": 0, "eod": eod}, "seq_len should be a positive number of tokens"),
        ({"seq_len": 8, "eod": eod, "packing": "first_fit"}, r"packing should be one of \('concat', 'pad', 'best"),
        ({"eod": eod}, "eod, packing and tokens_only apply with seq_len"),
        ({"tokens_only": True}, "eod, packing and tokens_only apply with seq_len"),
        ({"seq_len": 8, "eod": eod, "packing": "pad", "tokens_only": True}, "use packing='concat'"),
        ({"seq_len": 8, "eod": eod, "device": "cpu", "normalize": (0.5, 0.5)}, "normalize apply to image batches"),
    ]:
        with pytest.raises(OptionError, match=message):
            make_loader(open_dataset(path), 2, **options)
    with pytest.raises(OptionError, match="seq_len cuts a text dataset's documents into sequences; got a 'image'"):
        make_loader(open_dataset(packed_files("hdf5", "raw")), 2, seq_len=8, eod=0)


def test_sequences_of_two_corpora_mix_by_tokens_into_one_batch(corpus):
    path, folder, _, eod = corpus
    web, books = TokenSequences(open_dataset(path), 64, eod), TokenSequences(open_dataset(folder), 64, eod, "pad")
    mixture = mix({"web": web, "books": books}, {"web": 3, "books": 1}, by="tokens", period=8)
    batch = next(iter(make_loader(mixture, 8)))
    sources, samples = mixture.locate(np.arange(8))
    assert sorted(sources.tolist()) == [0] * 6 + [1] * 2
    for row, (source, sample) in enumerate(zip(sources.tolist(), samples.tolist())):
        alone = (web, books)[source].read_batch([sample])
        for key in ("input_ids", "labels", "position_ids", "document_ids"):
            assert torch.equal(batch[key][row], alone[key][0])
    rows = [(web, books)[source].read_batch([sample]) for source, sample in zip(sources.tolist(), samples.tolist())]
    starts = [0]
    for row, alone in enumerate(rows):  # each row's own segments, shifted to where the row lies in the batch
        starts += (alone["cu_seqlens"][1:-1] + row * 64).tolist() + [(row + 1) * 64]
    assert batch["cu_seqlens"].tolist() == starts


def test_a_mix_of_sequences_is_read_several_batches_at_a_time_with_the_same_batches_each_epoch(corpus, monkeypatch):
    path, folder, _, eod = corpus
    web, books = TokenSequences(open_dataset(path), 64, eod), TokenSequences(open_dataset(folder), 64, eod, "pad")
    mixture = mix({"web": web, "books": books}, {"web": 3, "books": 1}, by="tokens", period=8)
    reads, start = [], mixture.start_batches
    monkeypatch.setattr(mixture, "start_batches", lambda indices, sizes, *args, **options: reads.append(
        (list(sizes), options["epoch"])) or start(indices, sizes, *args, **options))
    loader = make_loader(mixture, 7)
    assert mixture.batches_per_read(7) == min(web.batches_per_read(7), books.batches_per_read(7)) > 1
    for epoch in range(2):  # a mixture draws anew each epoch: the group's read is told which
        orders = list(loader.sampler.batches(epoch, 0))
        batches = list(loader)
        assert sum(len(sizes) for sizes, seen in reads if seen == epoch) == len(batches) == len(orders)
        for batch, indices in zip(batches, orders, strict=True):
            alone = mixture.read_batch(indices, epoch=epoch)
            assert set(batch) == set(alone) and all(torch.equal(batch[key], alone[key]) for key in alone)


def test_an_end_of_document_token_recorded_at_conversion_is_the_default(corpus, tmp_path):
    path, _, documents, eod = corpus
    src, tokenizer = path.parent / "docs.jsonl", path.parent / "tok.json"
    result = run_cli("convert", "text", src, tmp_path / "eod.h5", "--tokenizer", tokenizer, "--no-labels", "--eod",
                     EOD, "--quiet")
    assert result.exit_code == 0, result.output
    recorded = make_loader(open_dataset(tmp_path / "eod.h5"), 4, seq_len=50)
    given = make_loader(open_dataset(path), 4, seq_len=50, eod=eod)
    assert recorded.dataset.eod == eod
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(recorded, given, strict=True))
    with pytest.raises(OptionError, match="eod='<nope>' is not a token of the tokenizer"):
        convert_text(src, tmp_path / "bad.h5", tokenizer=tokenizer, label_field=None, eod="<nope>", progress=False)
    with pytest.raises(OptionError, match="this one's vocabulary is built from the corpus"):
        convert_text(src, tmp_path / "bad.h5", label_field=None, eod=0, progress=False)
    assert not (tmp_path / "bad.h5").exists()
    with pytest.raises(OptionError, match="records none: pass eod="):
        make_loader(open_dataset(path), 4, seq_len=50)


def test_a_record_files_tokens_field_gives_the_same_sequences(corpus, tmp_path):
    path, _, documents, eod = corpus
    write([{"id": number, "tokens": document.tolist(), "note": "x" * (number % 5)}
           for number, document in enumerate(documents)], tmp_path / "docs", {"id": "int", "tokens": Field(
               "tokens", dtype="uint16"), "note": "str"}, shard_size=20_000)
    records = open_dataset(tmp_path / "docs", fields=["tokens"])
    for packing in ("concat", "best_fit"):
        mine = make_loader(records, 4, seq_len=77, eod=eod, packing=packing, shuffle=True, seed=1)
        theirs = make_loader(open_dataset(path), 4, seq_len=77, eod=eod, packing=packing, shuffle=True, seed=1)
        for a, b in zip(mine, theirs, strict=True):
            for key in ("input_ids", "labels", "position_ids", "document_ids"):
                assert torch.equal(a[key], b[key]) if key != "input_ids" else torch.equal(
                    a[key][b["document_ids"] >= 0], b[key][b["document_ids"] >= 0])  # padding: 0 against [PAD]
    with pytest.raises(OptionError, match="reads 0 \\(none\\): pick one with fields"):
        make_loader(open_dataset(tmp_path / "docs", fields=["id"]), 4, seq_len=8, eod=eod)
    with pytest.raises(OptionError, match=re.escape("eod='<|endoftext|>' is not a token of the tokenizer")):
        make_loader(records, 4, seq_len=8, eod=EOD)  # a record file keeps no tokenizer: ids only
