"""Text sources: odd CSV, JSON Lines and plain files are converted or reported, never silently lost; labels."""

import csv
import gzip
import json
import lzma

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import stored_sequences

from fastdata import SourceError, Tokenizer, convert_text
from fastdata.converters import tables
from fastdata.converters.textsources import read_source

LABELS = ("neg", "pos")


def convert(src, out, **options):
    return convert_text(src, out, workers=1, progress=False, **options)


def plain_rows(count):
    """Return ``count`` (text, label) rows a CSV writer leaves unquoted: no comma, quote or newline."""
    return [(f"review {i} was {'dull' if i % 2 else 'fine'} overall", LABELS[i % 2]) for i in range(count)]


def write_csv(path, rows, header=("text", "label"), raw=None, delimiter=","):
    """Write ``rows`` with the csv module; ``raw`` maps a row index to a line written as is instead."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        for index, row in enumerate(rows):
            if raw and index in raw:
                f.write(raw[index])
            else:
                writer.writerow(row)
    return path


def assert_stored(path, rows):
    """Assert the file at ``path`` holds ``rows`` ((text, label name or None)) in order; return its metadata."""
    sequences, labels, metadata = stored_sequences(path)
    tokenizer = Tokenizer.from_file(path)
    assert len(sequences) == len(rows)
    for sequence, (text, _) in zip(sequences, rows):
        np.testing.assert_array_equal(sequence, tokenizer.encode(text))
    assert [metadata["classes"][label] if label >= 0 else None for label in labels] == [lab for _, lab in rows]
    return metadata


# ----- unmatched quotes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, delimiter", [("q.csv", ","), ("q.tsv", "\t")])
def test_unmatched_quote_is_reported_and_the_rows_it_swallowed_are_kept(tmp_path, name, delimiter):
    rows = plain_rows(1000)
    raw = {8: f'"{rows[8][0]}{delimiter}{rows[8][1]}\r\n'}  # line 10 opens a quote it never closes
    rows[498] = (f'she said "{rows[498][0]}"', rows[498][1])  # line 500 is quoted: its quote closes line 10's
    report = convert(write_csv(tmp_path / name, rows, raw=raw, delimiter=delimiter), tmp_path / "q.h5")
    assert report.skipped == [(f"{name}:10", "unmatched quote starting at line 10 (closed on line 500); "
                                             "lines 11-500 read as rows instead")]
    assert_stored(report.path, rows[:8] + rows[9:])


def test_unmatched_quote_closed_on_the_next_line(tmp_path):
    rows = plain_rows(20)
    rows[9] = ('a 5" screen', "neg")  # a quote inside an unquoted text (the csv module keeps it)
    src = write_csv(tmp_path / "q.csv", rows, raw={8: '"an opening quote,pos\n', 9: 'a 5" screen,neg\n'})
    report = convert(src, tmp_path / "q.h5")
    assert report.skipped == [("q.csv:10", "unmatched quote starting at line 10 (closed on line 11); "
                                           "line 11 read as a row instead")]
    assert_stored(report.path, rows[:8] + rows[9:])


def test_unmatched_quote_open_at_the_end_of_the_file(tmp_path):
    rows = plain_rows(50)
    src = write_csv(tmp_path / "q.csv", rows, raw={40: '"an opening quote, never closed,neg\n'})
    report = convert(src, tmp_path / "q.h5")
    assert report.skipped == [("q.csv:42", "unmatched quote starting at line 42 (still open at the end of the "
                                           "file); lines 43-51 read as rows instead")]
    assert_stored(report.path, rows[:40] + rows[41:])


def test_unmatched_quote_in_the_header_is_a_source_error(tmp_path):
    src = tmp_path / "q.csv"
    src.write_text('"text,label\nfine,pos\n', encoding="utf-8")
    with pytest.raises(SourceError, match="header row is not readable: unmatched quote starting at line 1"):
        convert(src, tmp_path / "q.h5")


def test_texts_spanning_lines_that_look_like_rows_are_kept_whole(tmp_path):
    rows = plain_rows(20)
    rows[5] = ("a quoted text\nwith lines,pos\nthat read,neg\nlike rows", "neg")  # valid CSV: kept whole
    rows[9] = ("first paragraph\n\nsecond, with a comma", "pos")
    report = convert(write_csv(tmp_path / "m.csv", rows), tmp_path / "m.h5")
    assert report.num_samples == 20 and report.skipped == []
    inputs = read_source(str(tmp_path / "m.csv"), "csv", "text", "label", False)
    assert inputs.payloads == [text for text, _ in rows] and inputs.labels == [label for _, label in rows]


# ----- large fields --------------------------------------------------------------------------------------


def test_field_over_128_kib_is_read(tmp_path):
    rows = plain_rows(20)
    rows[10] = ("a long text\n" * 30_000, "pos")  # 360 KB, 30,000 lines
    report = convert(write_csv(tmp_path / "big.csv", rows), tmp_path / "big.h5")
    metadata = assert_stored(report.path, rows)
    assert report.skipped == [] and metadata["lengths"]["max"] == 90_000
    assert csv.field_size_limit() == 131072  # the module's limit is restored


def test_field_still_too_large_is_skipped_naming_its_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "_MAX_FIELD", 150_000)  # instead of writing a 2 GiB field
    rows = plain_rows(20)
    rows[10] = ("a long text\n" * 20_000, "pos")
    report = convert(write_csv(tmp_path / "big.csv", rows), tmp_path / "big.h5")
    assert report.skipped == [("big.csv:12", "not readable as CSV: field larger than field limit (150000) "
                                             "(lines 12-20012)")]
    assert_stored(report.path, rows[:10] + rows[11:])


# ----- labels ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values, stored, classes", [
    ([1, 3, 5, 3], [1, 3, 5, 3], ["0", "1", "2", "3", "4", "5"]),  # small indices: kept
    ([99999999999, 7, 99999999999], [1, 0, 1], ["7", "99999999999"]),  # ids: numbered
    ([2**70, 1, 2**64], [2, 0, 1], ["1", str(2**64), str(2**70)]),  # beyond int64
    ([-1, 1, 1, -1], [0, 1, 1, 0], ["-1", "1"]),  # negative
    ([True, False, True], [1, 0, 1], ["false", "true"]),
    ([1.0, 0.0, 2.0], [1, 0, 2], ["0", "1", "2"]),  # integral floats are integers
    (list(range(0, 6000, 3)), list(range(2000)), [str(i) for i in range(0, 6000, 3)]),  # sparse: numbered
    (list(range(1999, -1, -1)), list(range(1999, -1, -1)), [str(i) for i in range(2000)]),  # dense: kept
])
def test_jsonl_labels(tmp_path, values, stored, classes):
    src = tmp_path / "l.jsonl"
    src.write_text("".join(json.dumps({"text": f"text {i}", "label": v}) + "\n" for i, v in enumerate(values)))
    _, labels, metadata = stored_sequences(convert(src, tmp_path / "l.h5").path)
    assert labels.tolist() == stored and metadata["classes"] == classes
    assert [metadata["classes"][label] for label in labels] == [json.dumps(v).replace(".0", "") for v in values]


@pytest.mark.parametrize("values, stored, classes", [
    (["-1", "1", "10", "9"], [0, 1, 3, 2], ["-1", "1", "9", "10"]),  # integers sort as numbers
    (["2", "0", "007"], [2, 0, 1], ["0", "007", "2"]),  # "007" is no integer: all strings
])
def test_csv_labels(tmp_path, values, stored, classes):
    src = write_csv(tmp_path / "l.csv", [(f"text {i}", v) for i, v in enumerate(values)])
    _, labels, metadata = stored_sequences(convert(src, tmp_path / "l.h5").path)
    assert labels.tolist() == stored and metadata["classes"] == classes


@pytest.mark.parametrize("values, error", [
    ([1, True], "mix integers .*l.jsonl:1: 1.* and booleans .*l.jsonl:2: true"),
    (["pos", 0], "mix strings .* and integers"),
])
def test_mixed_label_kinds_are_a_source_error(tmp_path, values, error):
    src = tmp_path / "l.jsonl"
    src.write_text("".join(json.dumps({"text": "a text", "label": v}) + "\n" for v in values))
    with pytest.raises(SourceError, match=error):
        convert(src, tmp_path / "l.h5")


def test_non_integral_labels_are_skipped(tmp_path):
    src = tmp_path / "l.jsonl"
    src.write_text("".join(json.dumps({"text": "a text", "label": v}) + "\n" for v in [1, 1.5, [1], 0]))
    report = convert(src, tmp_path / "l.h5")
    assert report.num_samples == 2 and [name for name, _ in report.skipped] == ["l.jsonl:2", "l.jsonl:3"]
    assert all("labels should be integers, booleans or strings" in reason for _, reason in report.skipped)


# ----- odd files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("name", ["t.csv", "t.tsv", "t.jsonl", "t.txt"])
def test_line_endings_and_byte_order_mark(tmp_path, name, newline):
    rows = plain_rows(6)
    lines = {"t.csv": ["text,label"] + [f"{t},{lab}" for t, lab in rows],
             "t.tsv": ["text\tlabel"] + [f"{t}\t{lab}" for t, lab in rows],
             "t.jsonl": [json.dumps({"text": t, "label": lab}) for t, lab in rows],
             "t.txt": [t for t, _ in rows]}[name]
    src = tmp_path / name
    src.write_bytes(b"\xef\xbb\xbf" + newline.join(lines).encode() + newline.encode())
    assert_stored(convert(src, tmp_path / "t.h5").path, [(t, lab if name != "t.txt" else None) for t, lab in rows])


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
@pytest.mark.parametrize("name", ["t.csv", "t.jsonl", "t.txt"])
def test_utf16_and_utf32_files_are_a_source_error(tmp_path, name, encoding):
    src = tmp_path / name
    src.write_bytes('text,label\n"a text",pos\n'.encode(encoding))
    with pytest.raises(SourceError, match=f"is {encoding.upper()} text.*save it as UTF-8"):
        convert(src, tmp_path / "t.h5")


@pytest.mark.parametrize("name, data, error", [
    ("b.txt", 'text,label\n"a text",pos\n'.encode("utf-16-le"), "24 of its first 48 bytes are NUL"),  # no BOM
    ("b.csv", b"\x89HDF\r\n\x1a\n" + bytes(100) + b"text,label\n", "is an HDF5 file, not text"),
    ("b.csv", b"text,label\n" + bytes(100) + b"a,pos\n", "100 of its first 117 bytes are NUL"),
    ("e.csv", b"", "is empty"),
    ("e.csv", b"\n\n", "is empty"),
    ("e.csv", b"text,label\n", "holds no samples"),
    ("e.jsonl", b"", "holds no samples"),
    ("e.txt", b"", "holds no samples"),
    ("e.csv", b"text,text,label\na,b,pos\n", "2 columns named 'text'"),
])
def test_empty_binary_files_and_ambiguous_headers(tmp_path, name, data, error):
    src = tmp_path / name
    src.write_bytes(data)
    with pytest.raises(SourceError, match=error):
        convert(src, tmp_path / "e.h5")


def reviews_table(count=40):
    """Return a pyarrow table of ``count`` reviews: a text and a label column, as a user's Parquet file holds."""
    import pyarrow as pa

    rows = plain_rows(count)
    return pa.table({"text": [text for text, _ in rows], "label": [label for _, label in rows]})


def write_parquet(path):
    import pyarrow.parquet as pq

    pq.write_table(reviews_table(), path)


def write_arrow_file(path):
    import pyarrow as pa

    table = reviews_table()
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)


def write_compressed(opener):
    def write(path):
        with opener(path, "wt", encoding="utf-8") as f:
            f.writelines(f"{text},{label}\n" for text, label in plain_rows(400))
    return write


def write_zstd(path):
    import pyarrow as pa

    with pa.CompressedOutputStream(str(path), "zstd") as f:
        f.write("".join(f"{text},{label}\n" for text, label in plain_rows(400)).encode())


def write_zip(path):
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("reviews.csv", "".join(f"{text},{label}\n" for text, label in plain_rows(40)))


def write_tar(path):
    import io
    import tarfile

    data = "".join(f"{text},{label}\n" for text, label in plain_rows(40)).encode()
    with tarfile.open(path, "w") as archive:
        member = tarfile.TarInfo("reviews.csv")
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))


def write_image(image_format):
    def write(path):
        from PIL import Image

        pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path, format=image_format)
    return write


def write_packed_text(path):
    import shutil

    source = write_csv(path.parent / "plain.csv", plain_rows(8))
    packed = convert(source, path.parent / "packed.h5").path
    shutil.copyfile(packed, path)


def write_noise(path):
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("name, write, error", [
    ("reviews.txt", write_parquet, "is a Parquet file, not text.*--source-format parquet"),  # its bytes decide
    ("reviews.arrow", write_arrow_file, "is an Arrow IPC file, not text"),
    ("reviews.csv.gz", write_compressed(gzip.open), "is gzip-compressed.*decompress it first"),
    ("reviews.csv", write_compressed(lzma.open), "is xz-compressed"),
    ("reviews.csv.zst", write_zstd, "is zstd-compressed"),
    ("reviews.zip", write_zip, "is a zip archive"),
    ("reviews.tar", write_tar, "is a tar archive"),
    ("photo.jpg", write_image("JPEG"), "is a JPEG image.*convert imagefolder"),
    ("photo.txt", write_image("PNG"), "is a PNG image"),
    ("train.jsonl", write_packed_text, "is an HDF5 file.*fastdata info"),
    ("noise.txt", write_noise, "is not text: .* bytes that are not UTF-8"),
])
def test_a_binary_file_is_refused_whole_never_read_as_lines(tmp_path, name, write, error):
    # see NOTE [binary] in textsources.py: a Parquet file once became 131 samples of garbage, exit 0
    src = tmp_path / name
    write(src)
    with pytest.raises(SourceError, match=error) as refused:
        convert(src, tmp_path / "out.h5")
    assert repr(str(src)) in str(refused.value)
    assert not (tmp_path / "out.h5").exists()


def test_a_parquet_file_converts_as_its_csv_does(tmp_path):
    import pyarrow.parquet as pq

    table = reviews_table(40)
    pq.write_table(table, tmp_path / "reviews.parquet", row_group_size=7)  # rows over several row groups
    from_parquet = convert(tmp_path / "reviews.parquet", tmp_path / "p.h5", tokenizer="bytes")
    from_csv = convert(write_csv(tmp_path / "reviews.csv", plain_rows(40)), tmp_path / "c.h5", tokenizer="bytes")
    assert from_parquet.num_samples == 40 and from_parquet.skipped == []
    parquet_tokens, parquet_labels, metadata = stored_sequences(from_parquet.path)
    csv_tokens, csv_labels, csv_metadata = stored_sequences(from_csv.path)
    assert [list(t) for t in parquet_tokens] == [list(t) for t in csv_tokens]
    assert np.array_equal(parquet_labels, csv_labels) and metadata["classes"] == csv_metadata["classes"]
    assert metadata["source"]["format"] == "parquet" and metadata["source"]["text_field"] == "text"


def test_parquet_rows_that_cannot_be_used_are_reported_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"review": ["a fine film", None, "", "a dull film", "very good"],
                      "stars": [5, 1, 3, None, 4.0], "id": [1, 2, 3, 4, 5]})
    pq.write_table(table, tmp_path / "r.parquet")
    report = convert(tmp_path / "r.parquet", tmp_path / "r.h5", tokenizer="bytes", text_field="review",
                     label_field="stars")
    assert report.num_samples == 2
    assert [name for name, _ in report.skipped] == ["r.parquet[1]", "r.parquet[2]", "r.parquet[3]"]
    assert "field 'review' is null, expected a string" in report.skipped[0][1]
    _, labels, metadata = stored_sequences(report.path)
    assert [metadata["classes"][label] for label in labels] == ["5", "4"]
    unlabeled = convert(tmp_path / "r.parquet", tmp_path / "u.h5", tokenizer="bytes", text_field="review",
                        label_field=None)
    assert (stored_sequences(unlabeled.path)[1] == -1).all()


def test_a_parquet_file_without_the_columns_names_the_ones_it_has(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"], "stars": [1]}), tmp_path / "r.parquet")
    with pytest.raises(SourceError, match=r"has no column 'text' or 'label'; its columns are \['body', 'stars'\]"):
        convert(tmp_path / "r.parquet", tmp_path / "r.h5")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(SourceError, match="broken.parquet' is not a Parquet file pyarrow reads"):
        convert(tmp_path / "broken.parquet", tmp_path / "b.h5")


def test_text_in_a_legacy_encoding_converts_and_reports_its_lines_that_are_not_utf8(tmp_path):
    rows = plain_rows(40)
    rows[3] = ("un film déjà vu", "neg")
    rows[17] = ("très réussi", "pos")  # 2 of 40 lines hold Latin-1 accents: a few bytes of the file, not text lost
    src = tmp_path / "latin1.csv"
    src.write_bytes(b"text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows).encode("latin-1"))
    report = convert(src, tmp_path / "t.h5", tokenizer="bytes")
    assert report.num_samples == 38
    assert [name for name, _ in report.skipped] == ["latin1.csv:5", "latin1.csv:19"]
    assert all("not valid UTF-8" in reason for _, reason in report.skipped)


def test_odd_csv_rows_are_converted_or_reported(tmp_path):
    src = tmp_path / "odd.csv"
    src.write_bytes(b"text,label\n"
                    b"nul \x00 inside,pos\n"          # 2: kept
                    b"\n"                             # 3: a blank line is no sample
                    b"a fine, film,pos\n"             # 4: unquoted comma: 3 fields
                    b"trailing empty field,neg,\n"    # 5: kept
                    b"bad \xff byte,neg\n"            # 6: reported
                    b'"",pos\n'                      # 7: no tokens
                    b"a dull film,neg\n")             # 8: kept
    report = convert(src, tmp_path / "odd.h5", tokenizer="bytes")
    assert report.num_samples == 3
    assert report.skipped == [
        ("odd.csv:4", "3 fields where the header has 2 (a delimiter in an unquoted text? quote the text)"),
        ("odd.csv:6", "not valid UTF-8 (undecodable bytes or unpaired surrogates)"),
        ("odd.csv:7", "no tokens (empty text)"),
    ]
    sequences, _, _ = stored_sequences(report.path)
    assert bytes(sequences[0].astype(np.uint8)) == b"nul \x00 inside"


def test_odd_jsonl_lines_are_converted_or_reported(tmp_path):
    src = tmp_path / "odd.jsonl"
    long_text = "word " * 2_000_000  # a 10 MB line
    src.write_bytes(json.dumps({"text": "nul \u0000 escaped", "label": "pos"}).encode() + b"\n"
                    + b'{"text": "raw nul \x00", "label": "pos"}\n'
                    + json.dumps({"text": long_text, "label": "neg"}).encode() + b"\n"
                    + b'{"text": "bad \xff byte", "label": "neg"}\n')
    report = convert(src, tmp_path / "odd.h5", tokenizer="bytes")
    assert [name for name, _ in report.skipped] == ["odd.jsonl:2", "odd.jsonl:4"]
    assert "invalid JSON: Invalid control character" in report.skipped[0][1]
    assert "not valid UTF-8" in report.skipped[1][1]
    sequences, _, _ = stored_sequences(report.path)
    assert [len(s) for s in sequences] == [len("nul \x00 escaped"), len(long_text)]


# ----- round trip --------------------------------------------------------------------------------------------

# No NUL: a small file whose bytes are a tenth NUL is refused as UTF-16/32 (_check_encoding), rightly;
# a stray NUL in a field is read back by test_odd_jsonl_lines_are_converted_or_reported above.
_CHARACTERS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
texts = st.text(_CHARACTERS, max_size=40)
labels = st.text(_CHARACTERS, min_size=1, max_size=5).filter(str.strip)
records = st.lists(st.tuples(texts, labels), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=records, delimiter=st.sampled_from([",", "\t"]))
def test_csv_round_trip(tmp_path, records, delimiter):
    path = tmp_path / "r.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(["text", "label"])
        writer.writerows(records)
    inputs = read_source(str(path), "csv" if delimiter == "," else "tsv", "text", "label", False)
    assert inputs.reasons == {}
    assert inputs.payloads == [text for text, _ in records] and inputs.labels == [lab for _, lab in records]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=records, ensure_ascii=st.booleans())
def test_jsonl_round_trip(tmp_path, records, ensure_ascii):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": lab}, ensure_ascii=ensure_ascii) + "\n"
                            for t, lab in records), encoding="utf-8")
    inputs = read_source(str(path), "jsonl", "text", "label", False)
    assert inputs.reasons == {}
    assert inputs.payloads == [text for text, _ in records] and inputs.labels == [lab for _, lab in records]


def test_json_array_file(tmp_path):
    rows = plain_rows(5)
    records = [{"text": t, "label": lab} for t, lab in rows] + [["not", "an", "object"]]
    src = tmp_path / "a.json"
    src.write_text(json.dumps(records, indent=2), encoding="utf-8")
    report = convert(src, tmp_path / "a.h5")
    assert report.skipped == [("a.json[5]", "expected a JSON object, got list")]
    assert_stored(report.path, rows)
    src.write_text(json.dumps(records, indent=2)[:-20], encoding="utf-8")
    with pytest.raises(SourceError, match=r"'.*a.json' is not a valid JSON array: .*line \d+ column \d+.*\.jsonl"):
        convert(src, tmp_path / "b.h5")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.one_of(st.integers(min_value=-2**80, max_value=2**80), st.integers(0, 3000)),
                       min_size=1, max_size=30))
def test_integer_labels_name_their_class(tmp_path, values):
    src = tmp_path / "l.jsonl"
    src.write_text("".join(json.dumps({"text": "a text", "label": v}) + "\n" for v in values))
    _, labels, metadata = stored_sequences(convert(src, tmp_path / "l.h5", overwrite=True).path)
    assert [metadata["classes"][label] for label in labels] == [str(v) for v in values]
    assert len(metadata["classes"]) <= max(len(set(values)), 1024, 2 * len(set(values)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# NUL is left out: a file of more than 1 NUL byte in 10 is refused as not UTF-8 (_check_encoding).
@given(lines=st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x00"),
                              min_size=1).filter(lambda t: t.strip() and not t.startswith("\ufeff")),
                      min_size=1, max_size=12))
def test_lines_round_trip(tmp_path, lines):
    path = tmp_path / "r.txt"
    path.write_bytes("\n".join(lines).encode() + b"\n")
    inputs = read_source(str(path), "lines", "text", "label", False)
    assert inputs.reasons == {} and inputs.payloads == lines


def test_a_hugging_face_dataset_folder_converts_with_its_class_label(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = plain_rows(30)
    names = ["bad", "good", "never used"]
    labels = [i % 2 for i in range(30)]
    labels[4] = -1  # no label
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names),
                                  "id": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict({"text": [text for text, _ in rows], "label": labels, "id": list(range(30))},
                                         features=features)
    dataset.save_to_disk(str(tmp_path / "hf"))
    report = convert(tmp_path / "hf", tmp_path / "hf.h5", tokenizer="bytes")
    assert report.num_samples == 30 and report.skipped == []
    tokens, stored_labels, metadata = stored_sequences(report.path)
    assert [bytes(t.tolist()).decode() for t in tokens] == [text for text, _ in rows]
    assert stored_labels.tolist() == labels and metadata["classes"] == names  # the ClassLabel's indices and names
    assert metadata["source"]["format"] == "hf"
    with pytest.raises(SourceError, match=r"has no column 'review'; its columns are \['text', 'label', 'id'\]"):
        convert(tmp_path / "hf", tmp_path / "x.h5", text_field="review")
