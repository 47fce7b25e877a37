"""Text corpus -> packed token arrays: tokenized once, loaded as int arrays ever after.

Sources: a folder with one sub-folder per label holding ``.txt`` files (the
IMDB layout, ``train/pos``, ``train/neg``, ``train/unsup``), a CSV/TSV file,
a JSON Lines file, or a plain text file with one sample per line.

NOTE [vocabulary in one pass]: when the vocabulary is built from the corpus,
workers split each text into words and send back its distinct words (one
string) and the position of each word among them; the parent numbers new
words in input order ("provisional" ids) and stores provisional ids. After
the last text it ranks the words by count (ties by string) and rewrites the
stored ids through one lookup table. The corpus is read and split once, and
the result depends only on the input order, never on the number of workers.
"""

import json
import os
import time
from contextlib import closing, nullcontext
from functools import partial

import numpy as np

from fastdata.codecs.tokenizers import SPECIAL_TOKENS, Tokenizer, eod_id, rank_vocabulary
from fastdata.converters.parallel import ordered_map
from fastdata.converters.report import ON_ERROR, ConversionReport, check_choice, handle_bad_input
from fastdata.converters.shards import source_digest
from fastdata.converters.staging import allocated_memmap, staged_output
from fastdata.converters.textshards import finished_folder, length_stats, shard_options, write_shard_folder
from fastdata.converters.textsources import (
    SOURCE_FORMATS,
    UNLABELED_FOLDER,
    find_texts,
    read_source,
    resolve_labels,
    source_format_of,
)
from fastdata.converters.upload import remote_output
from fastdata.errors import NotFoundError, OptionError, SourceError
from fastdata.formats import Columns, write_packed
from fastdata.formats.shards import read_index

PACKED_EXTENSIONS = (".h5", ".hdf5", ".arrow")
_REMAP_CHUNK = 1 << 24  # provisional ids rewritten this many at a time
_WRITE_TOKENS = 1 << 20  # ids gathered in memory before one write

__all__ = ["SOURCE_FORMATS", "UNLABELED_FOLDER", "convert_text", "find_texts"]


def convert_text(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | Tokenizer = "words",
    vocab: str | os.PathLike | None = None,
    min_freq: int = 1,
    max_vocab: int | None = None,
    max_length: int | None = None,
    lowercase: bool | None = None,
    strip_html: bool | None = None,
    source_format: str | None = None,
    text_field: str = "text",
    label_field: str | None = "label",
    include_unsup: bool = False,
    workers: int | None = None,
    on_error: str = "skip",
    overwrite: bool = False,
    progress: bool = True,
    format: str | None = None,
    shard_size: int | None = None,
    resume: bool = False,
    storage_options: dict | None = None,
    eod: int | str | None = None,
) -> ConversionReport:
    """Tokenize a text corpus once into a packed ``.h5`` or ``.arrow`` file, or a shard folder.

    Args:
        src: a folder ``src/<label>/<sample>.txt`` (e.g. IMDB's ``train/``), a
            ``.csv``/``.tsv`` file with a header, a ``.jsonl`` file, or a text
            file with one sample per line (no labels).
        out: output path: a ``.h5``, ``.hdf5`` or ``.arrow`` file, or else a
            shard folder (files of about ``shard_size`` bytes and ``index.json``),
            which appears whole at the end. A URL (``s3://bucket/wiki/``) is a
            shard folder there, uploaded at the end (its index last).
        tokenizer: "words" (built in), "bytes" (UTF-8 bytes as ids), a path
            to a Hugging Face ``tokenizers`` JSON file, a packed text file or
            shard folder whose tokenizer is reused (e.g. the train file for
            the test split), or a Tokenizer.
        vocab: "words": a vocabulary file (one token per line) instead of
            building the vocabulary from the corpus.
        min_freq: "words", built vocabulary: leave out rarer tokens (they
            become ``<unk>``).
        max_vocab: "words", built vocabulary: largest vocabulary size,
            ``<pad>`` and ``<unk>`` included.
        max_length: keep at most this many ids per sample.
        lowercase: lower-case the text; default True for "words" only.
        strip_html: replace HTML line breaks (``<br />``) by spaces; default
            True except for Hugging Face tokenizers.
        source_format: one of SOURCE_FORMATS; default from ``src``.
        text_field: CSV or Parquet column, or JSON field, holding the text.
        label_field: CSV or Parquet column, or JSON field, holding the label, or None for
            unlabeled data. Integer labels that are class indices (all
            below 1,024, or at least half of ``0..max`` present) are kept;
            other labels (strings, ids, negative or huge integers) become
            indices in sorted order. Booleans become 0/1. Either way
            ``classes[label]`` is the label as written.
        include_unsup: folder source: also store the ``unsup`` folder's
            texts, with label -1.
        workers: processes to tokenize with; default all cores. The file
            is the same for any number.
        on_error: for an input that cannot be used (bytes that are not
            UTF-8, empty text, missing field, bad label): "skip" it, "warn"
            and skip it, or "raise" SampleError.
        overwrite: replace an existing ``out``.
        progress: show a progress bar (only on a terminal).
        format: shard folder: its container, "hdf5" (default) or "arrow".
        shard_size: shard folder: bytes of ids, labels and offsets per shard
            (default 64 MiB); a longer sample gets a shard of its own.
        resume: shard folder: keep a finished ``out`` of the same settings if every file is as its index
            lists it; convert again a finished one with a file missing or damaged (a text conversion
            cannot redo one shard: its vocabulary needs every text). An interrupted conversion left
            nothing behind, so it starts again.
        storage_options: URL ``out``: fsspec keywords (credentials, ``endpoint_url``...).
        eod: the end-of-document id (an int) or token (``"<|endoftext|>"``) of the tokenizer, recorded
            for language-model sequences (``make_loader(seq_len=...)`` then needs no ``eod=``); nothing
            is inserted into the stored documents.

    Returns:
        ConversionReport.

    Example:
        >>> convert_text("aclImdb/train", "train.h5", max_length=512, min_freq=2)
        >>> convert_text("aclImdb/test", "test.h5", tokenizer="train.h5")
        >>> convert_text("wiki.jsonl", "wiki/", format="arrow", shard_size=256 << 20)
    """
    started = time.perf_counter()
    check_choice("on_error", on_error, ON_ERROR)
    shards = shard_options(out, format, shard_size, on_error)
    if resume and shards is None:
        raise OptionError(f"resume needs a shard folder, not the file {os.fspath(out)!r}; give OUT without an "
                          "extension")
    remote = remote_output(out, storage_options, shards is not None)
    probe, build = _resolve_tokenizer(tokenizer, vocab, min_freq, max_vocab, max_length, lowercase, strip_html)
    if eod is not None and build:
        raise OptionError("eod names a token of the tokenizer, and this one's vocabulary is built from the corpus; "
                          "give a tokenizer (a tokenizers file, --vocab, or a converted file) to record an eod")
    eod = None if eod is None else eod_id(eod, probe.vocab_size, src, probe.token_id)
    src = os.fspath(src)
    inputs = read_source(src, source_format_of(src, source_format), text_field, label_field, include_unsup)
    source, redone = _source(inputs, src, text_field, label_field, include_unsup), []
    if shards is not None:
        shards["source_files"] = _source_files(src, inputs)
    if resume:  # see NOTE [resume checks what it keeps] in converters/shards.py
        expected = {**shards, "preprocessing": _preprocessing(probe, min_freq, max_vocab, eod), "source": source}
        finished, redone = finished_folder(out, expected, build, remote)
        if finished is not None:
            skipped = [(entry["path"], entry["reason"]) for entry in finished["skipped"]]
            return ConversionReport(os.fspath(out), finished["num_samples"], skipped, time.perf_counter() - started,
                                    "doc", finished=True)
    overwrite = overwrite or bool(redone)  # a finished folder a resume found damaged is converted again whole
    # A URL: the folder is written on this machine, then uploaded (index last) when it is complete.
    local = nullcontext(out) if remote is None else remote.uploading(overwrite)
    with local as local_out, staged_output(local_out, overwrite, source=src, folder=shards is not None) as (
            staging, staged_path):
        spec_path = os.path.join(staging, "tokenizer.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(probe.to_dict(), f)
        # Tokenize every usable input, in input order: ids (or provisional ids) per sample.
        with closing(_TokenSink(staging, np.uint32 if build else probe.dtype)) as sink:
            kept, skipped, truncated, words = _tokenize_all(inputs, sink, spec_path, build, workers, on_error,
                                                            progress)
            labels, classes = resolve_labels(inputs, kept, src, skipped)
            # Rank the corpus words into the vocabulary: provisional -> final ids (NOTE [vocabulary in one pass]).
            tokenizer, table = probe, None
            if build:
                tokenizer = probe.with_vocabulary(_rank(words, sink, min_freq, max_vocab))
                table = _lookup_table(words, tokenizer)
            # Describe the dataset, then write ids, offsets and labels.
            metadata = _metadata(source, sink.offsets(), labels, _count_unk(sink, table, tokenizer.unk_id), classes,
                                 tokenizer, truncated, skipped, min_freq, max_vocab, eod)
            if shards is None:
                if table is not None:
                    sink.remap(table, tokenizer.dtype)
                write_packed(staged_path, Columns(sink.values(), labels, sink.offsets()), metadata)
            else:  # shard files, then the index (see NOTE [shards from the end] in textshards)
                write_shard_folder(staged_path, shards, sink, table, labels, metadata, truncated, kept,
                                   len(inputs.names))
    return ConversionReport(os.fspath(out), len(kept), skipped, time.perf_counter() - started, "doc", redone=redone,
                            redone_whole=bool(redone))


def _resolve_tokenizer(tokenizer, vocab, min_freq, max_vocab, max_length, lowercase, strip_html):
    """Return ``(tokenizer, build)``; with ``build`` it only holds settings, no vocabulary yet."""
    settings = {"lowercase": lowercase, "strip_html": strip_html, "max_length": max_length}
    building_options = vocab is not None or min_freq != 1 or max_vocab is not None
    if isinstance(tokenizer, (str, os.PathLike)) and os.path.isdir(tokenizer):
        tokenizer = read_index(tokenizer).path(0)  # a shard folder: every shard holds the tokenizer
    if isinstance(tokenizer, (str, os.PathLike)) and os.fspath(tokenizer).lower().endswith(PACKED_EXTENSIONS):
        tokenizer = Tokenizer.from_file(tokenizer)
    if isinstance(tokenizer, Tokenizer):
        if building_options or lowercase is not None or strip_html is not None:
            raise OptionError("a given tokenizer keeps its own settings; only max_length may be set with it "
                             "(vocab, min_freq, max_vocab, lowercase and strip_html may not)")
        return (tokenizer if max_length is None else tokenizer.with_max_length(max_length)), False
    if tokenizer == "words":
        _check_vocab_options(min_freq, max_vocab)
        if vocab is not None:
            if min_freq != 1 or max_vocab is not None:
                raise OptionError("min_freq and max_vocab apply when building a vocabulary; not with vocab=")
            return Tokenizer.from_vocab_file(vocab, **settings), False
        return Tokenizer("words", vocabulary=SPECIAL_TOKENS, **settings), True
    if building_options:
        raise OptionError(f"vocab, min_freq and max_vocab apply to the 'words' tokenizer, not {tokenizer!r}")
    if tokenizer == "bytes":
        return Tokenizer.bytes(**settings), False
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer should be 'words', 'bytes', a file path or a Tokenizer, "
                        f"got {type(tokenizer).__name__}")
    if not os.path.isfile(tokenizer):
        raise NotFoundError(f"tokenizer should be 'words', 'bytes' or an existing tokenizers .json or "
                                f"packed file; {os.fspath(tokenizer)!r} does not exist")
    return Tokenizer.from_hf_file(tokenizer, **settings), False


def _check_vocab_options(min_freq, max_vocab):
    rank_vocabulary([], [], min_freq=min_freq, max_vocab=max_vocab)  # raises ValueError on bad values


# ----- tokenizing -----------------------------------------------------------------------------------

_WORKER_TOKENIZER = {}  # spec path -> Tokenizer, loaded once per process


def _load_tokenizer(spec_path):
    if spec_path not in _WORKER_TOKENIZER:
        _WORKER_TOKENIZER.clear()  # one conversion at a time
        with open(spec_path, encoding="utf-8") as f:
            _WORKER_TOKENIZER[spec_path] = Tokenizer.from_dict(json.load(f))
    return _WORKER_TOKENIZER[spec_path]


def _tokenize_input(payload, spec_path, read_file, build):
    """Return ``(ids or (words, positions), truncated, None)`` or ``(None, False, reason)``."""
    tokenizer = _load_tokenizer(spec_path)
    if read_file:
        try:
            with open(payload, "rb") as f:
                payload = f.read().decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            return None, False, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
        except OSError as exc:
            return None, False, f"cannot read: {exc}"
    try:
        return _outcome(*_tokenize_text(tokenizer, payload, build))
    except Exception as exc:  # a tokenizer failure means this input is unusable
        return None, False, f"cannot tokenize: {type(exc).__name__}: {exc}"


def _outcome(result, count, total):
    """Return ``_tokenize_input``'s answer for a text tokenized to ``count`` of its ``total`` ids or words."""
    return (result, count < total, None) if count else (None, False, "no tokens (empty text)")


def _tokenize_inputs(payloads, spec_path, read_file, build):
    """Return ``_tokenize_input`` of each of ``payloads``: texts for a Hugging Face tokenizer encoded in one call
    (NOTE [batched tokenizing] in codecs/tokenizers.py), or one by one where one of them fails, to name it."""
    tokenizer = _load_tokenizer(spec_path)
    if build or read_file or tokenizer.kind != "hf":
        return [_tokenize_input(payload, spec_path, read_file, build) for payload in payloads]
    try:
        encoded = tokenizer.encode_stored_batch(payloads, truncate=False)
    except Exception:  # a text the tokenizer refuses: each on its own, so that the report names that one
        return [_tokenize_input(payload, spec_path, read_file, build) for payload in payloads]
    return [_outcome(*_cut(ids, tokenizer.max_length)) for ids in encoded]


def _tokenize_text(tokenizer, text, build):
    """Return ``(result, stored count, count before max_length)``."""
    limit = tokenizer.max_length
    if build:  # see NOTE [vocabulary in one pass]
        tokens = tokenizer.tokenize(text, truncate=False)
        count = len(tokens) if limit is None else min(limit, len(tokens))
        kept = tokens[:count]
        distinct = {word: i for i, word in enumerate(dict.fromkeys(kept))}  # first-seen order
        positions = np.array(list(map(distinct.__getitem__, kept)), dtype=np.uint32)
        return ("\n".join(distinct), positions), count, len(tokens)  # words never hold whitespace
    return _cut(tokenizer.encode_stored(text, truncate=False), limit)


def _cut(ids, limit):
    """Return ``(ids cut to limit, their count, the count before)``."""
    count = len(ids) if limit is None else min(limit, len(ids))
    return ids[:count], count, len(ids)


def _tokenize_all(inputs, sink, spec_path, build, workers, on_error, progress):
    """Tokenize inputs into ``sink``; return ``(kept, skipped, bool truncated [kept], provisional words)``."""
    todo = [payload for index, payload in enumerate(inputs.payloads) if index not in inputs.reasons]
    tokenize = partial(_tokenize_inputs, spec_path=spec_path, read_file=inputs.format == "folder", build=build)
    words = {}  # word -> provisional id, numbered in input order
    kept, skipped, truncated = [], [], bytearray()  # one byte per kept sample
    with closing(ordered_map(tokenize, todo, workers=workers, progress=progress, unit="doc", batched=True)) as results:
        for index, name in enumerate(inputs.names):
            result, cut, reason = (None, False, inputs.reasons[index]) if index in inputs.reasons else next(results)
            if reason is not None:
                handle_bad_input("text", name, index, reason, on_error)
                skipped.append((name, reason))
                continue
            if build:
                result = _provisional_ids(words, *result)
            sink.append(result)
            kept.append(index)
            truncated.append(cut)
    if not kept:
        first = f" (first: {skipped[0][0]}: {skipped[0][1]})" if skipped else ""
        raise SourceError(f"no usable text: all {len(inputs.names)} inputs were skipped{first}")
    return kept, skipped, np.frombuffer(truncated, dtype=bool), words


def _provisional_ids(words, distinct, positions):
    """Return a text's provisional ids, numbering its new words (see NOTE [vocabulary in one pass])."""
    split = distinct.split("\n")
    ids = list(map(words.get, split))  # the parent's hot loop: known words are looked up in C
    if None in ids:
        for i, word in enumerate(split):
            if ids[i] is None:
                ids[i] = words[word] = len(words)
    return np.array(ids, dtype=np.uint32)[positions]




def _rank(words, sink, min_freq, max_vocab):
    counts = np.zeros(len(words), dtype=np.int64)
    for chunk in sink.chunks():
        counts += np.bincount(chunk, minlength=len(words))
    return rank_vocabulary(list(words), counts.tolist(), min_freq=min_freq, max_vocab=max_vocab)


def _lookup_table(words, tokenizer):
    """Map provisional ids to final ids: ``int [num words]``, ``unk_id`` for words left out."""
    table = np.full(len(words), tokenizer.unk_id, dtype=tokenizer.dtype)
    for final, word in enumerate(tokenizer.vocabulary):
        provisional = words.get(word)
        if provisional is not None:
            table[provisional] = final
    return table


# ----- metadata ----------------------------------------------------------------------------------------


def _source(inputs, src, text_field, label_field, include_unsup):
    """Return the metadata's ``source``: where the texts came from and how they were read."""
    source = {"path": os.path.abspath(src), "format": inputs.format, "num_inputs": len(inputs.names)}
    if inputs.format == "folder":
        source["include_unsup"] = include_unsup
    elif inputs.format != "lines":
        source.update(text_field=text_field, label_field=label_field)
    return source


def _source_files(src, inputs):
    """Return the digest of the input files (source_digest), which a resume compares."""
    if inputs.format == "folder":
        return source_digest(src, inputs.names)
    if inputs.format == "hf":  # its Arrow files and the JSON that types them
        return source_digest(src, sorted(name for name in os.listdir(src) if name.endswith((".arrow", ".json"))))
    return source_digest(os.path.dirname(os.path.abspath(src)), [os.path.basename(src)])


def _preprocessing(tokenizer, min_freq, max_vocab, eod=None):
    return {
        **({"eod": eod} if eod is not None else {}),  # see convert_text's eod
        "tokenizer": tokenizer.kind,
        "lowercase": tokenizer.lowercase,
        "strip_html": tokenizer.strip_html,
        "max_length": tokenizer.max_length,
        "vocab_size": tokenizer.vocab_size,
        "min_freq": min_freq,
        "max_vocab": max_vocab,
    }


def _metadata(source, offsets, labels, unk, classes, tokenizer, truncated, skipped, min_freq, max_vocab, eod):
    lengths = np.diff(offsets)
    return {
        "kind": "text",
        "storage": "tokens",
        "num_samples": len(lengths),
        "sample_shape": [None],  # one variable-length sequence per sample
        "sample_dtype": tokenizer.dtype.name,
        "classes": classes,
        "class_counts": np.bincount(labels[labels >= 0], minlength=len(classes)).tolist(),
        "num_unlabeled": int(np.count_nonzero(labels < 0)),
        "tokenizer": tokenizer.to_dict(),
        "preprocessing": _preprocessing(tokenizer, min_freq, max_vocab, eod),
        "lengths": length_stats(lengths, truncated),
        "unk_fraction": round(unk / max(1, int(lengths.sum())), 6),
        "source": source,
        "skipped": [{"path": name, "reason": reason} for name, reason in skipped],
    }


def _count_unk(sink, table, unk_id):
    """Count the stored ids that are ``unk_id`` once mapped through ``table`` (None: they are final)."""
    if unk_id is None:
        return 0
    if table is None:
        return sum(int(np.count_nonzero(chunk == unk_id)) for chunk in sink.chunks())
    is_unk = table == unk_id
    return sum(int(np.count_nonzero(is_unk[chunk])) for chunk in sink.chunks())


def _chunks(values):
    for start in range(0, len(values), _REMAP_CHUNK):
        yield np.asarray(values[start : start + _REMAP_CHUNK])


class _TokenSink:
    """Appends each sample's ids to a staging file and records its length."""

    def __init__(self, staging, dtype):
        self._staging = staging
        self.dtype = np.dtype(dtype)
        self._path = os.path.join(staging, "tokens.bin")
        self._file = open(self._path, "wb")
        self._lengths = []
        self._pending, self._pending_size = [], 0

    def append(self, ids):
        self._pending.append(ids)
        self._pending_size += len(ids)
        self._lengths.append(len(ids))
        if self._pending_size >= _WRITE_TOKENS:
            self._flush()

    def _flush(self):
        if self._pending:
            self._file.write(np.concatenate(self._pending).astype(self.dtype, copy=False).tobytes())
        self._pending, self._pending_size = [], 0

    def close(self):
        self._file.close()

    def _finish(self):
        if not self._file.closed:
            self._flush()
            self._file.close()

    def values(self):
        """Return the stored ids as a read-only memmap ``[num tokens]``."""
        self._finish()
        return np.memmap(self._path, mode="r", dtype=self.dtype, shape=(sum(self._lengths),))

    def chunks(self):
        yield from _chunks(self.values())

    def pop_from(self, start):
        """Return the ids from ``start`` on and cut them off the staging file, freeing their disk blocks."""
        self._finish()
        itemsize = self.dtype.itemsize
        ids = np.fromfile(self._path, dtype=self.dtype, offset=int(start) * itemsize)
        os.truncate(self._path, int(start) * itemsize)
        return ids

    def offsets(self):
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        return offsets

    def remap(self, table, dtype):
        """Rewrite every stored id ``i`` as ``table[i]`` in ``dtype``."""
        path = os.path.join(self._staging, "tokens.final.bin")
        old = self.values()
        new = allocated_memmap(path, dtype, old.shape)  # see NOTE [allocated maps]
        for start in range(0, len(old), _REMAP_CHUNK):
            np.take(table, old[start : start + _REMAP_CHUNK], out=new[start : start + _REMAP_CHUNK])
        new.flush()
        del new, old
        os.remove(self._path)
        self._path, self.dtype = path, np.dtype(dtype)
