"""`fastdata verify`: damage written into real converted files is found and located; good files pass."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from support import (
    FORMATS,
    KINDS,
    NUM_CLASSES,
    PER_CLASS,
    column_regions,
    downgrade_to_version1,
    overwrite,
    private_copy,
    run_cli,
)

from fastdata import FormatError, convert_imagefolder, open_dataset
from fastdata.formats import Columns, layout, read_packed
from fastdata.verify import _samples_in, verify

NUM_SAMPLES = NUM_CLASSES * PER_CLASS
DAMAGED_COLUMNS = [(kind, column) for kind in KINDS for column in ("samples", "labels", "offsets")
                   if (kind, column) != ("raw", "offsets")]  # raw images have no offsets


@pytest.fixture
def converted(packed_files, packed_text, fmt, kind):
    """The session's converted file of ``fmt`` holding ``kind`` samples."""
    return converted_file(packed_files, packed_text, fmt, kind)


def converted_file(packed_files, packed_text, fmt, kind):
    return packed_text(fmt) if kind == "text" else packed_files(fmt, kind)


def samples_touched(path, column, start, stop):
    """The samples whose stored bytes ``start:stop`` of ``column`` (bytes within the column) hold."""
    columns, _ = read_packed(path)
    n = columns.num_samples
    if column == "labels":
        return set(range(start // 8, (stop - 1) // 8 + 1))
    if column == "offsets":  # offsets[i] bounds samples i - 1 and i
        entries = range(start // 8, (stop - 1) // 8 + 1)
        return {sample for entry in entries for sample in (entry - 1, entry) if 0 <= sample < n}
    if not columns.ragged:
        row = columns.samples.nbytes // n
        return set(range(start // row, (stop - 1) // row + 1))
    size, offsets = columns.samples.itemsize, np.asarray(columns.offsets)
    return {i for i in range(n) if offsets[i] * size < stop and offsets[i + 1] * size > start}


def damage(path, column, seed, length=64):
    """Write ``length`` seeded random bytes at a random place of ``column``; return the samples they touch."""
    rng = np.random.default_rng(seed)
    offset, nbytes = column_regions(path)[column]
    start = int(rng.integers(0, max(nbytes - length, 0) + 1))
    stop = min(start + length, nbytes)
    touched = samples_touched(path, column, start, stop)
    with open(path, "rb") as f:
        f.seek(offset + start)
        before = f.read(stop - start)
    data = rng.bytes(stop - start)
    assert data != before
    overwrite(path, offset + start, data)
    return touched


# ---------------------------------------------------------------- good files


@pytest.mark.parametrize("quick", [False, True])
def test_undamaged_files_pass(converted, kind, quick):
    report = verify(converted, quick=quick)
    assert report.ok, str(report)
    assert report.format_version == layout.FORMAT_VERSION and not report.notes
    assert "crc32 checksums" in report.checked
    if not quick:
        assert "labels" in report.checked
        assert ("offsets" in report.checked) == (kind != "raw")
    assert str(report).startswith(f"{os.fspath(converted)!r}: ok")


def test_converters_store_a_checksum_per_chunk_of_each_column(converted, kind):
    from fastdata.formats import read_checksums

    columns, metadata = read_packed(converted)
    chunk_bytes = metadata["checksums"]["chunk_bytes"]
    stored = read_checksums(converted)
    assert sorted(stored) == sorted(["samples", "labels"] + (["offsets"] if kind != "raw" else []))
    for name, sums in stored.items():
        array = getattr(columns, name)
        assert sums.dtype == np.uint32 and len(sums) == -(-array.nbytes // chunk_bytes)
        assert np.array_equal(sums, layout.chunk_checksums(array, chunk_bytes))


# ---------------------------------------------------------------- damage


@pytest.mark.parametrize("kind, column", DAMAGED_COLUMNS)
@pytest.mark.parametrize("seed", range(3))
def test_random_damage_is_found_and_located(packed_files, packed_text, fmt, kind, column, seed, tmp_path):
    path = private_copy(converted_file(packed_files, packed_text, fmt, kind), tmp_path)
    touched = damage(path, column, seed)
    for quick in (True, False):
        report = verify(path, quick=quick)
        assert not report.ok, str(report)
        assert touched <= set(report.damaged_samples.tolist()), (touched, str(report))
        assert any(problem.check == "checksum" for problem in report.problems)
        assert "DAMAGED" in str(report) and "fastdata convert" in str(report)


def test_damage_is_located_to_the_samples_of_one_chunk(source_root, tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "CHECKSUM_CHUNK_BYTES", 1024)
    for storage in ("raw", "jpeg"):
        path = tmp_path / f"small-chunks-{storage}.h5"
        convert_imagefolder(source_root, path, size=32, storage=storage, workers=1, progress=False)
        columns, _ = read_packed(path)
        start = 7 * 3 * 32 * 32 + 1000 if storage == "raw" else int(columns.offsets[9]) + 100
        del columns
        overwrite(path, column_regions(path)["samples"][0] + start, b"\x00\xff" * 20)
        report = verify(path, quick=True)
        damaged = report.damaged_samples.tolist()
        assert (damaged == [7]) if storage == "raw" else (9 in damaged and len(damaged) <= 3), str(report)
        assert "sample" in report.problems[0].message


@given(st.lists(st.integers(0, 30), min_size=1, max_size=30), st.sampled_from([1, 2, 4]), st.data())
def test_a_damaged_byte_range_maps_to_every_sample_it_touches(lengths, itemsize, data):
    n, offsets = len(lengths), np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    ragged = Columns(np.zeros(offsets[-1], f"u{itemsize}"), np.zeros(n, np.int64), offsets)
    fixed = Columns(np.zeros((n, 3, itemsize), np.uint8), np.zeros(n, np.int64))
    for name, columns, spans in [
        ("samples", ragged, [(offsets[i] * itemsize, offsets[i + 1] * itemsize) for i in range(n)]),
        ("samples", fixed, [(i * 3 * itemsize, (i + 1) * 3 * itemsize) for i in range(n)]),
        ("labels", ragged, [(8 * i, 8 * i + 8) for i in range(n)]),
        ("offsets", ragged, [(8 * i, 8 * i + 16) for i in range(n)]),  # sample i reads offsets i and i + 1
    ]:
        nbytes = getattr(columns, name).nbytes
        assume(nbytes > 0)
        start = data.draw(st.integers(0, nbytes - 1))
        stop = data.draw(st.integers(start + 1, nbytes))
        touched = {i for i, (lo, hi) in enumerate(spans) if lo < stop and hi > start}
        empty = {i for i, (lo, hi) in enumerate(spans) if lo == hi}
        assert touched <= set(_samples_in(name, start, stop, columns).tolist()) <= touched | empty, name


def test_a_label_outside_the_classes_is_named(packed_files, fmt, tmp_path):
    path = private_copy(packed_files(fmt, "raw"), tmp_path)
    overwrite(path, column_regions(path)["labels"][0] + 5 * 8, np.int64(6772140792788799435).tobytes())
    report = verify(path)
    labels = [problem for problem in report.problems if problem.check == "labels"]
    assert len(labels) == 1 and labels[0].samples.tolist() == [5]
    assert "sample 5" in labels[0].message and "6772140792788799435" in labels[0].message


def test_a_jpeg_that_does_not_decode_is_named(packed_files, fmt, tmp_path):
    path = private_copy(packed_files(fmt, "jpeg"), tmp_path)
    columns, _ = read_packed(path)
    start, stop = (int(x) for x in columns.offsets[5:7])
    del columns
    overwrite(path, column_regions(path)["samples"][0] + start, bytes(stop - start))
    report = verify(path)
    jpeg = [problem for problem in report.problems if problem.check == "jpeg"]
    assert len(jpeg) == 1 and jpeg[0].samples.tolist() == [5] and "sample 5" in jpeg[0].message
    assert "5 JPEGs" not in str(report) and f"{NUM_SAMPLES} JPEGs decode" in report.checked


def test_token_ids_outside_the_vocabulary_are_named(packed_text, fmt, tmp_path):
    path = private_copy(packed_text(fmt), tmp_path)
    columns, metadata = read_packed(path)
    where = int(columns.offsets[3]) * columns.samples.itemsize
    too_big = np.array([np.iinfo(columns.samples.dtype).max], columns.samples.dtype).tobytes()
    del columns
    assert np.iinfo(np.dtype(metadata["sample_dtype"])).max >= metadata["tokenizer"]["vocab_size"]
    overwrite(path, column_regions(path)["samples"][0] + where, too_big)
    report = verify(path)
    tokens = [problem for problem in report.problems if problem.check == "tokens"]
    assert len(tokens) == 1 and tokens[0].samples.tolist() == [3], str(report)


@pytest.mark.parametrize("value", [2**60, -5])
def test_damaged_offsets_are_named_without_allocating(packed_text, fmt, tmp_path, value):
    path = private_copy(packed_text(fmt), tmp_path)
    overwrite(path, column_regions(path)["offsets"][0] + 4 * 8, np.int64(value).tobytes())
    report = verify(path)
    offsets = [problem for problem in report.problems if problem.check == "offsets"]
    assert len(offsets) == 1 and offsets[0].samples.tolist() == [3, 4], str(report)


def test_offsets_that_merge_samples_past_the_longest_are_named(packed_text, fmt, tmp_path):
    # In order and in bounds, but sample i now runs over its neighbour: longer than any stored sample.
    path = private_copy(packed_text(fmt), tmp_path)
    columns, _ = read_packed(path)
    longest = int(np.argmax(np.diff(columns.offsets)))
    longest = longest if longest + 2 < len(columns.offsets) else longest - 1
    end = int(columns.offsets[longest + 2])
    del columns
    overwrite(path, column_regions(path)["offsets"][0] + (longest + 1) * 8, np.int64(end).tobytes())
    report = verify(path)
    offsets = [problem for problem in report.problems if problem.check == "offsets"]
    assert len(offsets) == 1 and longest in offsets[0].samples.tolist(), str(report)
    assert "longer than the longest stored sample" in offsets[0].message
    with pytest.raises(FormatError, match="longer than the longest sample stored"):
        open_dataset(path)


def test_a_truncated_file_is_a_structure_problem(packed_files, fmt, tmp_path):
    path = tmp_path / f"cut{FORMATS[fmt]}"
    data = packed_files(fmt, "jpeg").read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    report = verify(path)
    assert not report.ok and report.problems[0].check == "structure"
    assert os.fspath(path) in report.problems[0].message


def test_version2_files_without_their_checksums_are_damaged(packed_files, tmp_path):
    import h5py

    lost_sums = private_copy(packed_files("hdf5", "raw"), tmp_path, "lost-sums")
    with h5py.File(lost_sums, "r+") as f:
        del f["checksums"]["labels"]
    lost_description = private_copy(packed_files("hdf5", "raw"), tmp_path, "lost-description")
    with h5py.File(lost_description, "r+") as f:
        metadata = json.loads(f.attrs[layout.METADATA_KEY])
        f.attrs[layout.METADATA_KEY] = json.dumps({**metadata, "checksums": None})
    for path, message in [(lost_sums, "column 'labels': 1 chunk but no stored checksums"),
                          (lost_description, "checksum description is missing or damaged: None")]:
        report = verify(path, quick=True)
        assert len(report.problems) == 1 and message in report.problems[0].message, str(report)


def test_a_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.h5"):
        verify(tmp_path / "missing.h5")


# ---------------------------------------------------------------- format version 1


def test_a_version1_file_has_no_checksum_to_check(converted, tmp_path):
    path = downgrade_to_version1(private_copy(converted, tmp_path))
    for quick in (False, True):
        report = verify(path, quick=quick)
        assert report.ok and report.format_version == 1, str(report)
        assert "crc32 checksums" not in report.checked
        assert "format version 1 stores no checksums" in str(report)


def test_a_version1_file_still_checks_labels_against_the_class_counts(packed_files, fmt, tmp_path):
    path = downgrade_to_version1(private_copy(packed_files(fmt, "raw"), tmp_path))
    overwrite(path, column_regions(path)["labels"][0], np.int64(NUM_CLASSES - 1).tobytes())  # sample 0: class 0 -> 3
    report = verify(path)
    assert not report.ok and [problem.check for problem in report.problems] == ["labels"], str(report)
    assert "per class" in report.problems[0].message


# ---------------------------------------------------------------- command line


def test_cli_verify_exits_0_on_a_good_file(packed_files, fmt):
    path = packed_files(fmt, "jpeg")
    for extra in ([], ["--quick"]):
        result = run_cli("verify", path, *extra)
        assert result.exit_code == 0, result.output
        assert f"{os.fspath(path)!r}: ok" in result.output


def test_cli_verify_names_the_damaged_samples_and_exits_1(packed_files, fmt, tmp_path):
    path = private_copy(packed_files(fmt, "raw"), tmp_path)
    overwrite(path, column_regions(path)["labels"][0] + 11 * 8, np.int64(-7).tobytes())
    for extra in ([], ["--quick"]):
        result = run_cli("verify", path, *extra)
        assert result.exit_code == 1, result.output
        assert "DAMAGED" in result.output and "checksum" in result.output
    assert "sample 11" in run_cli("verify", path).output


def test_cli_verify_of_a_missing_file_is_one_error_line(tmp_path):
    result = run_cli("verify", tmp_path / "missing.arrow")
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "missing.arrow" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.integration
def test_verify_never_imports_torch_or_the_loading_layer():
    code = "import json, sys, fastdata.verify; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert not [name for name in loaded if name.split(".")[0] == "torch" or name.startswith("fastdata.loading")]
