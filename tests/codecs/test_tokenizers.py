"""Tokenizer: normalization, vocabulary building, vocabulary files, bytes, Hugging Face files."""

import json
import pickle
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import train_hf_tokenizer

from fastdata import MissingDependencyError, Tokenizer
from fastdata.codecs.tokenizers import PAD_TOKEN, UNK_TOKEN, pad_sequences, rank_vocabulary

TEXTS = [
    "A great film.<br /><br />I LOVED it, don't miss it!",
    "A bad film... I hated it<br/>really.",
    "great great acting; bad plot",
]


def test_normalize_strips_line_breaks_and_lowercases():
    tokenizer = Tokenizer.build(TEXTS)
    assert tokenizer.normalize("Hi<br />There<BR/>x<br >") == "hi there x "
    assert tokenizer.tokenize("Don't STOP<br />now!!") == ["don't", "stop", "now", "!", "!"]


def test_settings_can_be_turned_off():
    tokenizer = Tokenizer.build(TEXTS, lowercase=False, strip_html=False)
    assert tokenizer.tokenize("Hi<br />") == ["Hi", "<", "br", "/", ">"]


def test_build_ranks_by_count_then_string_with_reserved_ids_first():
    tokenizer = Tokenizer.build(["b a c a b d", "a"])
    assert tokenizer.vocabulary == [PAD_TOKEN, UNK_TOKEN, "a", "b", "c", "d"]
    assert (tokenizer.pad_id, tokenizer.unk_id) == (0, 1)
    assert tokenizer.encode("a d zebra").tolist() == [2, 5, 1]


def test_build_does_not_depend_on_text_order():
    assert Tokenizer.build(TEXTS) == Tokenizer.build(TEXTS[::-1])


def test_min_freq_and_max_vocab():
    texts = ["a a a b b c", "a b d"]
    assert Tokenizer.build(texts, min_freq=2).vocabulary == [PAD_TOKEN, UNK_TOKEN, "a", "b"]
    assert Tokenizer.build(texts, max_vocab=3).vocabulary == [PAD_TOKEN, UNK_TOKEN, "a"]
    assert Tokenizer.build(texts, max_vocab=3).encode("b a").tolist() == [1, 2]


@pytest.mark.parametrize("options, match", [
    ({"min_freq": 0}, "min_freq"),
    ({"max_vocab": 2}, "max_vocab"),
    ({"max_length": 0}, "max_length"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.build(TEXTS, **options)


def test_max_length_truncates_encode_and_counts():
    tokenizer = Tokenizer.build(["a b c d e", "e"], max_length=2)
    assert tokenizer.encode("a b c").tolist() == tokenizer.encode("a b").tolist()
    assert len(tokenizer.encode("a b c", truncate=False)) == 3
    assert "c" not in tokenizer.vocabulary  # counted after the cut


def test_dtype_is_the_smallest_holding_the_vocabulary():
    small = Tokenizer("words", vocabulary=[PAD_TOKEN, UNK_TOKEN] + [f"w{i}" for i in range(254)])
    large = Tokenizer("words", vocabulary=[PAD_TOKEN, UNK_TOKEN] + [f"w{i}" for i in range(255)])
    assert (small.dtype, large.dtype) == (np.uint8, np.uint16)


def test_vocab_file_puts_missing_reserved_tokens_first(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("great\t10\nfilm\t7\n\nbad\n", encoding="utf-8")
    tokenizer = Tokenizer.from_vocab_file(path)
    assert tokenizer.vocabulary == [PAD_TOKEN, UNK_TOKEN, "great", "film", "bad"]
    assert tokenizer.encode("Great FILM, bad").tolist() == [2, 3, 1, 4]


def test_vocab_file_keeps_listed_reserved_positions(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("film\n<unk>\n<pad>\ngreat\n", encoding="utf-8")
    tokenizer = Tokenizer.from_vocab_file(path)
    assert (tokenizer.pad_id, tokenizer.unk_id) == (2, 1)
    assert tokenizer.encode("great zzz").tolist() == [3, 1]


def test_vocab_file_with_a_duplicate_is_refused(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("a\nb\na\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'a' twice"):
        Tokenizer.from_vocab_file(path)


def test_bytes_are_the_utf8_bytes_of_the_normalized_text():
    tokenizer = Tokenizer.bytes(max_length=6)
    assert tokenizer.dtype == np.uint8 and tokenizer.pad_id == 0 and tokenizer.unk_id is None
    assert tokenizer.encode("é<br />x", truncate=False).tolist() == list("é x".encode())
    assert tokenizer.encode("abcdefgh").tolist() == list(b"abcdef")
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"


def test_description_round_trips_through_json_and_pickle():
    tokenizer = Tokenizer.build(TEXTS, max_length=7, min_freq=1)
    again = Tokenizer.from_dict(json.loads(json.dumps(tokenizer.to_dict())))
    assert again == tokenizer == pickle.loads(pickle.dumps(tokenizer))
    assert again.encode(TEXTS[0]).tolist() == tokenizer.encode(TEXTS[0]).tolist()


def test_decode_and_padded_batches():
    tokenizer = Tokenizer.build(TEXTS)
    assert tokenizer.decode(tokenizer.encode("a great film")) == "a great film"
    ids, lengths = tokenizer.encode_batch(["a great film", "bad"])
    assert ids.dtype == np.int64 and ids.shape == (2, 3) and lengths.tolist() == [3, 1]
    assert ids[1, 1:].tolist() == [tokenizer.pad_id] * 2
    cut, cut_lengths = pad_sequences([np.arange(5), np.arange(2)], -1, pad_to=3)
    assert cut.tolist() == [[0, 1, 2], [0, 1, -1]] and cut_lengths.tolist() == [3, 2]


def test_hf_tokenizer_file_encodes_like_the_library(tmp_path):
    hf = pytest.importorskip("tokenizers")
    path = train_hf_tokenizer(TEXTS * 3, tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_hf_file(path, max_length=5)
    reference = hf.Tokenizer.from_file(str(path))
    assert tokenizer.encode(TEXTS[0]).tolist() == reference.encode(TEXTS[0]).ids[:5]
    assert tokenizer.pad_id == reference.token_to_id("[PAD]")
    assert tokenizer.unk_id == reference.token_to_id("[UNK]")
    assert not tokenizer.lowercase and not tokenizer.strip_html
    again = pickle.loads(pickle.dumps(tokenizer))
    assert again == tokenizer and again.encode(TEXTS[1]).tolist() == tokenizer.encode(TEXTS[1]).tolist()


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(max_size=60), max_size=12), model=st.sampled_from(["wordlevel", "bpe"]),
       max_length=st.sampled_from([None, 1, 4]), kind=st.sampled_from(["hf", "words", "bytes"]))
def test_a_batch_encodes_as_each_text_does(tmp_path_factory, texts, model, max_length, kind):
    # hf: encode_batch_fast (no offsets) against encode; any text, empty ones and line breaks included
    if kind == "hf":
        path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
        tokenizer = Tokenizer.from_hf_file(train_hf_tokenizer(TEXTS * 3, path, model), max_length=max_length)
    else:
        tokenizer = Tokenizer.build(TEXTS, max_length=max_length) if kind == "words" else Tokenizer("bytes")
    for truncate in (True, False):
        batch = tokenizer.encode_stored_batch(texts, truncate=truncate)
        assert len(batch) == len(texts)
        for ids, text in zip(batch, texts):
            expected = tokenizer.encode_stored(text, truncate=truncate)
            assert ids.dtype == expected.dtype and ids.tolist() == expected.tolist(), text


def test_hf_tokenizer_file_that_is_not_one(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_file(path)


def test_missing_hf_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes "import tokenizers" fail
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastdata\[tokenizers\]'"):
        Tokenizer.from_hf_file(tmp_path / "tokenizer.json")


def test_rank_vocabulary_leaves_reserved_tokens_to_their_ids():
    assert rank_vocabulary(["<unk>", "x"], [9, 1]) == [PAD_TOKEN, UNK_TOKEN, "x"]
