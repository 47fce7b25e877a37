"""Fixtures and helpers of the text tests: a tiny IMDB-like corpus and files packed from it.

Import the fixtures by name into a test module (``from text_fixtures import text_corpus``).
"""

import os

import numpy as np
import pytest

from fastdata import convert_text
from fastdata.synthetic import make_text_corpus

FORMATS = {"hdf5": ".h5", "arrow": ".arrow"}
PER_CLASS = 12
NUM_UNSUP = 4


def read_texts(root, relpaths):
    """Return the text of each ``root/relpath``, read as the converter reads it."""
    texts = []
    for relpath in relpaths:
        with open(os.path.join(root, relpath), encoding="utf-8-sig") as f:
            texts.append(f.read())
    return texts


def stored_sequences(path):
    """Return ``(list of int64 id arrays, labels int64 [N], metadata)`` through the format layer."""
    from fastdata.formats import read_packed

    columns, metadata = read_packed(path)
    values, offsets = np.asarray(columns.samples), np.asarray(columns.offsets)
    sequences = [values[offsets[i] : offsets[i + 1]].astype(np.int64) for i in range(columns.num_samples)]
    return sequences, np.asarray(columns.labels).copy(), metadata


def train_hf_tokenizer(texts, path, model="wordlevel"):
    """Train a tiny Hugging Face tokenizer on ``texts`` in memory and save it to ``path``."""
    hf = pytest.importorskip("tokenizers")
    if model == "bpe":
        tokenizer = hf.Tokenizer(hf.models.BPE(unk_token="[UNK]"))
        trainer = hf.trainers.BpeTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]"])
    else:
        tokenizer = hf.Tokenizer(hf.models.WordLevel(unk_token="[UNK]"))
        trainer = hf.trainers.WordLevelTrainer(min_frequency=2, special_tokens=["[PAD]", "[UNK]"])
    tokenizer.normalizer = hf.normalizers.Lowercase()
    tokenizer.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(os.fspath(path))
    return path


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory):
    """``root`` of an IMDB-like tree: train/neg, train/pos (12 reviews each), train/unsup (4); read-only."""
    root = tmp_path_factory.mktemp("text") / "reviews"
    make_text_corpus(root, per_class=PER_CLASS, num_unsup=NUM_UNSUP, seed=0)
    return root


@pytest.fixture(scope="session")
def packed_text(text_corpus, tmp_path_factory):
    """Return ``get(fmt) -> path`` of ``text_corpus/train`` converted once per session (words tokenizer)."""
    folder = tmp_path_factory.mktemp("packed_text")
    cache = {}

    def get(fmt):
        if fmt not in cache:
            out = folder / f"reviews{FORMATS[fmt]}"
            convert_text(text_corpus / "train", out, workers=1, progress=False)
            cache[fmt] = out
        return cache[fmt]

    return get


@pytest.fixture(params=list(FORMATS))
def text_fmt(request):
    return request.param
