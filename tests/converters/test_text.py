"""convert_text: every source kind and tokenizer round-trips; bad input is skipped or raised."""

import json
import os

import numpy as np
import pytest
from support import FORMATS, TEXT_NUM_UNSUP, TEXT_PER_CLASS, read_texts, stored_sequences, train_hf_tokenizer

from fastdata import SampleError, SourceError, Tokenizer, convert_text
from fastdata.converters import find_texts
from fastdata.measure.synthetic import make_reviews, write_text_file

TEXTS, LABELS = make_reviews(16, seed=3)


def convert(src, out, **options):
    return convert_text(src, out, workers=1, progress=False, **options)


def assert_round_trip(path, texts, tokenizer):
    sequences, _, metadata = stored_sequences(path)
    assert len(sequences) == len(texts)
    for sequence, text in zip(sequences, texts):
        np.testing.assert_array_equal(sequence, tokenizer.encode(text))
    assert Tokenizer.from_file(path) == tokenizer
    return metadata


def test_folder_round_trip_matches_the_tokenizer_applied_directly(packed_text, text_fmt, text_corpus):
    classes, relpaths, labels = find_texts(text_corpus / "train")
    texts = read_texts(text_corpus / "train", relpaths)
    metadata = assert_round_trip(packed_text(text_fmt), texts, Tokenizer.build(texts))
    _, stored_labels, _ = stored_sequences(packed_text(text_fmt))
    np.testing.assert_array_equal(stored_labels, labels)
    assert classes == metadata["classes"] == ["neg", "pos"]
    assert metadata["kind"] == "text" and metadata["storage"] == "tokens"
    assert metadata["sample_dtype"] == "uint16" and metadata["num_samples"] == 2 * TEXT_PER_CLASS
    assert metadata["class_counts"] == [TEXT_PER_CLASS, TEXT_PER_CLASS] and metadata["num_unlabeled"] == 0
    lengths = metadata["lengths"]
    assert lengths["min"] <= lengths["p50"] <= lengths["p99"] <= lengths["max"]
    assert metadata["skipped"] == [] and metadata["unk_fraction"] == 0


def test_unsup_folder_is_optional_and_unlabeled(text_corpus, tmp_path):
    report = convert(text_corpus / "train", tmp_path / "all.h5", include_unsup=True)
    _, labels, metadata = stored_sequences(report.path)
    assert report.num_samples == 2 * TEXT_PER_CLASS + TEXT_NUM_UNSUP
    assert (labels == -1).sum() == TEXT_NUM_UNSUP == metadata["num_unlabeled"]
    assert metadata["classes"] == ["neg", "pos"]


def test_corpus_root_with_splits_asks_for_a_split(text_corpus, tmp_path):
    with pytest.raises(SourceError, match="pass one split folder"):
        convert(text_corpus, tmp_path / "out.h5")


def test_files_and_workers_give_byte_identical_files(text_corpus, tmp_path, text_fmt):
    one = convert_text(text_corpus / "train", tmp_path / f"one{FORMATS[text_fmt]}", workers=1, progress=False)
    two = convert_text(text_corpus / "train", tmp_path / f"two{FORMATS[text_fmt]}", workers=2, progress=False)
    with open(one.path, "rb") as a, open(two.path, "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("name", ["reviews.csv", "reviews.tsv", "reviews.jsonl"])
def test_table_sources_with_string_labels(tmp_path, name):
    src = write_text_file(tmp_path / name, TEXTS, LABELS, text_field="review", label_field="sentiment")
    report = convert(src, tmp_path / "out.arrow", text_field="review", label_field="sentiment")
    metadata = assert_round_trip(report.path, TEXTS, Tokenizer.build(TEXTS))
    _, labels, _ = stored_sequences(report.path)
    assert metadata["classes"] == ["neg", "pos"]
    assert labels.tolist() == [["neg", "pos"].index(label) for label in LABELS]


@pytest.mark.parametrize("name", ["reviews.csv", "reviews.jsonl"])
def test_integer_labels_are_kept(tmp_path, name):
    labels = [i % 3 + 1 for i in range(len(TEXTS))]
    src = write_text_file(tmp_path / name, TEXTS, labels)
    _, stored, metadata = stored_sequences(convert(src, tmp_path / "out.h5").path)
    assert stored.tolist() == labels and metadata["classes"] == ["0", "1", "2", "3"]


def test_plain_lines_have_no_labels(tmp_path):
    src = write_text_file(tmp_path / "reviews.txt", TEXTS)
    report = convert(src, tmp_path / "out.h5")
    metadata = assert_round_trip(report.path, TEXTS, Tokenizer.build(TEXTS))
    assert metadata["classes"] == [] and metadata["num_unlabeled"] == len(TEXTS)


def test_unlabeled_table(tmp_path):
    src = write_text_file(tmp_path / "reviews.csv", TEXTS, LABELS)
    _, labels, metadata = stored_sequences(convert(src, tmp_path / "out.h5", label_field=None).path)
    assert (labels == -1).all() and metadata["classes"] == []


def test_missing_column_is_a_source_error(tmp_path):
    src = write_text_file(tmp_path / "reviews.csv", TEXTS, LABELS)
    with pytest.raises(SourceError, match="no column 'stars'.*--no-labels"):
        convert(src, tmp_path / "out.h5", label_field="stars")


def test_bytes_tokenizer(tmp_path, text_fmt):
    src = write_text_file(tmp_path / "reviews.jsonl", TEXTS, LABELS)
    report = convert(src, tmp_path / f"out{FORMATS[text_fmt]}", tokenizer="bytes", max_length=300)
    metadata = assert_round_trip(report.path, TEXTS, Tokenizer.bytes(max_length=300))
    assert metadata["sample_dtype"] == "uint8" and metadata["lengths"]["max"] == 300


def test_hf_tokenizer_file(tmp_path, text_fmt):
    path = train_hf_tokenizer(TEXTS, tmp_path / "tokenizer.json", model="bpe")
    src = write_text_file(tmp_path / "reviews.csv", TEXTS, LABELS)
    report = convert(src, tmp_path / f"out{FORMATS[text_fmt]}", tokenizer=path, max_length=64)
    metadata = assert_round_trip(report.path, TEXTS, Tokenizer.from_hf_file(path, max_length=64))
    assert metadata["tokenizer"]["hf_json"] == path.read_text(encoding="utf-8")


def test_an_hf_tokenizer_gives_the_same_bytes_on_any_number_of_workers(tmp_path):
    # texts encoded a chunk at a time (NOTE [batched tokenizing]): an empty one skipped, long ones cut, in order
    path = train_hf_tokenizer(TEXTS, tmp_path / "tokenizer.json", model="bpe")
    texts = TEXTS * 9 + ["", TEXTS[0]]
    src = write_text_file(tmp_path / "reviews.jsonl", texts)
    one, two = (convert_text(src, tmp_path / f"{workers}.h5", tokenizer=path, max_length=40, workers=workers,
                             label_field=None, progress=False) for workers in (1, 2))
    assert (tmp_path / "1.h5").read_bytes() == (tmp_path / "2.h5").read_bytes()
    assert one.skipped == two.skipped == [("reviews.jsonl:145", "no tokens (empty text)")]
    assert_round_trip(one.path, [text for text in texts if text], Tokenizer.from_hf_file(path, max_length=40))


def test_a_text_the_tokenizer_refuses_is_skipped_by_name_and_its_chunk_kept(tmp_path, monkeypatch):
    path = train_hf_tokenizer(TEXTS, tmp_path / "tokenizer.json")
    refused = TEXTS[3]
    encode_stored = Tokenizer.encode_stored

    def refusing(tokenizer, text, **options):
        if text == refused:
            raise ValueError("refused")
        return encode_stored(tokenizer, text, **options)

    monkeypatch.setattr(Tokenizer, "encode_stored", refusing)
    monkeypatch.setattr(Tokenizer, "encode_stored_batch",
                        lambda tokenizer, texts, **options: [refusing(tokenizer, text, **options) for text in texts])
    src = write_text_file(tmp_path / "reviews.jsonl", TEXTS)
    report = convert(src, tmp_path / "out.h5", tokenizer=path, label_field=None)
    assert report.skipped == [("reviews.jsonl:4", "cannot tokenize: ValueError: refused")]
    monkeypatch.undo()
    assert_round_trip(report.path, TEXTS[:3] + TEXTS[4:], Tokenizer.from_hf_file(path))


def test_vocab_file_and_unknown_words(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("the\na\nfilm\n", encoding="utf-8")
    src = write_text_file(tmp_path / "reviews.txt", TEXTS)
    report = convert(src, tmp_path / "out.h5", vocab=vocab)
    metadata = assert_round_trip(report.path, TEXTS, Tokenizer.from_vocab_file(vocab))
    assert metadata["sample_dtype"] == "uint8" and metadata["unk_fraction"] > 0.5


def test_vocabulary_options(tmp_path):
    src = write_text_file(tmp_path / "reviews.txt", TEXTS)
    report = convert(src, tmp_path / "out.h5", min_freq=2, max_vocab=30, max_length=40)
    expected = Tokenizer.build(TEXTS, min_freq=2, max_vocab=30, max_length=40)
    metadata = assert_round_trip(report.path, TEXTS, expected)
    assert len(expected.vocabulary) == 30 and metadata["sample_dtype"] == "uint8"
    assert metadata["lengths"]["max"] == 40 and metadata["lengths"]["truncated"] > 0
    assert metadata["preprocessing"]["min_freq"] == 2


def test_reusing_the_tokenizer_of_a_packed_file(packed_text, tmp_path):
    src = write_text_file(tmp_path / "test.txt", TEXTS)
    report = convert(src, tmp_path / "test.h5", tokenizer=os.fspath(packed_text("hdf5")))
    assert_round_trip(report.path, TEXTS, Tokenizer.from_file(packed_text("hdf5")))


@pytest.mark.parametrize("options, error", [
    ({"tokenizer": "bytes", "min_freq": 2}, "'words' tokenizer"),
    ({"vocab": "v.txt", "max_vocab": 10}, "not with vocab"),
    ({"tokenizer": "missing.json"}, "does not exist"),
    ({"on_error": "ignore"}, "on_error"),
    ({"source_format": "folder"}, "does not fit"),
])
def test_bad_options(tmp_path, options, error):
    src = write_text_file(tmp_path / "reviews.txt", TEXTS)
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        convert(src, tmp_path / "out.h5", **options)


def write_bad_jsonl(path):
    lines = [
        json.dumps({"text": "a fine film", "label": "pos"}),
        "",                                             # empty line
        "{not json",                                    # invalid JSON
        json.dumps({"label": "neg"}),                   # missing text
        json.dumps({"text": "no label"}),               # missing label
        json.dumps({"text": "x", "label": None}),       # null label
        json.dumps({"text": "x", "label": 1.5}),        # float label
        json.dumps({"text": "<br /><br />", "label": "neg"}),  # no tokens
        json.dumps({"text": "a dull film", "label": "neg"}),
    ]
    data = "\n".join(lines).encode() + b'\n{"text": "caf\xe9", "label": "pos"}\n'  # Latin-1 byte
    path.write_bytes(data)
    return path


def test_bad_records_are_skipped_with_reasons(tmp_path):
    report = convert(write_bad_jsonl(tmp_path / "bad.jsonl"), tmp_path / "out.h5")
    sequences, labels, metadata = stored_sequences(report.path)
    reasons = [item["reason"] for item in metadata["skipped"]]
    assert report.num_samples == 2 and labels.tolist() == [1, 0] and len(report.skipped) == 8
    assert [item["path"] for item in metadata["skipped"]][:2] == ["bad.jsonl:2", "bad.jsonl:3"]
    for expected in ("empty line", "invalid JSON", "missing field 'text'", "missing field 'label'",
                     "bad label null", "bad label 1.5", "no tokens", "not valid UTF-8"):
        assert any(expected in reason for reason in reasons), expected


def test_bad_records_raise_or_warn(tmp_path):
    src = write_bad_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(SampleError, match="'bad.jsonl:2'.*empty line") as info:
        convert(src, tmp_path / "out.h5", on_error="raise")
    assert info.value.index == 1 and not os.path.exists(tmp_path / "out.h5")
    with pytest.warns(UserWarning, match="skipped text"):
        convert(src, tmp_path / "out.h5", on_error="warn")
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []  # no staging left


def test_undecodable_and_empty_files_in_a_folder(text_corpus, tmp_path):
    root = tmp_path / "train"
    for label in ("neg", "pos"):
        os.makedirs(root / label)
        for name in sorted(os.listdir(text_corpus / "train" / label))[:3]:
            (root / label / name).write_bytes((text_corpus / "train" / label / name).read_bytes())
    (root / "neg" / "bad.txt").write_bytes(b"caf\xe9 au lait")
    (root / "pos" / "empty.txt").write_bytes(b"")
    report = convert(root, tmp_path / "out.h5")
    assert report.num_samples == 6
    assert dict(report.skipped) == {
        os.path.join("neg", "bad.txt"): "not valid UTF-8 (invalid continuation byte at byte 3)",
        os.path.join("pos", "empty.txt"): "no tokens (empty text)",
    }


def test_mixed_integer_and_string_labels(tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n')
    with pytest.raises(SourceError, match="mix integers"):
        convert(src, tmp_path / "out.h5")


def test_nothing_usable_and_no_overwrite(tmp_path):
    empty = tmp_path / "blank.txt"
    empty.write_text("\n \n")
    with pytest.raises(SourceError, match="all 2 inputs were skipped"):
        convert(empty, tmp_path / "out.h5")
    src = write_text_file(tmp_path / "reviews.txt", TEXTS)
    convert(src, tmp_path / "out.h5")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(src, tmp_path / "out.h5")
    assert convert(src, tmp_path / "out.h5", overwrite=True).num_samples == len(TEXTS)


def test_bad_csv_rows_are_skipped(tmp_path):
    src = tmp_path / "bad.csv"
    src.write_bytes(b'text,label\n"a fine film",pos\n"caf\xe9",neg\n"short row"\n"",neg\n"a dull film",neg\n')
    report = convert(src, tmp_path / "out.h5")
    assert report.num_samples == 2
    assert report.skipped == [
        ("bad.csv:3", "not valid UTF-8 (undecodable bytes or unpaired surrogates)"),
        ("bad.csv:4", "missing field 'label'"),
        ("bad.csv:5", "no tokens (empty text)"),
    ]
