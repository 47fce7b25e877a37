"""`fastdata info` and `fastdata verify` on shard folders: shards listed, damaged or missing shards named."""

import json
import os
import shutil

import numpy as np
import pytest
from support import column_regions, overwrite, run_cli

from fastdata.formats.shards import INDEX_NAME, file_checksum, read_index
from fastdata.info import describe
from fastdata.verify import verify

# ---------------------------------------------------------------- verify


@pytest.fixture(params=["converted", "split"])
def folders(request, shard_converted, shard_folders):
    """``get(fmt, storage) -> folder``: the converter's shard folders, or single files split into odd shards."""
    return shard_converted if request.param == "converted" else shard_folders


@pytest.mark.parametrize("quick", [False, True])
def test_an_undamaged_folder_passes(folders, fmt, kind, quick):
    root = folders(fmt, kind)
    report = verify(root, quick=quick)
    assert report.ok, str(report)
    assert report.num_samples == 24 and report.format_version == 2
    num_shards = read_index(root).num_shards
    assert report.checked[:2] == [INDEX_NAME, f"{num_shards} shard sizes"] and "crc32 checksums" in report.checked
    assert ("whole-file crc32" in report.checked) != quick and ("labels" in report.checked) != quick
    if kind == "jpeg" and not quick:
        assert "24 JPEGs decode" in report.checked  # counted over every shard, 1-sample shards included
    result = run_cli("verify", root, *(["--quick"] if quick else []))
    assert result.exit_code == 0 and result.output.strip() == str(report)


def test_a_missing_shard_is_named_with_its_samples(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "raw"))
    os.remove(root / read_index(root).names[3])  # samples 7-13
    for quick in (False, True):
        report = verify(root, quick=quick)
        assert [problem.check for problem in report.problems] == ["shard"], str(report)
        assert "'shard-00003" in report.problems[0].message and "is missing (samples 7-13)" in str(report)
        assert report.damaged_samples.tolist() == list(range(7, 14))
    result = run_cli("verify", root)
    assert result.exit_code == 1 and "DAMAGED" in result.output and "shard-00003" in result.output


def test_a_shard_of_the_wrong_size_is_named(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "jpeg"))
    name = read_index(root).names[1]
    with open(root / name, "ab") as f:
        f.write(b"junk")
    report = verify(root, quick=True)
    assert not report.ok and f"{name!r} has " in report.problems[0].message
    assert "the index says" in report.problems[0].message and report.damaged_samples.tolist() == [1, 2, 3, 4, 5]


def test_a_flipped_byte_is_located_in_its_shard_and_the_dataset(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "raw"))
    index = read_index(root)
    path = root / index.names[6]  # samples 18-23
    start, nbytes = column_regions(path)["samples"]
    row = nbytes // 6
    data = path.read_bytes()
    overwrite(path, start + 2 * row + 5, bytes([data[start + 2 * row + 5] ^ 0xFF]))  # in its sample 2
    full, quick = verify(root), verify(root, quick=True)
    assert [p.check for p in full.problems] == ["checksum", "checksum"], str(full)
    assert "crc32" in full.problems[0].message and index.checksums[6] in full.problems[0].message
    assert [p.check for p in quick.problems] == ["checksum"], str(quick)  # no whole-file crc32 with --quick
    # one checksum chunk holds the whole shard: its samples 0-5
    assert "'shard-00006" in str(quick) and "samples 0-5 (dataset samples 18-23)" in str(quick)
    assert full.damaged_samples.tolist() == quick.damaged_samples.tolist() == list(range(18, 24))


def test_a_damaged_jpeg_in_a_shard_is_named(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "jpeg"))
    path = root / read_index(root).names[3]  # samples 7-13
    overwrite(path, column_regions(path)["samples"][0], b"\0" * 64)  # its sample 0's header
    report = verify(root)
    jpeg = [problem for problem in report.problems if problem.check == "jpeg"]
    assert len(jpeg) == 1 and jpeg[0].samples.tolist() == [7], str(report)
    assert "'shard-00003" in jpeg[0].message and "(dataset sample 7)" in jpeg[0].message


def test_a_shard_of_another_conversion_is_named(shard_folders, shard_copy, fmt):
    # Its size and crc32 in the index made to match, as a broken "fastdata index" over mixed shards would.
    root = shard_copy(shard_folders(fmt, "raw"))
    other = read_index(shard_folders(fmt, "jpeg")).path(2)  # 1 jpeg sample, in place of raw sample 6
    with open(root / INDEX_NAME) as f:
        index = json.load(f)
    index["shards"][2].update(bytes=os.path.getsize(other), crc32=file_checksum(other))
    with open(root / INDEX_NAME, "w") as f:
        json.dump(index, f)
    shutil.copyfile(other, root / index["shards"][2]["name"])
    for quick in (False, True):
        report = verify(root, quick=quick)
        assert [problem.check for problem in report.problems] == ["shard"], str(report)
        assert "'shard-00002" in str(report) and "differs from the dataset in storage" in str(report)
        assert report.damaged_samples.tolist() == [6]


def test_labels_that_disagree_with_the_index_class_counts(shard_folders, shard_copy, fmt):
    root = shard_copy(shard_folders(fmt, "raw"))
    with open(root / INDEX_NAME) as f:
        index = json.load(f)
    index["metadata"]["class_counts"] = [7, 5, 6, 6]
    with open(root / INDEX_NAME, "w") as f:
        json.dump(index, f)
    report = verify(root)
    assert [problem.check for problem in report.problems] == ["labels"], str(report)
    assert "[6, 6, 6, 6] per class, the index [7, 5, 6, 6]" in report.problems[0].message
    assert verify(root, quick=True).ok  # quick mode reads no labels


def test_a_folder_without_index_or_with_a_damaged_one_is_damaged(shard_folders, shard_copy):
    root = shard_copy(shard_folders("hdf5", "raw"))
    (root / INDEX_NAME).write_text("{not json")
    report = verify(root)
    assert [problem.check for problem in report.problems] == ["index"] and "not valid JSON" in str(report)
    os.remove(root / INDEX_NAME)
    result = run_cli("verify", root)
    assert result.exit_code == 1 and f"has no {INDEX_NAME}" in result.output


def test_files_the_index_does_not_list_are_noted(shard_folders, shard_copy):
    root = shard_copy(shard_folders("arrow", "text"))
    (root / "shard-00099.arrow").write_bytes(b"left by another run")
    report = verify(root)
    assert report.ok and "1 files not in the index, not read: 'shard-00099.arrow'" in str(report)


# ---------------------------------------------------------------- info


def test_info_shows_the_dataset_and_its_shards(folders, shard_single, fmt, kind):
    root = folders(fmt, kind)
    text = describe(root)
    counts = np.diff(read_index(root).starts)
    assert f"folder:      {os.fspath(root)!r} ({fmt} shards)" in text
    assert f"in {len(counts)} shards" in text and f"{counts.min()} to {counts.max()} samples each" in text
    single = describe(shard_single(fmt, kind)).splitlines()
    assert text.splitlines()[2:] == single[2:]  # the dataset lines are the single file's
    result = run_cli("info", root)
    assert result.exit_code == 0 and result.output.strip() == text


def test_info_names_missing_and_resized_shards(shard_folders, shard_copy):
    root = shard_copy(shard_folders("hdf5", "raw"))
    names = read_index(root).names
    os.remove(root / names[0])
    with open(root / names[4], "ab") as f:
        f.write(b"junk")
    text = describe(root)
    assert f"damaged:     2 shards missing or not the size the index says: {names[0]!r}, {names[4]!r}" in text
    assert f'fastdata verify {os.fspath(root)}' in text


def test_info_on_a_folder_without_index_is_one_error_line(tmp_path):
    result = run_cli("info", tmp_path)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and f"has no {INDEX_NAME}" in lines[0]



@pytest.mark.parametrize("column", ["labels", "lengths"])
def test_a_column_file_damaged_missing_or_not_the_shards_is_named(shard_converted, shard_copy, fmt, column):
    from fastdata.formats.shards import write_column

    reference = shard_converted(fmt, "text" if column == "lengths" else "raw")
    name = f"{column}.npy"
    assert read_index(reference).columns[column]["name"] == name, "the converter lists its column file"
    folder = shard_copy(reference)
    intact = (folder / name).read_bytes()
    overwrite(folder / name, len(intact) - 1, b"\x7f")  # the last value's high byte: same size, another crc32
    report = verify(folder)
    assert [p.check for p in report.problems] == ["columns"] and "damaged" in report.problems[0].message
    assert name in report.problems[0].message

    (folder / name).write_bytes(intact)
    values = np.load(folder / name)
    values[[3, 17]] += 1  # a well-formed file that is not the shards' column
    index = json.loads((folder / INDEX_NAME).read_text())
    index["columns"][column] = write_column(folder, column, values)
    (folder / INDEX_NAME).write_text(json.dumps(index))
    report = verify(folder)
    assert [p.check for p in report.problems] == ["columns"] and report.problems[0].samples.tolist() == [3, 17]
    assert verify(folder, quick=True).ok, "quick: the file's own crc32 only"

    os.unlink(folder / name)
    report = verify(folder)
    assert [p.check for p in report.problems] == ["columns"] and "missing" in report.problems[0].message
