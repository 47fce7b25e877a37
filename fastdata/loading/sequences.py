"""Language-model sequences cut at load time from a text dataset's documents: ``make_loader(seq_len=...)``.

NOTE [concat packing]: the documents, each followed by the end-of-document
id, are one stream of tokens; sequence ``k`` is its tokens
``[k * T, k * T + T + 1)`` (T = ``seq_len``): ``input_ids`` the first T,
``labels`` the last T (the next token of each; the tokens past the stream's
end are padding, labelled IGNORE_INDEX). Every token of the stream is an
input once and a label once an epoch (the first token is never a label).
``packing="pad"`` cuts each document (with its end-of-document id) alone
the same way, its last row padded: one document per row, none split but
those longer than T; ``packing="best_fit"`` packs whole documents into
rows (NOTE [best-fit rows] in reading/packing.py). Nothing is stored: the cut is arithmetic on the
documents' lengths, so a new ``seq_len``, packing or end-of-document id
needs no conversion, and a sequence is an index like any sample:
make_loader's orders, shuffles, ranks (any world size), worker processes
and exact resume apply to sequences as they do to images.

NOTE [token rows]: ``tokens_only=True`` yields each concat row as it is
stored: ``{"tokens": [B, T + 1]}`` in the file's id dtype (uint16 for a
vocabulary of up to 65,536), the form LitData's TokensLoader and litgpt
train from (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``), a
quarter of the int64 bytes to the device. Nothing else is built, so a
batch costs the rows' copy: one gather where the stream is held in memory
(NOTE [whole stream], NOTE [sequence windows] in sequencewindows.py), else
a slice per row and the end-of-document ids put in between.
Only full rows: the stream's last ``(tokens - 1) % T`` tokens, less than a
row, are not read (they would need padding a loss must know to skip).
"""

import dataclasses
import hashlib
import json
import warnings

import numpy as np
import torch

from fastdata.codecs.tokenizers import Tokenizer, eod_id
from fastdata.errors import FastPathWarning, OptionError
from fastdata.loading.batchreads import checked_indices
from fastdata.loading.datasets import PackedDataset
from fastdata.loading.localranks import share_windows
from fastdata.loading.records import RecordDataset
from fastdata.loading.sequencewindows import HOLD_SHARE, SequenceWindows, WholeStream
from fastdata.loading.sharedsequences import SharedSequenceWindows
from fastdata.reading.packing import best_fit_rows, counted
from fastdata.reading.shuffles import available_memory
from fastdata.reading.windows import window_room

IGNORE_INDEX = -100  # a label no loss counts: torch's cross_entropy ignore_index
GROUP_BYTES = 4 << 20  # bytes of batches read as one; see NOTE [grouped sequences]
GROUP_BATCHES = 32  # batches read as one at most
DICT_TOKEN_BYTES = 32  # a dict batch's bytes a token: input_ids, labels, position_ids, document_ids (int64)
PACKINGS = ("concat", "pad", "best_fit")


class TokenSequences:
    """The fixed-length sequences of a text dataset's documents joined end to end (NOTE [concat packing]).

    A batch is a dict of int64 ``[B, T]`` ``input_ids``, ``labels``,
    ``position_ids`` (restarting at 0 at each document's first token; the
    end-of-document id continues its document) and ``document_ids`` (the
    dataset's index of each token's document; -1 for padding), and int32
    ``cu_seqlens``: the offsets of the batch's documents in its ``B * T``
    flattened input tokens (every row starts one), as varlen attention
    takes them.

    Args:
        dataset: a text PackedDataset (``fastdata convert text``; ``--no-labels`` for a corpus), or a
            RecordDataset reading one ``tokens`` field (``fields=[name]``; padding id 0).
        seq_len: tokens per sequence (T).
        eod: the end-of-document id, or a token of the file's tokenizer (``"<|endoftext|>"``); default:
            the one ``convert text --eod`` recorded.
        packing: "concat" (the documents end to end), "pad" (one document per row) or "best_fit" (whole
            documents packed into rows).
        tokens_only: concat only: batches of ``{"tokens": [B, T + 1]}`` in the stored dtype, full rows only
            (NOTE [token rows]).
    """

    kind = "sequences"
    read_options = ()

    def __init__(self, dataset, seq_len, eod=None, packing="concat", tokens_only=False):
        self.field = _tokens_field(dataset)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise OptionError(f"seq_len should be a positive number of tokens, got seq_len={seq_len!r}")
        if tokens_only and packing != "concat":
            raise OptionError(f"tokens_only=True yields concat rows as stored; packing={packing!r} rows hold "
                              "padding that only the dict batches' labels mark: use packing='concat'")
        self.dataset, self.seq_len, self.packing, self.tokens_only = dataset, seq_len, packing, bool(tokens_only)
        # the documents' ids: a text dataset's own, or a record file's tokens field seen as one (a TokenField)
        self.documents = dataset if self.field is None else dataset.token_field(self.field)
        if self.field is None:  # a text file: its tokenizer, and the eod convert text --eod recorded
            recorded = dataset.metadata.get("preprocessing", {}).get("eod")
            tokenizer = dataset.metadata["tokenizer"]
            vocab_size, self.pad_id = int(tokenizer["vocab_size"]), int(tokenizer["pad_id"])
            self.dtype = np.dtype(dataset.metadata["sample_dtype"])

            def token_id(token):  # the stored tokenizer, made only for a token
                return Tokenizer.from_dict(tokenizer).token_id(token)
        else:  # a record file's tokens field: ids of its dtype, no tokenizer
            recorded, token_id, self.pad_id = None, lambda token: None, 0
            self.dtype = np.dtype(dataset.schema[self.field].stored_dtype)
            vocab_size = int(np.iinfo(self.dtype).max) + 1
        if eod is None and recorded is None:
            raise OptionError(f"seq_len ends each document with its end-of-document id, and {dataset.path!r} "
                              "records none: pass eod=, the id (an int) or a token of the file's tokenizer, e.g. "
                              "eod='<|endoftext|>' (or convert with --eod)")
        self.eod = eod_id(recorded if eod is None else eod, vocab_size, dataset.path, token_id)
        self.path = dataset.path
        described = {"dataset": dataset.fingerprint, "seq_len": seq_len, "eod": self.eod, "packing": packing,
                     **({"tokens_only": True} if tokens_only else {})}
        self.fingerprint = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
        self._starts = None  # the documents' first stream positions, int64 [D + 1]: made in each process
        self._windows = None  # the SequenceWindows rows are cut from (NOTE [sequence windows]), or None
        self._rows = None  # packing="pad": each document's first row, int64 [D + 1]; "best_fit": its plan

    def __repr__(self):
        return (f"<TokenSequences of {self.dataset.path!r}: {len(self)} sequences of {self.seq_len} tokens, "
                f"eod={self.eod}, packing={self.packing!r}{', tokens_only' if self.tokens_only else ''}>")

    def __getstate__(self):
        return {**self.__dict__, "_starts": None, "_rows": None, "_windows": None}

    def read_windows(self, order):
        """Cut concat rows from ``order``'s windows read whole from now on; return the SequenceWindows, or None
        where they do not apply (another packing, a URL, an order that is not "block"; windows too big for the
        memory available, warned: NOTE [window room] in reading/windows.py).

        See NOTE [sequence windows] in sequencewindows.py; for one process reading alone.
        """
        if self.packing != "concat" or self.is_remote or order.shuffle != "block":
            return None
        why = window_room(SequenceWindows.held_bytes(self, order), order)
        if why is not None:
            warnings.warn(f"the block order's windows of {self.dataset.path!r} are not read whole: {why}. Its rows "
                          "are read through the memory map with kernel hints (0.07 of the disk's rate measured, "
                          "against 0.75; NOTE [sequence windows])", FastPathWarning, stacklevel=3)
            return None
        self._windows = SequenceWindows(self, order)
        return self._windows

    def share_windows(self, order, wanted):
        """Cut concat rows from ``order``'s windows read once by the ranks of this machine together from now on;
        return the SharedSequenceWindows, or None. A collective of the process group, as PackedDataset's (NOTE
        [shared sequence windows] in sharedsequences.py): every rank calls it for the same order; ``wanted``: this
        rank would read windows (one reader, a corpus bigger than the page cache). None where the ranks of this
        machine cannot all share them, with a FastPathWarning saying why where this rank wanted to.
        """
        wanted = wanted and self.packing == "concat" and not self.is_remote  # the others read no windows
        windows, why = share_windows(self, order, wanted, SharedSequenceWindows)
        if windows is not None:
            self._windows = windows
        elif why:
            warnings.warn(f"the ranks of this machine do not share the block order's windows of {self.path!r}: "
                          f"{why}. Its rows are read through the memory map with kernel hints (NOTE [shared "
                          "sequence windows])", FastPathWarning, stacklevel=3)
        return windows

    def hold_stream(self, order):
        """Cut concat rows from the stream of every document held in memory from now on; return the WholeStream,
        or None where it does not apply (another packing, a URL, a stream over HOLD_SHARE of the memory available).

        See NOTE [whole stream] in sequencewindows.py; for one process reading alone a corpus that fits.
        """
        if (self.packing != "concat" or self.is_remote
                or int(self._stream()[0][-1]) * self.dtype.itemsize > HOLD_SHARE * available_memory()[0]):
            return None
        self._windows = WholeStream(self, order)
        return self._windows

    def _stream(self):
        if self._starts is None:
            lengths = self.documents.lengths
            self._lengths = np.asarray(lengths, np.int64)
            self._starts = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(self._lengths + 1, out=self._starts[1:])
        return self._starts, self._lengths

    def _document_rows(self):
        """packing="pad": each document's first row, int64 [D + 1]: a row per T of its tokens (none if empty)."""
        if self._rows is None:
            _, lengths = self._stream()
            self._rows = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(-(-lengths // self.seq_len), out=self._rows[1:])
        return self._rows

    def _best_fit(self):
        """packing="best_fit": the plan's CSR arrays (reading/packing.best_fit_rows)."""
        if self._rows is None:
            self._rows = best_fit_rows(self._stream()[1], self.seq_len)
        return self._rows

    @property
    def is_remote(self):
        """Whether the documents come from a URL and the rows' shards are fetched ahead (NOTE [remote sequences]).

        NOTE [remote sequences]: concat and pad rows lie in their index order
        in the shards, so a loader reads them as it reads the samples of a
        folder at a URL: in the block order that fits the shard cache, with
        a ShardReadAhead fetching the shards of the windows it reads next
        (NOTE [remote read-ahead] in reading/remote.py), told by
        ``shard_index`` which shard holds each row's first token. A row that
        runs into the next shard finds it fetched where the order reads that
        shard too, else fetches it as any missing shard is fetched (once a
        window at most). best_fit rows take documents from every shard, so
        they are read as they come, their shards fetched on demand (make_loader
        warns).
        """
        return self.packing != "best_fit" and getattr(self.dataset, "is_remote", False)

    @property
    def prefetch(self):
        """The shards fetched ahead of a URL's reads (the dataset's ``prefetch``)."""
        return self.dataset.prefetch

    @property
    def shard_source(self):
        """Where the documents' shard files come from (the dataset's)."""
        return self.dataset.shard_source

    @property
    def shard_index(self):
        """The dataset's ShardIndex with rows for samples: shard ``k`` holds rows ``starts[k]:starts[k + 1]``,
        those whose first token it stores (NOTE [remote sequences])."""
        index = self.dataset.shard_index
        if self.packing == "concat":
            rows = -(-self._stream()[0][index.starts] // self.seq_len)  # the first row starting in each shard
        elif self.packing == "pad":
            rows = self._document_rows()[index.starts]
        else:
            raise OptionError("best_fit rows draw documents from every shard: they have no shard of their own")
        return dataclasses.replace(index, starts=np.minimum(rows, len(self)))

    @property
    def nbytes(self):
        """Bytes of the text file(s) behind the sequences (what decides a block order, NOTE [sequence blocks]); of a
        record file's tokens field, its stored ids (None at a URL: its shards are fetched as its index says).

        NOTE [sequence blocks]: concat and pad rows lie on disk in their
        index order, so make_loader's shuffle=True treats sequences as it
        treats images (NOTE [auto shuffle] in shuffles.py): a corpus whose
        files do not fit in memory is read in the block order, blocks of
        about BLOCK_BYTES of stored tokens. One process reading concat rows
        alone reads each window's documents whole (NOTE [sequence windows] in
        sequencewindows.py); workers, ranks and pad rows get the kernel
        hints of a ReadAhead (NOTE [read ahead] in readahead.py) over the
        documents of the rows (``will_need`` / ``done_with`` of row ranges).
        Without either the maps kept the kernel's read-around, 8 MiB on this
        machine's disk for each 4 KiB row: the lmscale benchmark's 1.07 GB
        folder in a 0.67 GB cgroup read 0.5M tokens/s, 1,107x its ids from
        disk; with the hints 31.7M at 1.94x (35.2M at 1.58x in a 1 GB
        cgroup), against 620-700M tokens/s for a sequential read of the
        files, each row still faulting its pages in (/tmp/lmt/cold.py,
        wrun.py). best_fit rows take documents from the whole corpus, so
        they stay in the uniform order, unhinted, and make_loader warns. A
        record file's tokens field is sized by its stored ids and read the
        same ways (its windows from where the field's values lie in each
        file, its hints on the pages of its mapped values): the lmscale
        documents written by fastdata.write, in a 1.07 GB cgroup, 236.0M
        tokens/s at 1.11x alone against 4.3M at 99.9x when it was taken to
        fit (/tmp/lmt/coldrec.py); rank 0 of 2 15.1-20.6M at 2.6-2.9x
        against 10.2M at 32.7x unhinted (/tmp/lmt/rank.py).
        """
        return getattr(self.documents, "nbytes", None)

    def advise(self, pattern):
        """Tell the kernel how the documents' ids will be read ("random" or "normal"): see NOTE [sequence blocks]."""
        self.documents.advise(pattern)

    def will_need(self, ranges, give=None):
        """Ask the kernel to read the ids of the rows ``[start, stop)`` of ``ranges`` now; see PackedDataset's."""
        return self.documents.will_need(self._document_ranges(ranges), give)

    def done_with(self, ranges, drop=False):
        """Tell the kernel the ids of the rows of ``ranges`` are not read again soon; see PackedDataset's."""
        self.documents.done_with(self._document_ranges(ranges), drop)

    def _document_ranges(self, ranges):
        """Return int64 ``[K, 2]`` document ranges ``[first, last + 1)`` holding the tokens of row ``ranges``."""
        ranges = np.asarray(ranges, np.int64).reshape(-1, 2)
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        if self.packing == "concat":
            starts = self._stream()[0]
            first = np.searchsorted(starts, ranges[:, 0] * self.seq_len, side="right") - 1
            last = np.searchsorted(starts, np.minimum(ranges[:, 1] * self.seq_len, starts[-1] - 1), side="right") - 1
        elif self.packing == "pad":
            rows = self._document_rows()
            first = np.searchsorted(rows, ranges[:, 0], side="right") - 1
            last = np.searchsorted(rows, ranges[:, 1] - 1, side="right") - 1
        else:  # make_loader gives best_fit rows no ReadAhead (NOTE [sequence blocks])
            raise OptionError("best_fit rows draw documents from the whole corpus: no range of rows is one of them")
        return np.stack([first, last + 1], axis=1)

    def __len__(self):
        if self.packing == "pad":
            return int(self._document_rows()[-1])
        if self.packing == "best_fit":
            return len(self._best_fit()[0]) - 1
        tokens = int(self._stream()[0][-1])
        if tokens < 2:
            return 0
        return (tokens - 1) // self.seq_len if self.tokens_only else -(-(tokens - 1) // self.seq_len)

    def _pieces(self, indices):
        """Return ``(rows, documents, starts, stops)``, int64 ``[P]`` each: the pieces of the batch's rows, in order.

        Piece ``p`` is positions ``starts[p]:stops[p]`` of document ``documents[p]`` (its tokens, then its
        end-of-document id at position ``lengths[d]``); a row's pieces lie side by side from its first column.
        """
        starts, lengths = self._stream()
        if self.packing == "concat":  # a row spans documents d0..d1 of the stream
            first = indices * self.seq_len
            last = np.minimum(first + self.seq_len + 1, starts[-1])
            d0 = np.searchsorted(starts, first, side="right") - 1
            counts = np.searchsorted(starts, last - 1, side="right") - d0
            documents = np.repeat(d0, counts) + counted(counts)
            begins = np.maximum(np.repeat(first, counts) - starts[documents], 0)
            ends = np.minimum(np.repeat(last, counts) - starts[documents], lengths[documents] + 1)
            return np.repeat(np.arange(len(indices)), counts), documents, begins, ends
        if self.packing == "pad":  # a row is one document's
            first_rows = self._document_rows()
            documents = np.searchsorted(first_rows, indices, side="right") - 1
            begins = (indices - first_rows[documents]) * self.seq_len
            return (np.arange(len(indices)), documents, begins,
                    np.minimum(begins + self.seq_len + 1, lengths[documents] + 1))
        row_starts, owners, piece_starts, piece_stops = self._best_fit()
        counts = row_starts[indices + 1] - row_starts[indices]
        pieces = np.repeat(row_starts[indices], counts) + counted(counts)
        return np.repeat(np.arange(len(indices)), counts), owners[pieces], piece_starts[pieces], piece_stops[pieces]

    def __getitem__(self, index):
        """Return sequence ``index`` as a dict of 1-D tensors (``cu_seqlens`` of its own tokens)."""
        batch = self.read_batch(np.array([index], np.int64))
        if self.tokens_only:
            return {"tokens": batch["tokens"][0]}
        return {**{name: batch[name][0] for name in ("input_ids", "labels", "position_ids", "document_ids")},
                "cu_seqlens": batch["cu_seqlens"]}

    def read_batch(self, indices, pin_memory=False):
        """Return the dict batch of sequences ``indices`` (see the class)."""
        return self._batches(checked_indices(np.asarray(indices, np.int64), len(self), self.path), [len(indices)],
                             pin_memory)[0]

    def start_batches(self, indices, sizes, pin_memory=False):
        """Read consecutive batches of ``sizes`` sequences of ``indices`` as one; return a function returning them.

        NOTE [grouped sequences]: a batch of 8 x 2048 concat rows costs about
        25 numpy calls whatever its size (pieces: about 40), so make_loader reads
        ``batches_per_read`` batches at once (NOTE [grouped reads] in
        batchloader.py) and yields row slices of one set of arrays. Measured
        through make_loader(ds, 8, seq_len=2048, shuffle=True) over the lm
        benchmark's file (warm, 2 cores, 600 batches, 3 interleaved rounds,
        /tmp/lmgroup.py), by batches read as one: 1 54-70M tokens/s, 4
        76-93M, 8 83-98M, 16 75-81M; so a group holds up to GROUP_BYTES of
        batches, 8 of these (DICT_TOKEN_BYTES a token). The rows read by
        their pieces gain less (/tmp/lmgroup2.py, 2 rounds): pad 55-59M
        alone, 63-73M by 8; best_fit 29-38M either way. tokens_only rows
        (2 bytes a token) gain from more: us a batch through the grouped
        reads by batches read as one (/tmp/lmt/gsize2.py, 5 rounds in one
        process): 16 5.80, 32 5.18, 64 5.01, where concat rows took 4 44.6,
        8 41.1, 16 72.9; so GROUP_BATCHES is 32. A mix of sequences reads
        its groups likewise (Mixture.start_batches, told the epoch): the lm
        benchmark's 1:1 mix 12-13M alone, 26-27M by 8 (/tmp/lmmix.py, 3
        rounds).
        """
        batches = self._batches(checked_indices(np.asarray(indices, np.int64), len(self), self.path), sizes,
                                pin_memory)
        return lambda: batches

    def batches_per_read(self, batch_size):
        """How many batches of ``batch_size`` make_loader reads as one (NOTE [grouped sequences])."""
        token_bytes = self.dtype.itemsize if self.tokens_only else DICT_TOKEN_BYTES
        return max(1, min(GROUP_BATCHES, GROUP_BYTES // max(batch_size * self.seq_len * token_bytes, 1)))

    def _batches(self, indices, sizes, pin_memory):
        """Return the dict batches of ``sizes`` consecutive rows of ``indices`` (checked), read as one."""
        if self.tokens_only:  # see NOTE [token rows]
            batches = [{"tokens": tokens} for tokens in torch.from_numpy(self._token_rows(indices)).split(sizes)]
            return [{"tokens": batch["tokens"].pin_memory()} for batch in batches] if pin_memory else batches
        rows = self._concat_rows(indices)
        rows, cuts = rows if rows is not None else (self._from_pieces(indices), None)
        arrays = {name: np.ascontiguousarray(value) for name, value in rows.items()}
        batches, first = [], 0
        for size in sizes:
            batch = {name: torch.from_numpy(value[first : first + size]) for name, value in arrays.items()}
            if cuts is None:
                cu = cu_seqlens(arrays["document_ids"][first : first + size])
            else:  # the segments that begin among this batch's inputs
                low, high = np.searchsorted(cuts, [first * self.seq_len, (first + size) * self.seq_len])
                cu = np.append(cuts[low:high] - first * self.seq_len, size * self.seq_len).astype(np.int32)
            batch["cu_seqlens"] = torch.from_numpy(cu)
            batches.append({name: value.pin_memory() for name, value in batch.items()} if pin_memory else batch)
            first += size
        return batches

    def _concat_rows(self, indices):
        """Return the concat rows ``indices`` read a slice per row, or None (see NOTE [concat rows]).

        Returns ``(arrays, cuts)``: the ``[N, T]`` numpy outputs, and where each document's segment begins in
        the flattened inputs (int64, ascending).
        """
        rows = self._joined_rows(indices, np.int64)
        if rows is None:
            return None
        tokens, (documents, row_first, begin, end, flat_begin) = rows
        starts, width = self._stream()[0], self.seq_len + 1
        inputs = np.minimum(end, row_first + self.seq_len) - begin  # each segment's tokens among the inputs
        input_begin = flat_begin - flat_begin // width  # where each segment begins in the [B, T] inputs
        position_ids = np.arange(len(indices) * self.seq_len) - np.repeat(
            input_begin - (begin - starts[documents]), inputs)
        shape = (len(indices), self.seq_len)
        return ({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": position_ids.reshape(shape),
                 "document_ids": np.repeat(documents, inputs).reshape(shape)}, input_begin[inputs > 0])

    def _token_rows(self, indices):
        """Return the full concat rows ``indices`` as stored ids, ``[N, T + 1]`` of ``dtype`` (NOTE [token rows])."""
        if self._windows is not None and len(indices):  # NOTE [sequence windows]: one gather of the rows
            rows = self._windows.rows(indices * self.seq_len, self.seq_len + 1)
            if rows is not None:
                return rows
        rows = self._joined_rows(indices, self.dtype, from_windows=False)
        if rows is not None:
            return rows[0]
        pieces = self._from_pieces(indices)  # a row across two files, or a record file's field: by its pieces
        return np.concatenate([pieces["input_ids"], pieces["labels"][:, -1:]], axis=1).astype(self.dtype)

    def _joined_rows(self, indices, dtype, from_windows=True):
        """Return ``(tokens [N, T + 1] of dtype, segments)`` of full concat rows read a slice per row, or None.

        ``segments``: int64 ``(documents, row_first, begin, end, flat_begin)`` of each row's documents in order:
        the stream positions of the row's first token and of the segment's ``[begin, end)``, and where the
        segment begins in the flattened tokens. None where a row is past the stream's end, lies in two files,
        or the ids are a record file's field not held in memory (those are read by their pieces).
        ``from_windows``: take the ids from the SequenceWindows held, where there are some (else from the files).

        NOTE [concat rows]: a file stores its documents back to back, so a
        full concat row (all but the stream's last) is one slice of the
        stored ids with the end-of-document ids of the documents it ends
        put in between; its positions and document ids follow from where
        those ids lie, and cu_seqlens from the segments, not per token. One
        slice per row instead of one per piece: batches of 8 x 2048 over the
        lm benchmark's 100,000 documents (28.9M tokens, one file, warm, 2
        cores, 200 batches, 3 interleaved rounds, /tmp/lmcmp.py) took
        292-311 us against 389-415 us by the pieces (before their
        cu_seqlens), with equal outputs. A batch holding the stream's last
        row, or a row across two shards, is read by its pieces (NOTE
        [sequence pieces]); so is a record file's tokens field.
        """
        starts, lengths = self._stream()
        width, batch_size = self.seq_len + 1, len(indices)
        first = indices * self.seq_len
        last = first + width  # exclusive
        if self.packing != "concat" or batch_size == 0 or last.max() > starts[-1]:
            return None
        d0 = np.searchsorted(starts, first, side="right") - 1
        d1 = np.searchsorted(starts, last - 1, side="right") - 1
        held = self._windows.rows(first, width) if from_windows and self._windows is not None else None
        if held is None:
            if self.field is not None:
                return None
            in_last = last - starts[d1]  # positions of document d1 in the row (its eod too, where past its length)
            joined = self.dataset.read_token_spans(d0, first - starts[d0], d1, np.minimum(in_last, lengths[d1]), dtype)
            if joined is None:
                return None
            joined = joined.astype(dtype, copy=False)
        counts = d1 - d0 + 1  # segments (documents) of each row
        documents = np.repeat(d0, counts) + counted(counts)
        row_first = np.repeat(first, counts)
        begin = np.maximum(starts[documents], row_first)  # stream positions of each segment
        end = np.minimum(starts[documents + 1], row_first + width)
        flat_begin = np.repeat(np.arange(batch_size) * width, counts) + begin - row_first
        if held is not None:
            return held.astype(dtype, copy=False), (documents, row_first, begin, end, flat_begin)
        eods = (flat_begin + end - begin - 1)[end == starts[documents + 1]]  # segments that hold their eod
        tokens = np.empty((batch_size, width), dtype)
        stored = np.ones(tokens.size, bool)
        stored[eods] = False
        tokens.reshape(-1)[stored] = joined
        tokens.reshape(-1)[eods] = self.eod
        return tokens, (documents, row_first, begin, end, flat_begin)

    def _from_pieces(self, indices):
        """Return the ``[N, T]`` numpy outputs of rows ``indices`` read a slice per piece.

        NOTE [sequence pieces]: a row is a few pieces of documents (whole, or
        cut at the row's ends) side by side, so the stored ids are read as
        one slice per piece and every output is filled through one mask of
        the rows' tokens in order, with no lookup per token. Batches of 8
        rows of 2048 over 20,000 documents of about 270 tokens (one file,
        warm, this 2-core VM): read_batch at 8.6M tokens/s with a document
        found per token (searchsorted) and gathered, 34.4M through the mask,
        52.9M where every row is full and the outputs are reshaped from the
        pieces (all of a concat batch but the stream's last row), against
        60.9M for nanoGPT's get_batch (x and y only, random offsets into a
        uint16 memmap of the same tokens) in the same run: the per-batch
        numpy calls, about 40, and the slice per piece are the cost.
        """
        _, lengths = self._stream()
        width = self.seq_len + 1
        rows, documents, begins, ends = self._pieces(indices)
        sizes = ends - begins
        filled = np.bincount(rows, weights=sizes, minlength=len(indices)).astype(np.int64)  # tokens of each row
        inside = np.arange(width) < filled[:, None]  # row-major, the pieces' tokens in order
        stored_ends = np.minimum(ends, lengths[documents])
        flat = np.empty(int(sizes.sum()), np.int64)
        ids = np.cumsum(sizes)[ends > stored_ends] - 1  # where an end-of-document id lies among them
        values = np.ones(len(flat), bool)
        values[ids] = False
        flat[values] = self.documents.read_token_ranges(documents, begins, stored_ends)
        flat[ids] = self.eod
        positions, owners = np.repeat(begins, sizes) + counted(sizes), np.repeat(documents, sizes)
        if len(flat) == inside.size:  # every row full (all of a concat batch but the stream's last row): reshape
            tokens, position_ids, document_ids = (array.reshape(inside.shape) for array in (flat, positions, owners))
            labels = tokens[:, 1:]
        else:
            tokens = np.full((len(indices), width), self.pad_id, np.int64)
            tokens[inside] = flat
            position_ids = np.arange(width) - filled[:, None]  # the padding counts from 0
            position_ids[inside] = positions
            document_ids = np.full(tokens.shape, -1, np.int64)
            document_ids[inside] = owners
            labels = tokens[:, 1:].copy()
            labels[~inside[:, 1:]] = IGNORE_INDEX
        return {"input_ids": tokens[:, :-1], "labels": labels, "position_ids": position_ids[:, :-1],
                "document_ids": document_ids[:, :-1]}

    def derived_fields(self, batch):
        """The batch-wide fields of a batch of sequence rows (a Mixture's, its rows from several sources)."""
        return {"cu_seqlens": torch.from_numpy(cu_seqlens(batch["document_ids"].numpy()))}

    def max_batch_bytes(self, batch_size, **options):
        """The most bytes of a batch's tensors: four int64 ``[B, T]`` and cu_seqlens (at most ``B * T + 1``), or
        the ``[B, T + 1]`` stored ids of tokens_only."""
        if self.tokens_only:
            return batch_size * (self.seq_len + 1) * self.dtype.itemsize
        tokens = batch_size * self.seq_len
        return 4 * 8 * tokens + 4 * (tokens + 1) + 5 * 64

    def changed_files(self):
        return self.dataset.changed_files()


def _tokens_field(dataset):
    """Return the tokens field of a RecordDataset read for sequences, or None for a text PackedDataset.

    Raises:
        OptionError: any other dataset, or a record dataset reading no tokens field or several.
    """
    if isinstance(dataset, PackedDataset) and dataset.kind == "text":
        return None
    if isinstance(dataset, RecordDataset):
        tokens = [name for name in dataset.fields if dataset.schema[name].type == "tokens"]
        if len(tokens) == 1:
            return tokens[0]
        raise OptionError(f"seq_len cuts one tokens field into sequences; {dataset.path!r} reads "
                          f"{len(tokens)} ({', '.join(tokens) or 'none'}): pick one with fields=[...]")
    raise OptionError(f"seq_len cuts a text dataset's documents into sequences; got a "
                      f"{getattr(dataset, 'kind', type(dataset).__name__)!r} dataset")


def cu_seqlens(document_ids):
    """Return int32 offsets of the segments of ``document_ids`` ``[B, T]`` flattened: each row starts one, and so
    does each change of document (the padding, -1, is one of its own); the last offset is ``B * T``."""
    starts = np.ones(document_ids.shape, bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return np.append(np.flatnonzero(starts), starts.size).astype(np.int32)


def token_sequences(dataset, seq_len, packing, eod, tokens_only=False):
    """Return the TokenSequences of make_loader's ``seq_len``, ``packing``, ``eod`` and ``tokens_only`` (None:
    ``dataset``)."""
    if seq_len is None:
        if eod is not None or packing != "concat" or tokens_only:
            raise OptionError("eod, packing and tokens_only apply with seq_len=..., the tokens of a sequence")
        return dataset
    if packing not in PACKINGS:
        raise OptionError(f"packing should be one of {PACKINGS}, got packing={packing!r}")
    return TokenSequences(dataset, seq_len, eod, packing, tokens_only)
