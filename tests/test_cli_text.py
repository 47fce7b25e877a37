"""`fastdata convert text` and `fastdata info` on text files."""

import os

from support import run_cli as run
from support import stored_sequences

from fastdata import Tokenizer
from fastdata.measure.synthetic import make_reviews, write_text_file


def test_convert_folder_then_info(text_corpus, tmp_path):
    out = tmp_path / "train.h5"
    result = run("convert", "text", text_corpus / "train", out, "--max-length", 50, "--min-freq", 2,
                 "--unsup", "--workers", 1, "--quiet")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "doc/s" in result.output
    info = run("info", out)
    assert info.exit_code == 0, info.output
    assert "kind:        text" in info.output and "tokenizer:   words" in info.output
    assert "max_length=50" in info.output and "unlabeled:   4" in info.output
    assert Tokenizer.from_file(out).max_length == 50


def test_convert_csv_without_labels_with_bytes(tmp_path):
    texts, labels = make_reviews(6)
    src = write_text_file(tmp_path / "reviews.csv", texts, labels)
    out = tmp_path / "reviews.arrow"
    result = run("convert", "text", src, out, "--tokenizer", "bytes", "--no-labels", "--quiet")
    assert result.exit_code == 0, result.output
    _, stored_labels, metadata = stored_sequences(out)
    assert (stored_labels == -1).all() and metadata["tokenizer"]["kind"] == "bytes"


def test_errors_are_one_line_and_status_1(tmp_path):
    texts, _ = make_reviews(4)
    src = write_text_file(tmp_path / "reviews.txt", texts)
    out = tmp_path / "out.h5"
    assert run("convert", "text", src, out, "--quiet").exit_code == 0
    again = run("convert", "text", src, out, "--quiet")
    assert again.exit_code == 1 and "--overwrite" in again.output
    bad = run("convert", "text", src, tmp_path / "x.h5", "--tokenizer", "bytes", "--min-freq", 2)
    assert bad.exit_code == 1 and "'words' tokenizer" in bad.output
    assert not os.path.exists(tmp_path / "x.h5")


def test_a_parquet_file_converts_and_one_named_as_text_is_one_error_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, labels = make_reviews(30)
    src = tmp_path / "reviews.parquet"
    pq.write_table(pa.table({"text": texts, "label": labels}), src)
    result = run("convert", "text", src, tmp_path / "out.h5", "--tokenizer", "bytes", "--quiet")
    assert result.exit_code == 0, result.output
    assert stored_sequences(tmp_path / "out.h5")[2]["source"]["format"] == "parquet"
    os.rename(src, tmp_path / "reviews.txt")
    refused = run("convert", "text", tmp_path / "reviews.txt", tmp_path / "t.h5", "--quiet")
    assert refused.exit_code == 1 and "is a Parquet file, not text" in refused.output, refused.output
    assert "--source-format parquet" in refused.output and len(refused.output.strip().splitlines()) == 1
    again = run("convert", "text", tmp_path / "reviews.txt", tmp_path / "t.h5", "--source-format", "parquet",
                "--tokenizer", "bytes", "--quiet")
    assert again.exit_code == 0, again.output
