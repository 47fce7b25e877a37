"""convert_text into a shard folder: the single file's columns, cut by size, and the folder appears whole."""

import errno
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import FORMATS, folder_listing, one_error_line, run_cli

from fastdata import convert_text, open_dataset
from fastdata.errors import FastdataError, NotFoundError, OptionError, OutputExistsError
from fastdata.formats import read_packed
from fastdata.formats.shards import INDEX_NAME, file_checksum, read_index, shard_name
from fastdata.measure.synthetic import make_reviews, write_text_file

SAMPLE_BYTES = 16  # an int64 label and an int64 offset besides the ids
PER_SAMPLE_KEYS = {"kind", "storage", "sample_shape", "sample_dtype", "classes", "tokenizer", "preprocessing"}
FILE_KEYS = {"format", "format_version", "checksums"}  # what the writer adds to the metadata of every file


def convert(src, out, **kwargs):
    return convert_text(src, out, workers=kwargs.pop("workers", 1), progress=False, **kwargs)


def columns_of(path):
    """Return ``(ids, labels, offsets, metadata)`` of a packed file, as plain arrays."""
    columns, metadata = read_packed(path)
    return np.array(columns.samples), np.array(columns.labels), np.array(columns.offsets), metadata


def shards_of(root):
    """Return ``(index, [(ids, labels, offsets, metadata) per shard])`` of a shard folder."""
    index = read_index(root)
    return index, [columns_of(index.path(k)) for k in range(index.num_shards)]


def assert_same_samples(root, single):
    """The shards, concatenated in order, hold the single file's ids, labels and offsets."""
    ids, labels, offsets, metadata = columns_of(single)
    index, shards = shards_of(root)
    assert np.array_equal(np.concatenate([s[0] for s in shards]), ids)
    assert np.array_equal(np.concatenate([s[1] for s in shards]), labels)
    starts = np.cumsum([0] + [len(s[0]) for s in shards[:-1]])
    assert np.array_equal(np.concatenate([[0]] + [s[2][1:] + start for s, start in zip(shards, starts)]), offsets)
    assert index.starts.tolist() == np.cumsum([0] + [len(s[1]) for s in shards]).tolist()
    return index, shards, metadata


def stored_bytes(shard):
    ids, labels, _, _ = shard
    return ids.nbytes + SAMPLE_BYTES * len(labels)


@pytest.mark.parametrize("container", list(FORMATS))
def test_shards_hold_the_single_files_samples_and_the_index_its_metadata(textshard_source, tmp_path, container):
    single = convert(textshard_source, tmp_path / f"one{FORMATS[container]}", max_length=60)
    report = convert(textshard_source, tmp_path / "shards", max_length=60, format=container, shard_size=1500)
    assert report.path == os.fspath(tmp_path / "shards") and report.num_samples == 37 and len(report.skipped) == 3
    index, shards, metadata = assert_same_samples(tmp_path / "shards", single.path)
    assert index.container == container and index.num_shards > 3
    assert index.names == [shard_name(k, container) for k in range(index.num_shards)]
    assert index.metadata == {key: value for key, value in metadata.items() if key not in FILE_KEYS}
    assert index.settings["shard_size"] == 1500 and index.settings["container"] == container
    assert index.sizes.tolist() == [os.path.getsize(index.path(k)) for k in range(index.num_shards)]
    assert index.checksums == [file_checksum(index.path(k)) for k in range(index.num_shards)]
    inputs = []
    for number, (ids, labels, offsets, shard) in enumerate(shards):
        assert set(shard) - FILE_KEYS == PER_SAMPLE_KEYS | {"num_samples", "lengths", "shard"}
        assert {key: shard[key] for key in PER_SAMPLE_KEYS} == {key: metadata[key] for key in PER_SAMPLE_KEYS}
        assert shard["num_samples"] == len(labels) and shard["shard"]["number"] == number
        lengths = np.diff(offsets)
        assert shard["lengths"]["num_tokens"] == len(ids) == lengths.sum()
        assert (shard["lengths"]["min"], shard["lengths"]["max"]) == (lengths.min(), lengths.max())
        inputs.append(shard["shard"]["inputs"])
    # Input ranges cover every input once, the skipped ones (0, 17, 39) in the shard after them or the last.
    assert inputs[0][0] == 0 and inputs[-1][1] == 40
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(inputs, inputs[1:]))
    assert sum(shard[3]["lengths"]["truncated"] for shard in shards) == metadata["lengths"]["truncated"] > 0


@settings(max_examples=25, deadline=None)
@given(shard_size=st.one_of(st.integers(1, 600), st.integers(600, 15000), st.just(64 << 20)))
@pytest.mark.slow
def test_shard_boundaries_follow_the_shard_size(packed_text, text_corpus, shard_size):
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "shards")
        convert(text_corpus / "train", root, shard_size=shard_size)
        index, shards, _ = assert_same_samples(root, packed_text("hdf5"))  # every sample once, in order
    sizes = [stored_bytes(shard) for shard in shards]
    for k, shard in enumerate(shards):
        assert sizes[k] <= shard_size or len(shard[1]) == 1
        if k + 1 < len(shards):  # as full as it can be: the next shard's first sample would not have fit
            first_next = shards[k + 1][2][1] * shards[k + 1][0].itemsize + SAMPLE_BYTES
            assert sizes[k] + first_next > shard_size
    assert index.num_shards == 1 or shard_size < sum(sizes)


@pytest.mark.parametrize("container", list(FORMATS))
def test_folders_are_byte_identical_for_any_number_of_workers(text_corpus, tmp_path, container):
    for workers in (1, 2):
        convert(text_corpus / "train", tmp_path / f"w{workers}", workers=workers, format=container, shard_size=3000)
    names = folder_listing(tmp_path / "w1")
    assert names == folder_listing(tmp_path / "w2") and INDEX_NAME in names and len(names) > 3
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_default_shard_size_gives_one_shard_and_the_default_container(text_corpus, tmp_path):
    convert(text_corpus / "train", tmp_path / "shards")
    assert os.listdir(tmp_path) == ["shards"]  # the staging folder is gone
    assert sorted(os.listdir(tmp_path / "shards")) == [INDEX_NAME, "labels.npy", "lengths.npy", "shard-00000.h5"]
    assert read_index(tmp_path / "shards").settings["shard_size"] == 64 << 20


def test_existing_output_is_kept_without_overwrite_and_replaced_with_it(text_corpus, textshard_source, tmp_path):
    out = tmp_path / "shards"
    convert(text_corpus / "train", out, shard_size=4000)
    before = {name: (out / name).read_bytes() for name in folder_listing(out)}
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        convert(textshard_source, out, shard_size=4000)
    assert {name: (out / name).read_bytes() for name in folder_listing(out)} == before
    convert(textshard_source, out, shard_size=4000, overwrite=True)
    assert read_index(out).metadata["source"]["path"] == os.fspath(textshard_source)
    assert sorted(os.listdir(tmp_path)) == ["shards"]


def test_an_empty_folder_is_new_and_a_file_or_other_files_are_never_replaced(textshard_source, tmp_path):
    (tmp_path / "empty").mkdir()
    convert(textshard_source, tmp_path / "empty")  # no overwrite needed
    assert read_index(tmp_path / "empty").num_samples == 37
    (tmp_path / "file").write_text("x")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_text("x")
    with pytest.raises(OutputExistsError, match="is a file; a shard folder needs a new or empty folder"):
        convert(textshard_source, tmp_path / "file", overwrite=True)
    with pytest.raises(OutputExistsError, match="holds other files \\('cat.jpg', ...\\), not a fastdata shard"):
        convert(textshard_source, tmp_path / "photos", overwrite=True)
    assert (tmp_path / "file").read_text() == "x" and os.listdir(tmp_path / "photos") == ["cat.jpg"]
    assert sorted(os.listdir(tmp_path)) == ["empty", "file", "photos"]


def test_an_output_folder_holding_the_source_is_refused(textshard_source, tmp_path):
    out = convert(textshard_source, tmp_path / "shards").path
    src = shutil.copy(textshard_source, out)  # a shard folder that now holds a source
    with pytest.raises(OptionError, match="holds .* the source of this conversion"):
        convert(src, out, overwrite=True)
    assert os.path.isfile(src) and read_index(out).num_samples == 37


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"shard_size": 0}, OptionError, "shard_size should be a positive number of bytes"),
        ({"shard_size": "64MB"}, TypeError, "shard_size should be a number of bytes, got str"),
        ({"format": "zip"}, OptionError, "format should be one of"),
    ],
)
def test_bad_shard_options_are_refused_before_any_work(textshard_source, tmp_path, options, error, match):
    with pytest.raises(error, match=match):
        convert(textshard_source, tmp_path / "shards", **options)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("options", "match"), [({"format": "arrow"}, "disagrees with the extension"),
                                                ({"shard_size": 1000}, "shard_size needs a shard folder")])
def test_shard_options_with_a_single_file_output_are_refused(textshard_source, tmp_path, options, match):
    with pytest.raises(OptionError, match=match):
        convert(textshard_source, tmp_path / "one.h5", **options)
    assert os.listdir(tmp_path) == []


def test_a_format_that_agrees_with_the_extension_writes_the_single_file(textshard_source, tmp_path):
    convert(textshard_source, tmp_path / "one.arrow", format="arrow")
    assert os.listdir(tmp_path) == ["one.arrow"]


@pytest.mark.parametrize("container", list(FORMATS))
def test_the_folder_reads_as_the_single_file_item_by_item_and_batch_by_batch(textshard_source, tmp_path, container):
    single = open_dataset(convert(textshard_source, tmp_path / f"one{FORMATS[container]}", max_length=50).path)
    folder = open_dataset(convert(textshard_source, tmp_path / "shards", max_length=50, format=container,
                                  shard_size=700).path)
    assert folder.num_shards > 5 and len(folder) == len(single) == 37
    assert folder.metadata == {key: value for key, value in single.metadata.items() if key not in FILE_KEYS}
    assert folder.classes == single.classes and folder.read_options == single.read_options
    assert np.array_equal(folder.labels, single.labels) and np.array_equal(folder.lengths, single.lengths)
    for index in range(-len(single), len(single)):
        (a, label_a), (b, label_b) = folder[index], single[index]
        assert torch.equal(a, b) and label_a == label_b, index
    rng = np.random.default_rng(0)
    for indices in [np.arange(37), rng.permutation(37)[:11], rng.integers(0, 37, 20), np.array([36, 0, 36])]:
        for got, want in zip(folder.read_batch(indices, pad_to=64), single.read_batch(indices, pad_to=64)):
            assert torch.equal(got, want)


def test_a_shard_folders_tokenizer_converts_another_split_as_its_single_file_does(text_corpus, textshard_source,
                                                                                   tmp_path):
    convert(text_corpus / "train", tmp_path / "train.h5", min_freq=2)
    convert(text_corpus / "train", tmp_path / "train", min_freq=2, shard_size=2000)
    by_file = convert(textshard_source, tmp_path / "other.h5", tokenizer=tmp_path / "train.h5")
    by_folder = convert(textshard_source, tmp_path / "other", tokenizer=tmp_path / "train", shard_size=2000)
    _, _, metadata = assert_same_samples(by_folder.path, by_file.path)
    assert metadata["unk_fraction"] > 0  # the other split has words the train vocabulary lacks
    assert read_index(by_folder.path).metadata["tokenizer"] == metadata["tokenizer"]


def test_a_folder_without_an_index_is_no_tokenizer(textshard_source, tmp_path):
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(NotFoundError, match="has no index.json"):
        convert(textshard_source, tmp_path / "out", tokenizer=tmp_path / "unfinished")


# ---------------------------------------------------------------- command line


def test_cli_writes_the_same_folder_as_the_library(text_corpus, tmp_path):
    result = run_cli("convert", "text", text_corpus / "train", tmp_path / "cli", "--format", "arrow",
                     "--shard-size", "4KiB", "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"wrote {os.fspath(tmp_path / 'cli')!r}: 24 samples")
    convert(text_corpus / "train", tmp_path / "lib", format="arrow", shard_size=4096)
    assert read_index(tmp_path / "cli").settings["shard_size"] == 4096
    names = folder_listing(tmp_path / "cli")
    assert names == folder_listing(tmp_path / "lib") and len(names) > 2
    for name in names:
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes(), name
    info = run_cli("info", tmp_path / "cli")
    assert info.exit_code == 0 and "(arrow shards)" in info.output and "samples:     24" in info.output, info.output
    verified = run_cli("verify", tmp_path / "cli")
    assert verified.exit_code == 0 and ": ok (" in verified.output, verified.output


@pytest.mark.parametrize(("text", "size"), [("64MB", 64 * 10**6), ("256MiB", 256 << 20), ("1GB", 10**9),
                                            ("1.5 kB", 1500), ("4096", 4096)])
def test_cli_shard_size_takes_units(text_corpus, tmp_path, text, size):
    result = run_cli("convert", "text", text_corpus / "train", tmp_path / "out", "--shard-size", text,
                     "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert read_index(tmp_path / "out").settings["shard_size"] == size


@pytest.mark.parametrize("text", ["0", "64XB", "MB", "-5", "5kb/"])
def test_cli_bad_shard_size_is_a_usage_error(text_corpus, tmp_path, text):
    result = run_cli("convert", "text", text_corpus / "train", tmp_path / "out", "--shard-size", text)
    assert result.exit_code == 2 and "Invalid value for '--shard-size'" in result.output, result.output
    assert os.listdir(tmp_path) == []


def test_cli_shard_size_with_a_single_file_is_one_error_line(text_corpus, tmp_path):
    result = run_cli("convert", "text", text_corpus / "train", tmp_path / "out.h5", "--shard-size", "1MB")
    assert result.exit_code == 1
    assert "shard_size needs a shard folder" in one_error_line(result)


def test_full_disk_while_writing_shards_is_reported_and_leaves_nothing(tmp_path, small_disk):
    texts, labels = make_reviews(300, seed=5)
    src = write_text_file(tmp_path / "reviews.jsonl", texts, labels)
    probe = convert(src, tmp_path / "probe", shard_size=4096)
    num_tokens = read_index(probe.path).metadata["lengths"]["num_tokens"]
    folder_bytes = sum(os.path.getsize(os.path.join(probe.path, name)) for name in os.listdir(probe.path))
    assert folder_bytes > 5 * num_tokens  # many shards: their files take more than the token staging
    # Room for the staged ids (6 bytes a token while they are renumbered), not for those and every shard.
    disk = small_disk(4 * num_tokens + folder_bytes // 2)
    with pytest.raises(FastdataError, match="no space left on the device") as info:
        convert(src, disk / "out", shard_size=4096)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert folder_listing(disk) == []


def test_a_disk_full_at_any_point_is_one_error_line_never_a_crash(tmp_path, small_disk):
    texts, labels = make_reviews(300, seed=6)
    src = write_text_file(tmp_path / "reviews.jsonl", texts, labels)
    for size in range(300 << 10, 700 << 10, 50 << 10):  # before NOTE [hdf5 full disk]: 4 of 8 segfaulted
        disk = small_disk(size)
        done = subprocess.run([sys.executable, "-m", "fastdata", "convert", "text", src, disk / "out", "--tokenizer",
                               "bytes", "--shard-size", "32KiB", "--workers", "1", "--quiet"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 1), (size, done.returncode, done.stderr[-2000:])
        if done.returncode == 1:
            assert done.stderr.startswith("Error: no space left on the device"), (size, done.stderr[-2000:])
            assert len(done.stderr.strip().splitlines()) == 1 and folder_listing(disk) == [], size


def test_staged_ids_and_shards_never_fill_the_disk_twice(tmp_path, small_disk):
    texts, labels = make_reviews(300, seed=6)
    src = write_text_file(tmp_path / "reviews.jsonl", texts, labels)
    probe = convert(src, tmp_path / "probe", tokenizer="bytes", shard_size=32 << 10)
    index = read_index(probe.path)
    staged = index.metadata["lengths"]["num_tokens"] * np.dtype(index.metadata["sample_dtype"]).itemsize
    folder = sum(os.stat(os.path.join(probe.path, name)).st_blocks * 512 for name in os.listdir(probe.path))
    assert index.num_shards > 10 and max(index.sizes) < staged // 8
    # Room for the folder and half the staged ids: not for all of both at once.
    disk = small_disk(folder + staged // 2)
    convert(src, disk / "out", tokenizer="bytes", shard_size=32 << 10)
    assert folder_listing(disk / "out") == folder_listing(probe.path)
    assert os.listdir(disk) == ["out"]


# ---------------------------------------------------------------- interrupted

# The CLI with every shard write taking DELAY more seconds, so a test can signal it mid-folder.
SLOW_SHARDS_SCRIPT = textwrap.dedent(
    """
    import os
    import time

    from fastdata.converters import textshards

    _real_write_shard = textshards.write_shard


    def _slow_write_shard(*args):
        facts = _real_write_shard(*args)
        time.sleep(float(os.environ["DELAY"]))
        return facts


    textshards.write_shard = _slow_write_shard

    if __name__ == "__main__":
        from fastdata.cli import main

        main()
    """
)


def start_slow_conversion(tmp_path, src, out):
    script = tmp_path / "slow_shards.py"
    script.write_text(SLOW_SHARDS_SCRIPT)
    command = [sys.executable, os.fspath(script), "convert", "text", os.fspath(src), os.fspath(out),
               "--shard-size", "3000", "--workers", "1", "--quiet"]
    return subprocess.Popen(command, env={**os.environ, "DELAY": "0.5"}, stderr=subprocess.PIPE, text=True)


def wait_for_staged_shards(out, count, folders=1, seconds=120):
    """Wait until ``folders`` conversions into ``out`` each have ``count`` shards in their staging folders."""
    pattern = os.path.join(glob.escape(os.fspath(out.parent)), f".{out.name}.*.partial", out.name, "shard-*")
    deadline = time.monotonic() + seconds
    while True:
        written = [os.path.dirname(path) for path in glob.glob(pattern)]
        if sum(written.count(folder) >= count for folder in set(written)) >= folders:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {count} shards in {folders} staging folders"
        time.sleep(0.005)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
@pytest.mark.integration
def test_interrupted_conversion_leaves_no_folder_and_the_next_run_cleans_up(text_corpus, tmp_path, signum):
    out = tmp_path / "out" / "shards"
    out.parent.mkdir()
    process = start_slow_conversion(tmp_path, text_corpus / "train", out)
    wait_for_staged_shards(out, 2)  # two of its six shards written
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "Traceback" not in stderr
    left = os.listdir(out.parent)
    assert "shards" not in left
    assert all(name.startswith(".shards.") and name.endswith(".partial") for name in left)
    assert bool(left) == (signum == signal.SIGKILL)  # a killed process leaves its hidden staging folder
    # --resume starts again, and like any conversion into that folder removes the orphan.
    result = run_cli("convert", "text", text_corpus / "train", out, "--shard-size", "3000", "--resume", "--quiet")
    assert result.exit_code == 0, result.output
    assert "a text conversion starts again from the first text" in result.stderr
    assert os.listdir(out.parent) == ["shards"]
    assert read_index(out).num_samples == 24


@pytest.mark.integration  # a subprocess killed, signalled or raced
def test_concurrent_conversions_to_one_folder_one_wins_the_other_fails_cleanly(text_corpus, textshard_source,
                                                                                tmp_path):
    out = tmp_path / "out" / "shards"
    out.parent.mkdir()
    first = start_slow_conversion(tmp_path, text_corpus / "train", out)
    second = start_slow_conversion(tmp_path, textshard_source, out)
    wait_for_staged_shards(out, 1, folders=2)  # both are past their checks, writing shards
    results = [process.communicate(timeout=120)[1] for process in (first, second)]
    codes = sorted(process.returncode for process in (first, second))
    assert codes == [0, 1], results
    loser = results[[first.returncode, second.returncode].index(1)]
    assert "already exists (written by another process during this conversion)" in loser
    assert os.listdir(out.parent) == ["shards"]
    winner = text_corpus / "train" if first.returncode == 0 else textshard_source
    assert read_index(out).metadata["source"]["path"] == os.fspath(winner)
