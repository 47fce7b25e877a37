"""Text -> token ids, the same way at conversion time and afterwards.

A ``Tokenizer`` is one of three kinds:

* ``"words"``: built in. Optional lower-casing and stripping of HTML line
  breaks (``<br />``), then a regular-expression word/punctuation split and
  a vocabulary lookup; ids ``0`` and ``1`` are usually ``<pad>`` and ``<unk>``.
* ``"bytes"``: the UTF-8 bytes of the (normalized) text are the ids; no
  vocabulary, pad id 0, no unknown id.
* ``"hf"``: a Hugging Face ``tokenizers`` JSON file (optional extra), read
  from the local file only.

``to_dict()`` is the JSON-serializable description a converter stores in
the packed file, so ``Tokenizer.from_file("train.h5")`` encodes new text
exactly like the stored text. Nothing here imports torch (converter workers
import this module, see NOTE [worker start]).
"""

import json
import os
import re
from collections import Counter

import numpy as np

from fastdata._optional import require
from fastdata.errors import FormatError, OptionError

KINDS = ("words", "bytes", "hf")
PAD_TOKEN, UNK_TOKEN = "<pad>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN)
# Words (with inner apostrophes: "don't") or single punctuation marks.
WORD_PATTERN = r"\w+(?:'\w+)*|[^\w\s]"
_HTML_BREAK = re.compile(r"<\s*br\s*/?\s*>", re.IGNORECASE)
_HF_PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<PAD>", "[pad]")
_DEFAULTS = {  # kind -> (lowercase, strip_html) when not given
    "words": (True, True),
    "bytes": (False, True),
    "hf": (False, False),
}


def _import_hf_tokenizers():
    return require("tokenizers", "tokenizers", "a Hugging Face tokenizer file")


def smallest_uint(max_value):
    """Return the smallest unsigned numpy dtype holding ``0..max_value``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def rank_vocabulary(tokens, counts, *, min_freq=1, max_vocab=None):
    """Return the vocabulary list: specials, then tokens by count (ties: by string).

    Args:
        tokens: distinct token strings.
        counts: their counts, same length.
        min_freq: leave out tokens seen fewer times.
        max_vocab: size of the whole vocabulary, specials included.
    """
    _check_vocab_options(min_freq, max_vocab)
    kept = [(-int(c), t) for t, c in zip(tokens, counts) if c >= min_freq and t not in SPECIAL_TOKENS]
    kept.sort()
    room = len(kept) if max_vocab is None else max_vocab - len(SPECIAL_TOKENS)
    return [*SPECIAL_TOKENS, *(t for _, t in kept[:room])]


def _check_vocab_options(min_freq, max_vocab):
    if not isinstance(min_freq, int) or isinstance(min_freq, bool) or min_freq < 1:
        raise OptionError(f"min_freq should be a positive integer, got min_freq={min_freq!r}")
    if max_vocab is not None and (not isinstance(max_vocab, int) or max_vocab <= len(SPECIAL_TOKENS)):
        raise OptionError(
            f"max_vocab should be an integer of at least {len(SPECIAL_TOKENS) + 1} "
            f"({len(SPECIAL_TOKENS)} reserved ids + 1 token), got max_vocab={max_vocab!r}"
        )


class Tokenizer:
    """Encode text to token ids; the description stored in a packed text file.

    Build one with ``Tokenizer.build``, ``Tokenizer.from_vocab_file``,
    ``Tokenizer.from_hf_file``, ``Tokenizer.bytes()`` or read the one a file
    was converted with: ``Tokenizer.from_file("train.h5")``.

    Attributes:
        kind: "words", "bytes" or "hf".
        vocab_size: number of ids (256 for bytes).
        pad_id: id used for padding.
        unk_id: id of unknown words, or None (bytes; hf without unk token).
        dtype: smallest unsigned numpy dtype holding every id.
        max_length: encoded sequences are cut to this many ids (None: no cut).
    """

    def __init__(self, kind, *, vocabulary=None, hf_json=None, lowercase=None, strip_html=None,
                 max_length=None, pattern=WORD_PATTERN, add_special_tokens=True):
        if kind not in KINDS:
            raise OptionError(f"kind should be one of {KINDS}, got kind={kind!r}")
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                       or max_length < 1):
            raise OptionError(f"max_length should be a positive integer or None, got max_length={max_length!r}")
        default_lower, default_strip = _DEFAULTS[kind]
        self.kind = kind
        self.lowercase = default_lower if lowercase is None else bool(lowercase)
        self.strip_html = default_strip if strip_html is None else bool(strip_html)
        self.max_length = max_length
        self.pattern = pattern
        self.add_special_tokens = bool(add_special_tokens)
        self.vocabulary, self.hf_json, self._index, self._hf = None, None, None, None
        if kind == "words":
            self._init_words(vocabulary)
        elif kind == "bytes":
            self.vocab_size, self.pad_id, self.unk_id = 256, 0, None
        else:
            self._init_hf(hf_json)
        self.dtype = smallest_uint(self.vocab_size - 1)

    def _init_words(self, vocabulary):
        vocabulary = list(vocabulary or ())
        if not all(isinstance(token, str) and token for token in vocabulary):
            raise OptionError("vocabulary should be a list of non-empty strings")
        self._index = {token: i for i, token in enumerate(vocabulary)}
        if len(self._index) != len(vocabulary):
            duplicate = next(t for t, c in Counter(vocabulary).items() if c > 1)
            raise OptionError(f"vocabulary lists {duplicate!r} more than once")
        missing = [token for token in SPECIAL_TOKENS if token not in self._index]
        if missing:
            raise OptionError(
                f"vocabulary should contain the reserved tokens {list(SPECIAL_TOKENS)}; missing {missing}"
            )
        self._compiled = re.compile(self.pattern)
        self.vocabulary = vocabulary
        self.vocab_size = len(vocabulary)
        self.pad_id, self.unk_id = self._index[PAD_TOKEN], self._index[UNK_TOKEN]

    def _init_hf(self, hf_json):
        hf = _import_hf_tokenizers()
        try:
            self._hf = hf.Tokenizer.from_str(hf_json)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise FormatError(f"not a Hugging Face tokenizers JSON description: {exc}") from exc
        padding = self._hf.padding
        self._hf.no_padding()  # we truncate (max_length) and pad (loader) ourselves
        self._hf.no_truncation()
        self.hf_json = hf_json
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        unk_token = (json.loads(hf_json).get("model") or {}).get("unk_token")
        self.unk_id = self._hf.token_to_id(unk_token) if unk_token else None
        pad_ids = [self._hf.token_to_id(token) for token in _HF_PAD_TOKENS]
        candidates = [padding["pad_id"]] if padding else [i for i in pad_ids if i is not None]
        self.pad_id = candidates[0] if candidates else 0

    # ----- constructors -------------------------------------------------------------------------

    @classmethod
    def build(cls, texts, *, min_freq=1, max_vocab=None, lowercase=True, strip_html=True, max_length=None,
              pattern=WORD_PATTERN):
        """Build a "words" tokenizer whose vocabulary comes from ``texts``.

        Counts are taken over the stored tokens (after ``max_length``); the
        vocabulary is ``<pad>``, ``<unk>``, then tokens by falling count with
        ties broken by the token string, so it does not depend on text order.
        """
        _check_vocab_options(min_freq, max_vocab)
        probe = cls("words", vocabulary=SPECIAL_TOKENS, lowercase=lowercase, strip_html=strip_html,
                    max_length=max_length, pattern=pattern)
        counts = Counter()
        for text in texts:
            counts.update(probe.tokenize(text))
        vocabulary = rank_vocabulary(list(counts), list(counts.values()), min_freq=min_freq, max_vocab=max_vocab)
        return probe.with_vocabulary(vocabulary)

    @classmethod
    def from_vocab_file(cls, path, **settings):
        """Read a "words" vocabulary from ``path``: one token per line (text before a tab).

        Line ``i`` is id ``i``. ``<pad>`` and ``<unk>`` are put in front (ids 0
        and 1) unless the file lists them. ``settings`` are as for the
        constructor (lowercase, strip_html, max_length, pattern).

        Raises:
            ValueError: the file lists a token twice or is not UTF-8.
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8-sig") as f:
                lines = [line.rstrip("\r\n").split("\t", 1)[0] for line in f]
        except UnicodeDecodeError as exc:
            raise FormatError(f"vocabulary file {path!r} is not UTF-8 text: {exc}") from exc
        tokens = [token for token in lines if token]
        seen = set()
        for number, token in enumerate(tokens, 1):
            if token in seen:
                raise FormatError(f"vocabulary file {path!r} lists {token!r} twice (entry {number}); remove one")
            seen.add(token)
        specials = [token for token in SPECIAL_TOKENS if token not in seen]
        return cls("words", vocabulary=specials + tokens, **settings)

    @classmethod
    def from_hf_file(cls, path, **settings):
        """Load a Hugging Face ``tokenizers`` JSON file (local only; needs the extra).

        Raises:
            MissingDependencyError: ``tokenizers`` is not installed.
            ValueError: the file is not a tokenizers JSON description.
        """
        _import_hf_tokenizers()
        path = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            return cls("hf", hf_json=text, **settings)
        except ValueError as exc:
            raise FormatError(f"{path!r}: {exc}") from exc

    @classmethod
    def bytes(cls, **settings):
        """Return a tokenizer whose ids are the UTF-8 bytes of the text."""
        return cls("bytes", **settings)

    @classmethod
    def from_dict(cls, description):
        """Rebuild a tokenizer from ``to_dict()`` output."""
        settings = {key: description.get(key) for key in ("lowercase", "strip_html", "max_length")}
        kind = description.get("kind")
        if kind == "words":
            return cls(kind, vocabulary=description["vocabulary"], pattern=description["pattern"], **settings)
        if kind == "hf":
            return cls(kind, hf_json=description["hf_json"],
                       add_special_tokens=description.get("add_special_tokens", True), **settings)
        return cls(kind, **settings)

    @classmethod
    def from_file(cls, path):
        """Return the tokenizer a packed text file was converted with.

        Example:
            >>> tokenizer = Tokenizer.from_file("train.h5")
            >>> tokenizer.encode("A great film!")
            array([  2,  87, 19,  8])

        Raises:
            FormatError: ``path`` is not a packed text file.
        """
        from fastdata.formats import read_packed  # formats pull in h5py and pyarrow

        _, metadata = read_packed(path)
        if metadata.get("kind") != "text" or "tokenizer" not in metadata:
            raise FormatError(f"{os.fspath(path)!r} holds {metadata.get('kind')!r} samples, not text; "
                              'convert text with "fastdata convert text"')
        return cls.from_dict(metadata["tokenizer"])

    def with_vocabulary(self, vocabulary):
        """Return a "words" tokenizer with these settings and ``vocabulary``."""
        return Tokenizer("words", vocabulary=vocabulary, lowercase=self.lowercase, strip_html=self.strip_html,
                         max_length=self.max_length, pattern=self.pattern)

    def with_max_length(self, max_length):
        """Return a copy that cuts sequences to ``max_length`` ids (None: no cut)."""
        return Tokenizer.from_dict({**self.to_dict(), "max_length": max_length})

    def to_dict(self):
        """Return a JSON-serializable description (what packed files store)."""
        description = {
            "kind": self.kind,
            "lowercase": self.lowercase,
            "strip_html": self.strip_html,
            "max_length": self.max_length,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "unk_id": self.unk_id,
            "dtype": self.dtype.name,
        }
        if self.kind == "words":
            description.update(pattern=self.pattern, vocabulary=list(self.vocabulary))
        elif self.kind == "hf":
            description.update(hf_json=self.hf_json, add_special_tokens=self.add_special_tokens)
        return description

    def token_id(self, token):
        """Return the id of ``token`` (a special token such as ``"<|endoftext|>"`` too), or None if it has none."""
        if self.kind == "hf":
            return self._hf.token_to_id(token)
        return self._index.get(token) if self.kind == "words" else None

    # ----- encoding -----------------------------------------------------------------------------

    def normalize(self, text):
        """Apply the HTML-break stripping and lower-casing settings to ``text``."""
        if self.strip_html:
            text = _HTML_BREAK.sub(" ", text)
        return text.lower() if self.lowercase else text

    def tokenize(self, text, *, truncate=True):
        """Return the token strings of ``text`` ("words" only), cut to ``max_length``."""
        if self.kind != "words":
            raise TypeError(f"tokenize() splits into words; this tokenizer is {self.kind!r}, use encode()")
        tokens = self._compiled.findall(self.normalize(text))
        return tokens[: self.max_length] if truncate and self.max_length else tokens

    def encode(self, text, *, truncate=True):
        """Return the ids of ``text`` as int64 ``[L]`` (cut to ``max_length`` unless ``truncate=False``)."""
        return self.encode_stored(text, truncate=truncate).astype(np.int64)

    def encode_stored(self, text, *, truncate=True):
        """Return the ids of ``text`` in the stored dtype (``self.dtype``) ``[L]``."""
        limit = self.max_length if truncate else None
        if self.kind == "words":
            index, unk = self._index, self.unk_id
            ids = [index.get(token, unk) for token in self.tokenize(text, truncate=truncate)]
            return np.array(ids, dtype=self.dtype)
        if self.kind == "bytes":
            return np.frombuffer(self.normalize(text).encode("utf-8"), np.uint8)[:limit].copy()
        ids = self._hf.encode(self.normalize(text), add_special_tokens=self.add_special_tokens).ids
        return np.array(ids[:limit], dtype=self.dtype)

    def encode_stored_batch(self, texts, *, truncate=True):
        """Return ``[encode_stored(text) for text in texts]``; a Hugging Face tokenizer encodes them in one call.

        NOTE [batched tokenizing]: ``encode`` builds each text's offsets and
        token strings, which fastdata never stores; ``encode_batch_fast``
        (tokenizers 0.21 on) leaves them out and gives the same ids. One
        thread, 8,000 synthetic reviews (289 ids each, a WordLevel tokenizer):
        1.40 s against 2.31-2.59 s text by text (/tmp/lmp/single.py).
        """
        if self.kind != "hf":
            return [self.encode_stored(text, truncate=truncate) for text in texts]
        limit = self.max_length if truncate else None
        encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)  # older tokenizers: with offsets
        encodings = encode([self.normalize(text) for text in texts], add_special_tokens=self.add_special_tokens)
        return [np.array(encoding.ids[:limit], dtype=self.dtype) for encoding in encodings]

    def encode_batch(self, texts, *, pad_to=None):
        """Encode ``texts`` and pad them as a loader would.

        Returns:
            ``(ids int64 [B, T], lengths int64 [B])`` padded with ``pad_id`` to
            the longest sequence, or to ``pad_to`` (longer ones are cut).
        """
        return pad_sequences([self.encode(text) for text in texts], self.pad_id, pad_to=pad_to)

    def decode(self, ids):
        """Return the text of ``ids`` (words joined by spaces; padding left out)."""
        ids = [int(i) for i in ids if int(i) != self.pad_id]
        if self.kind == "words":
            return " ".join(self.vocabulary[i] for i in ids)
        if self.kind == "bytes":
            return bytes(ids).decode("utf-8", errors="replace")
        return self._hf.decode(ids)

    def __getstate__(self):
        return self.to_dict()

    def __setstate__(self, state):
        self.__dict__.update(Tokenizer.from_dict(state).__dict__)

    def __eq__(self, other):
        return isinstance(other, Tokenizer) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return (f"<Tokenizer {self.kind}: {self.vocab_size} ids ({self.dtype.name}), pad_id={self.pad_id}, "
                f"unk_id={self.unk_id}, lowercase={self.lowercase}, strip_html={self.strip_html}, "
                f"max_length={self.max_length}>")


def eod_id(eod, vocab_size, where, token_id):
    """Return the end-of-document ``eod`` (an id, or a token such as ``"<|endoftext|>"``) as an id of a vocabulary
    of ``vocab_size`` ids whose tokens ``token_id(token)`` looks up (None where it has none).

    Raises:
        OptionError: ``eod`` is no token of the vocabulary, or an id past it, naming ``where``.
    """
    if isinstance(eod, str):
        found = token_id(eod)
        if found is None:
            raise OptionError(f"eod={eod!r} is not a token of the tokenizer of {where!r}; pass its id (an int) or a "
                              "token it has")
        return found
    if isinstance(eod, bool) or not isinstance(eod, (int, np.integer)) or not 0 <= eod < vocab_size:
        raise OptionError(f"eod should be an id of the vocabulary of {where!r} (0..{vocab_size - 1}) or one of its "
                          f"tokens, got eod={eod!r}")
    return int(eod)


def pad_sequences(sequences, pad_id, *, pad_to=None):
    """Pad 1-D id arrays into ``(ids int64 [B, T], lengths int64 [B])``; cut to ``pad_to`` if given."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    width = pad_to if pad_to is not None else int(lengths.max(initial=0))
    lengths = np.minimum(lengths, width)
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    for row, (sequence, length) in enumerate(zip(sequences, lengths)):
        ids[row, :length] = sequence[:length]
    return ids, lengths
